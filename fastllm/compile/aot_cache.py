"""The compiled forward saved to disk, so the next start of the same model skips Dynamo.

Inductor's caches already spare a warm start the code generation, but Dynamo still traces the whole
model again (most of a warm compile for a 32-layer model). torch's AOT compile
(`torch.compile(...).aot_compile`, torch >= 2.10) returns the traced and compiled function, guards
included, which can be saved and loaded in another process.

The artifact holds no weights: the model is the function's first argument, its parameters are graph
inputs. Its file name is a hash of everything the trace depends on: the model config (and this rank's
shard of it) and dtype, the device, the intra-op thread count, the torch/triton/Python versions and
fastllm's own source. A load whose guards reject the model, or that fails at all, is logged and replaced
by a fresh compile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the fastllm package


def available() -> bool:
    import torch._dynamo.config as dynamo_config

    return hasattr(dynamo_config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")


def disabled_by_env() -> bool:
    return os.environ.get("FASTLLM_DISABLE_COMPILE_CACHE", "0").strip().lower() in ("1", "true", "yes")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_SOURCE_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(_SOURCE_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def artifact_key(model: torch.nn.Module, device: torch.device) -> str:
    param = next(model.parameters())
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    facts = {
        "config": model.args.__dict__ if hasattr(model, "args") else repr(model),
        "parallel": repr(getattr(model, "parallel", None)),  # each rank's shard traces its own graph
        "dtype": str(param.dtype),
        "device": device.type,
        # Inductor's C++ for a CPU uses the vector instructions it finds (a shared cache directory
        # must not hand AVX-512 code to an AVX2 machine).
        "cpu_isa": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        "gpu": (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton_version, "python": sys.version, "machine": platform.machine(),
        # Dynamo guards on the intra-op thread count (its global state): a forward traced under another
        # count (a test process's 1, a TP worker's share of the cores) is rejected, so each has its file.
        "num_threads": torch.get_num_threads(),
        "fastllm": _source_digest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _bind(compiled, model: torch.nn.Module) -> Callable:
    # The guards were checked once on the model and inputs of this runner; the runner always calls
    # with the same kinds of tensors, so checking them again each step would only cost host time.
    if hasattr(compiled, "disable_guard_check"):
        compiled.disable_guard_check()
    return functools.partial(compiled, model)


def _load(path: Path, model: torch.nn.Module, example: tuple) -> Callable | None:
    """The loaded forward, already run once on example; None (logged) if it cannot be used."""
    from torch._inductor import config as inductor_config

    try:
        # Its kernels load from Triton's cache in this process: left to Inductor, the first one starts its
        # pool of compile workers (a process per core), which compiles nothing here and delays the exit.
        with inductor_config.patch(compile_threads=1):
            # Loaded under inference mode, as it was traced: the guards compare dispatch keys.
            with open(path, "rb") as f, torch.inference_mode():
                compiled = torch.compiler.load_compiled_function(f)
            # Clones: the example's unbacked-dim marks are for tracing, and a guard rejects a marked input.
            if not compiled.guard_check(model, *(x.clone() for x in example)):
                logger.warning("compiled forward in %s does not fit this model (a guard failed: %s): "
                               "compiling again", path, _failed_guard(compiled, model, example))
                return None
            forward = _bind(compiled, model)
            forward(*example)  # kernels that fail to load show here, not in the first step
    except Exception as e:  # noqa: BLE001  (a stale or broken file must never stop the engine)
        logger.warning("could not load the compiled forward in %s (%s: %s): compiling again",
                       path, type(e).__name__, e)
        return None
    return forward


def _failed_guard(compiled, model: torch.nn.Module, example: tuple) -> str:
    """Which guard rejected the model, as Dynamo says it (through its private guard manager: "unknown"
    where that is not there)."""
    try:
        f_locals = compiled.prepare_f_locals(model, *(x.clone() for x in example))
        return str(compiled._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)
    except Exception:  # noqa: BLE001  (a diagnostic only)
        return "unknown"


def _save(compiled, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        result = type(compiled).serialize(compiled)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(result.serialized_data if hasattr(result, "serialized_data") else result)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001  (the engine runs fine without the file)
        logger.warning("could not save the compiled forward to %s (%s: %s)", path, type(e).__name__, e)
        tmp.unlink(missing_ok=True)


def load_or_compile(model: torch.nn.Module, example: tuple, cache_root: Path) -> tuple[Callable, str]:
    """The compiled forward(input_ids, positions), already run once on example (the first call's
    inputs, token dim marked unbacked), and how it was obtained ("loaded <path>" or "compiled,
    saved to <path>"). Raises if the AOT compile itself fails (the caller falls back)."""
    import torch._dynamo.config as dynamo_config

    path = cache_root / "aot" / f"forward-{artifact_key(model, example[0].device)}.bin"
    if path.exists():
        start = time.perf_counter()
        forward = _load(path, model, example)
        if forward is not None:
            logger.debug("loaded %s in %.2f s", path, time.perf_counter() - start)
            return forward, f"loaded {path}"
    dynamo_config.enable_aot_compile = True
    compiled_fn = torch.compile(type(model).forward, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        compiled = compiled_fn.aot_compile(((model, *example), {}))
    forward = _bind(compiled, model)
    forward(*example)
    _save(compiled, path)  # only a forward that ran
    return forward, f"compiled, saved to {path}"

