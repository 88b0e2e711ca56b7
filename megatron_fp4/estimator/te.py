"""Transformer Engine's own allocations in a run on its layers (`transformer_impl:
transformer_engine`), read from its code (release 2.8, the one the FP8-Flow-MoE fork ships:
pytorch/module/base.py, linear.py, grouped_linear.py) and from Megatron-Core 0.19's
tensor_parallel/layers.py. All three are PyTorch allocations, so they count in the allocated peak:

- cuBLAS workspaces, kept for the run: one of 32 MiB + 1 KiB on Hopper (`get_workspace`) and, once a
  grouped GEMM has run, one more per stream of its pool (`get_multi_stream_cublas_workspace`, 4 streams).
- Persistent dummy weight gradients: under gradient-accumulation fusion Megatron's DDP marks every
  weight (`grad_added_to_main_grad`); the backward then adds the weight gradient into `main_grad`
  itself and hands autograd `get_dummy_wgrad(shape)`: one uninitialized tensor per distinct weight
  shape and dtype, cached for the run. Transformer Engine's linears do so, and so do Megatron's own
  (the output layer) when Transformer Engine is installed, which a run on its layers implies.
- The grouped experts' dummy weight gradients: Transformer Engine's GroupedLinear under the same
  fusion allocates a fresh weight-sized tensor for every local expert instead
  (`handle_custom_ddp_from_mcore`), returned together from its backward and freed as DDP's hooks
  take them; fc1's are alive when the experts' backward ends (a transient of the MoE backward).

Our FP8 experts and linears replace these modules and allocate none of it; a run on Megatron's
local layers may still have Transformer Engine installed (its output layer would then take a
dummy too): not counted, the config does not say.
"""

from .params import linear_shapes_by_role
from .shapes import DENSE, LOSS, MOE, MTP, ModelShape, Parallel

CUBLAS_WORKSPACE_BYTES = 32 * 2**20 + 1024
GROUPED_GEMM_STREAMS = 4


def grouped_experts(s: ModelShape, fp8_experts: bool) -> bool:
    """The routed experts are Transformer Engine's GroupedLinear (not ours)."""
    return s.te and bool(s.experts) and s.grouped_gemm and not fp8_experts


def _layer_kinds(chunks) -> set:
    kinds = set()
    for chunk in chunks:
        for kind, _ in chunk:
            kinds.add(kind)
    return kinds


def dummy_wgrad_shapes(s: ModelShape, par: Parallel, chunks) -> set:
    """The distinct weight shapes whose dummy gradient one pipeline rank caches: each decoder
    layer's linears (attention, MLA up-projections, dense MLP or shared experts; split over TP,
    counted as if each were), the output layer's on the rank computing the loss."""
    kinds = _layer_kinds(chunks)
    if MTP in kinds:
        kinds.add(MOE if s.mtp_is_moe else DENSE)
    shapes = set()
    for kind in (DENSE, MOE):
        if kind in kinds:
            for role_shapes in linear_shapes_by_role(s, kind).values():
                shapes.update((out // par.tp, inp) for out, inp in role_shapes)
    if LOSS in kinds:
        shapes.add((s.vocab // par.tp, s.hidden))
    return shapes


def persistent_bytes(s: ModelShape, par: Parallel, chunks, model_bytes: int, fp8_experts: bool) -> float:
    """The workspaces and cached dummy weight gradients one pipeline rank keeps for the run."""
    if not s.te:
        return 0.0
    workspaces = CUBLAS_WORKSPACE_BYTES * (1 + (GROUPED_GEMM_STREAMS if grouped_experts(s, fp8_experts) else 0))
    if not s.wgrad_fusion:
        return float(workspaces)
    dummies = sum(out * inp for out, inp in dummy_wgrad_shapes(s, par, chunks)) * model_bytes
    return float(workspaces + dummies)


def grouped_dummy_wgrads_bytes(s: ModelShape, par: Parallel, model_bytes: int, fp8_experts: bool) -> float:
    """fc1's per-expert dummy weight gradients, alive at the end of one MoE layer's backward."""
    if not (grouped_experts(s, fp8_experts) and s.wgrad_fusion):
        return 0.0
    local_experts = s.experts // par.ep
    fc1_elements = s.fc1_factor * s.moe_ffn_hidden * s.hidden // par.etp
    return float(local_experts * fc1_elements * model_bytes)
