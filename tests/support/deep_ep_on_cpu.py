"""Makes the project's DeepEP stand-in (tests/support/deep_ep_standin/deep_ep) the `deep_ep` that
Megatron-Core imports, in a test process of its own (it changes sys.path and Megatron modules).

Megatron's fused_a2a decides at import time whether DeepEP is there (HAVE_DEEP_EP, and it defines
fused_dispatch / fused_combine / set_deepep_num_sms only then), and token_dispatcher binds those
names when it is imported. install() therefore works whenever it is called:
- fused_a2a not imported yet: the path goes first on sys.path and the later import finds the
  stand-in;
- fused_a2a already imported without DeepEP (the usual case here: support/cuda_on_cpu.install(),
  which the two-rank workers run first, imports token_dispatcher): fused_a2a is reloaded in place
  (the same module object, so `import fused_a2a` users see the new functions) and the three names
  token_dispatcher took from it are bound again. Reloading token_dispatcher itself is avoided: it
  would make new dispatcher classes behind the ones moe_layer already holds, and drop the patches
  cuda_on_cpu put on it.
It refuses a process where another `deep_ep` (a real DeepEP) was imported already."""

import importlib
import os
import sys

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deep_ep_standin")
_FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_BOUND_IN_DISPATCHER = ("fused_dispatch", "fused_combine", "set_deepep_num_sms")


def install() -> None:
    if STANDIN not in sys.path:
        sys.path.insert(0, STANDIN)
    import deep_ep

    assert os.path.dirname(os.path.dirname(os.path.abspath(deep_ep.__file__))) == STANDIN, \
        f"another deep_ep was imported before the stand-in: {deep_ep.__file__}"
    fused_a2a = sys.modules.get(_FUSED_A2A)
    if fused_a2a is None:
        return
    if not (fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is deep_ep.Buffer):
        importlib.reload(fused_a2a)
    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is deep_ep.Buffer, "fused_a2a did not take the stand-in"
    dispatcher = sys.modules.get(_DISPATCHER)
    if dispatcher is not None:
        for name in _BOUND_IN_DISPATCHER:
            setattr(dispatcher, name, getattr(fused_a2a, name))
