"""Which optional kernels this machine has: the launcher's defaults and layer specs depend on it."""

from megatron.core.models.backends import HAVE_APEX  # noqa: F401  (without apex, local layer norm is torch's)


def importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


HAVE_TE = importable("transformer_engine")
# Kernels that some default-on Megatron options need; none ships with the megatron-core wheel.
HAVE_APEX_GRAD_ACCUM = importable("fused_weight_gradient_mlp_cuda")
HAVE_FUSED_SOFTMAX = importable("scaled_masked_softmax_cuda")
