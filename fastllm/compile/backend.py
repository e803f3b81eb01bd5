"""torch.compile of the model forward: one graph, no breaks, dynamic in the number of tokens (1 included).

Our kernels are custom ops (custom_ops.py), so Dynamo traces straight through the model;
`fullgraph=True` makes any graph break an error rather than a silent slowdown. Inductor's caches
live under a fastllm cache directory, and the compiled forward itself is saved there (aot_cache.py),
so a second start of the same model neither generates code nor traces again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from fastllm.compile_cache import cache_dir

logger = logging.getLogger(__name__)


def configure_inductor_cache() -> Path:
    """Point Inductor's on-disk caches (FX graphs, AOTAutograd, Triton binaries) at our directory."""
    path = cache_dir() / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(inductor_config, "autotune_local_cache"):
        inductor_config.autotune_local_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def configure_dynamo() -> None:
    import torch._dynamo.config as dynamo_config

    # Dynamo keys its cache on the code object, so every model instance in a process (tests,
    # benchmarks comparing configurations) adds an entry: allow many before giving up.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 1024)
    # Python floats (eps, softmax scale, rope constants) are constants of the model, not inputs. Left
    # symbolic under dynamic=True, they make Dynamo trace the whole model twice (it restarts once
    # it finds them used as tensors), and the AOT compile does not restart at all.
    dynamo_config.specialize_float = True


def register_fallback_kernels() -> None:
    """Tell Inductor up front that every fastllm:: op runs as it is (a fallback kernel), with the layout
    constraint it would pick itself. Left to Inductor, the first sight of each op in a graph creates its
    fallback, and torch 2.11 formats that op's arguments into a log message whether or not the log is on;
    an argument's text spells out the whole graph above it, repeating shared nodes, so its length doubles
    with every layer. The FP8 Llama's final norm, the first plain fused_add_rms_norm after 32 layers of
    FP8 ops, never finished compiling (torch 2.13 formats the message lazily)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace != "fastllm":
            continue
        op = getattr(torch.ops.fastllm, op_name).default
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint)


def compile_forward(model: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor]):
    """The compiled model.forward(input_ids [T], positions [T]) -> hidden [T, H], already run once on
    `example` (inputs from mark_tokens_unbacked, under inference mode and a forward context).
    Returns (forward, how): how says whether it was compiled or loaded from the cache directory."""
    from fastllm.compile import aot_cache

    configure_inductor_cache()
    configure_dynamo()
    register_fallback_kernels()
    if aot_cache.disabled_by_env():
        how = "compiled (FASTLLM_DISABLE_COMPILE_CACHE=1: not saved)"
    elif not aot_cache.available():
        how = f"compiled (torch {torch.__version__} has no AOT compile: not saved, a restart traces again)"
    else:
        try:
            return aot_cache.load_or_compile(model, example, cache_dir())
        except Exception as e:  # noqa: BLE001  (torch.compile without saving still works)
            logger.warning("AOT compile failed (%s: %s): compiling with torch.compile, not saved",
                           type(e).__name__, e)
            how = f"compiled (AOT compile failed: {type(e).__name__}; not saved)"
    forward = torch.compile(model.forward, fullgraph=True, dynamic=True)
    forward(*example)
    return forward, how


def mark_tokens_unbacked(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark dim 0 (the token count) of the first call's inputs unbacked, so Dynamo traces one graph for
    every count: a backed dynamic size is specialized on 0 and 1, and a 1-token decode step would compile
    a second whole-model graph (about half of the compile time at startup)."""
    from torch._dynamo.decorators import mark_unbacked

    for x in inputs:
        mark_unbacked(x, 0)
    return inputs
