"""fastllm: an LLM inference engine.

The public names load lazily, so `import fastllm.core...` (pure Python) does not pull in torch.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "BeamSearchOutput"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "fastllm.entrypoints.llm",
    "SamplingParams": "fastllm.sampling_params",
    "BeamSearchParams": "fastllm.sampling_params",
    "BeamSearchOutput": "fastllm.outputs",
    "RequestOutput": "fastllm.outputs",
    "CompletionOutput": "fastllm.outputs",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'fastllm' has no attribute {name!r}")
