"""A faster Triton interpreter for the CPU tests: the same semantics, less repeated work.

The interpreter patches `triton.language` (every builtin, found with `inspect.getmembers`) when a
kernel launches, and again at every call of a nested `@triton.jit` helper, although the launch's
patches are still in place and the helper's patches would be the same ones. In the CPU suite
those repeats took a quarter of the time of the two-rank checkpoint scenarios (cProfile:
`_patch_lang`, 45k calls, 57 of 220 s). Here a helper call inside a launch skips the patching
when the launch has already patched every language module the helper sees; anything else goes
to the interpreter as before.
"""

import inspect

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    launch = {"covered": None}  # the ids of the language modules the running launch has patched

    def languages(fn) -> frozenset:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    class _LaunchScope:
        """A launch's patch scope: restoring it (the launch's end) also ends the launch."""

        def __init__(self, scope):
            self._scope = scope

        def restore(self):
            launch["covered"] = None
            self._scope.restore()

    def launch_or_helper_patch(fn):
        covered = languages(fn)
        if launch["covered"] is None:  # a kernel launch (helpers are only called inside one)
            launch["covered"] = covered
            return _LaunchScope(patch_lang(fn))
        if covered <= launch["covered"]:
            return interpreter._LangPatchScope()  # a helper: the launch's patches are the same
        return patch_lang(fn)  # a helper that sees other modules: patched, as upstream does

    interpreter._patch_lang = launch_or_helper_patch
    _installed = True
