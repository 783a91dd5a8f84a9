"""Under the Triton interpreter, a @triton.jit function's call patches triton.language's builtins first."""

from __future__ import annotations

import inspect


def patch_the_language_once_a_launch() -> bool:
    """Make the Triton interpreter patch triton.language once a launch, not once a call of every jit function.

    The interpreter (triton 3.6, ``triton.runtime.interpreter._patch_lang``) rewires every builtin of
    triton.language to its numpy implementation when a kernel is launched, and again on every call of a jit helper
    inside it: one ``inspect.getmembers`` scan of the language's modules a call, about 3 ms, a third of an interpreted
    kernel's time on these tests. Inside a launch the second patching changes nothing that matters: a patched builtin
    is no longer a builtin, and the rest are the same closures made again; the launch's own patching is restored when
    it ends, as before. So a helper's call patches only when it sees a language module the launch has not patched.
    Returns whether the interpreter's function was replaced (False where this triton has no such function).
    """
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "once_a_launch", False):
        return original is not None
    patched: set[int] = set()  # the language modules the launch in progress has patched

    class _NothingToRestore:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        modules = {id(value) for value in fn.__globals__.values()
                   if inspect.ismodule(value) and value in (tl, tl.core)}
        if patched and modules <= patched:
            return _NothingToRestore()
        launch = not patched
        scope = original(fn)
        patched.update(modules)
        if launch:
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_lang.once_a_launch = True
    patch_lang.__wrapped__ = original
    interpreter._patch_lang = patch_lang
    return True
