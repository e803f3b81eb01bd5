"""Triton's interpreter patches triton.language again at every call of a @triton.jit helper inside a kernel
(`InterpretedFunction.__call__` runs `_patch_lang`), and each patch finds the modules' builtins by walking
them with inspect.getmembers: the largest cost of an interpreted model's run. `patch()` walks each module
once and remembers its builtins; a later patch replaces those still in place, as the walk would have found
them. What gets patched, and so what the kernels compute, is the same.
"""

from __future__ import annotations

import inspect


def patch() -> None:
    from triton.language import core
    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_fastllm_once", False):
        return
    builtins: dict[object, list[tuple[str, object]]] = {}  # a module or class -> its builtins, unpatched

    def patch_builtin(pkg, builder, scope) -> None:
        found = builtins.get(pkg)
        if found is None:
            found = builtins[pkg] = [(name, m) for name, m in inspect.getmembers(pkg) if core.is_builtin(m)]
        for name, member in found:
            if getattr(pkg, name, None) is member:  # (not the interpreter's wrapper of it already)
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin._fastllm_once = True
    interpreter._patch_builtin = patch_builtin
