"""The on-disk compile cache: fastllm's cache directory, and Python's bytecode kept in it when the
environment turns bytecode off.

The directory is FASTLLM_CACHE_DIR, else ~/.cache/fastllm. It holds Inductor's caches and the compiled
forward (fastllm/compile/), and for the `fastllm` command Python's bytecode (keep_bytecode). No torch here:
the command calls keep_bytecode before torch is imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("FASTLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastllm")
    return Path(root)


def keep_bytecode() -> str | None:
    """Write Python's bytecode under cache_dir()/pycache when PYTHONDONTWRITEBYTECODE turned writing it off.

    Where that is set and site-packages holds no .pyc files (as on the GPU image we measure on), every
    process compiles torch's compiler stack from source again: 6-8 s of an 8B model's 17-19 s warm start
    there. The `fastllm` command (never the library) calls this first thing, so the bytecode lands in a
    mirror tree under our cache directory and the source tree stays untouched; child processes (Inductor's
    compile workers, the benchmarks' fresh processes) inherit it. Returns the prefix it set, or None when
    bytecode writing was already on or FASTLLM_BYTECODE_CACHE=0 asks to leave Python's setting alone.
    """
    if not sys.dont_write_bytecode or os.environ.get("FASTLLM_BYTECODE_CACHE", "1") == "0":
        return None
    prefix = sys.pycache_prefix or str(cache_dir() / "pycache")
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return prefix
