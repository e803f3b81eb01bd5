"""fastllm: an LLM inference engine."""

from fastllm.entrypoints.llm import LLM
from fastllm.outputs import CompletionOutput, RequestOutput
from fastllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
