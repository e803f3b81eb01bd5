"""Triton's interpreter patches triton.language again at every call of a @triton.jit helper inside a kernel
(`InterpretedFunction.__call__` runs `_patch_lang`): the largest cost of an interpreted model's run. Each
patch walks the helper's module globals for the language modules, walks those modules with
inspect.getmembers for their builtins, and sets the tensor and dtype methods again.

`patch()` keeps what gets patched, and so what the kernels compute, as it was, and does the work once:
- a launch's patch, and a helper's patch of language modules not yet patched in that launch, run as before;
  a helper's patch of modules its launch has patched already is skipped (its scope, which nothing restores,
  would set the same wrappers again);
- each module is walked once for its builtins (a later patch replaces those still in place, as the walk
  would have found them);
- `_get_np_dtype` (a dict of 19 numpy dtypes built at every call) is memoized by the Triton dtype (a
  block's by its element's, as it answers).
"""

from __future__ import annotations

import inspect


def patch() -> None:
    from triton.language import core
    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_fastllm_once", False):
        return
    _walk_modules_once(interpreter, core)
    _patch_languages_once_a_launch(interpreter)
    _memoize_np_dtype(interpreter)


def _walk_modules_once(interpreter, core) -> None:
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


def _patch_languages_once_a_launch(interpreter) -> None:
    import triton.language as tl

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set[int] = set()  # ids of the language modules patched since this launch began
    languages: dict[object, frozenset[int]] = {}  # a jit function -> its module's language modules

    def patch_lang_once(fn):
        found = languages.get(fn)
        if found is None:
            found = languages[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                              if inspect.ismodule(v) and v in (tl, tl.core))
        if found and found <= patched:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        patched.update(found)
        return scope

    def launch_patching_afresh(self, *args, **kwargs):
        patched.clear()  # (the last launch's scope restored its patches)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_afresh


def _memoize_np_dtype(interpreter) -> None:
    import triton.language as tl

    get_np_dtype, found = interpreter._get_np_dtype, {}

    def memoized(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # (unhashable; a block's numpy dtype is its element's)
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):  # (unhashable; answered at once)
            return get_np_dtype(tt_dtype)
        try:
            return found[tt_dtype]
        except KeyError:
            found[tt_dtype] = np_dtype = get_np_dtype(tt_dtype)
            return np_dtype

    interpreter._get_np_dtype = memoized
