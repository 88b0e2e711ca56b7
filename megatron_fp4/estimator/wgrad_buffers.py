"""Buffers of the weight-gradient path that PyTorch allocates besides the saved activations, read
from Transformer Engine's code (release 2.8, the one the FP8-Flow-MoE fork ships:
pytorch/module/base.py, linear.py, grouped_linear.py), Megatron-Core 0.19's
tensor_parallel/layers.py and ours (megatron_fp4/main_grad.py). They count in the allocated peak:

- cuBLAS workspaces, kept for the run (Transformer Engine's layers only): one of 32 MiB + 1 KiB on
  Hopper (`get_workspace`) on a rank with any of its linears and, where its grouped experts run,
  one more per stream of their pool (`get_multi_stream_cublas_workspace`, 4 streams).
- Cached dummy weight gradients: under gradient-accumulation fusion Megatron's DDP marks every
  weight (`grad_added_to_main_grad`); backward adds the weight gradient into `main_grad` itself and
  hands autograd a dummy, one uninitialized tensor per distinct weight shape, cached for the run.
  Transformer Engine's linears do so (`get_dummy_wgrad`), Megatron's own linears too when it is
  installed (the output layer), and so do our FP8 linears and experts (main_grad.py). Megatron's
  own linears without Transformer Engine allocate a fresh dummy per backward instead: not counted,
  a config on local layers does not say whether Transformer Engine is installed.
- The grouped experts' dummy weight gradients: Transformer Engine's GroupedLinear under the same
  fusion allocates a fresh weight-sized tensor for every local expert (`handle_custom_ddp_from_mcore`),
  returned together from its backward and freed as DDP's hooks take them; fc1's are alive when the
  experts' backward ends (a transient of the MoE backward).

Sizes follow tensor parallelism as the layers split (column-parallel outputs, row-parallel inputs;
MLA's down-projections are not split) and ETP for the experts.
"""

from ..options import LinearRole
from .params import linear_shapes_by_role
from .precision import Precision
from .shapes import DENSE, LOSS, MOE, MTP, ModelShape, Parallel

CUBLAS_WORKSPACE_BYTES = 32 * 2**20 + 1024
GROUPED_GEMM_STREAMS = 4


def te_grouped_experts(s: ModelShape, p: Precision) -> bool:
    """The routed experts are Transformer Engine's GroupedLinear (not ours)."""
    return s.te and bool(s.experts) and s.grouped_gemm and not p.fp8_experts


def _rank_layer_kinds(s: ModelShape, chunks) -> set:
    kinds = {kind for chunk in chunks for kind, _ in chunk}
    if MTP in kinds:
        kinds.add(MOE if s.mtp_is_moe else DENSE)
    return kinds


# The linears whose weight is split along its input over TP (row-parallel): by role, the index in
# linear_shapes_by_role's list; the others split their output, except MLA's q / kv down-projections.
_ROW_PARALLEL = {LinearRole.ATTENTION: 2, LinearRole.DENSE_MLP: 1, LinearRole.SHARED_EXPERTS: 1}


def _local_shape(s: ModelShape, par: Parallel, role: LinearRole, index: int, shape) -> tuple:
    """The weight's shape on this rank."""
    out, inp = shape
    if s.mla and role is LinearRole.ATTENTION and index < 2:  # MLA's q / kv down-projections
        return out, inp
    if _ROW_PARALLEL.get(role) == index:
        return out, inp // par.tp
    return out // par.tp, inp


def dummy_shapes(s: ModelShape, par: Parallel, p: Precision, kinds: set) -> set:
    """The shapes of the weights on this rank whose dummy gradient is cached: one dummy per shape,
    since each cache is keyed by shape (ours shared by our FP8 linears and experts, as Transformer
    Engine's by its layers), so e.g. DeepSeek-V3's experts share the shared expert's two."""
    shapes = set()
    for kind in (DENSE, MOE):
        if kind not in kinds:
            continue
        for role, role_shapes in linear_shapes_by_role(s, kind).items():
            if s.te or p.fp8_linear(role):  # Transformer Engine's linears, or ours
                shapes.update(_local_shape(s, par, role, index, shape) for index, shape in enumerate(role_shapes))
    if MOE in kinds and ((s.te and not s.grouped_gemm) or p.fp8_experts):  # per-expert modules
        ffn = s.moe_ffn_hidden // par.etp
        shapes.update({(s.fc1_factor * ffn, s.hidden), (s.hidden, ffn)})
    if s.te and MTP in kinds:
        shapes.add((s.hidden // par.tp, 2 * s.hidden))  # eh_proj
    if s.te and LOSS in kinds:  # Megatron's output layer takes Transformer Engine's cached dummy
        shapes.add((s.vocab // par.tp, s.hidden))
    return shapes


def persistent_bytes(s: ModelShape, par: Parallel, p: Precision, chunks) -> float:
    """The workspaces and cached dummy weight gradients one pipeline rank keeps for the run."""
    kinds = _rank_layer_kinds(s, chunks)
    workspaces = 0
    if s.te and kinds & {DENSE, MOE}:
        workspaces = CUBLAS_WORKSPACE_BYTES * (1 + (GROUPED_GEMM_STREAMS if MOE in kinds and te_grouped_experts(s, p)
                                                    else 0))
    dummies = sum(rows * cols for rows, cols in dummy_shapes(s, par, p, kinds)) * p.model_bytes if s.wgrad_fusion else 0
    return float(workspaces + dummies)


def grouped_dummy_wgrads_bytes(s: ModelShape, par: Parallel, p: Precision) -> float:
    """fc1's per-expert dummy weight gradients, alive at the end of one MoE layer's backward."""
    if not (te_grouped_experts(s, p) and s.wgrad_fusion):
        return 0.0
    local_experts = s.experts // par.ep
    return float(local_experts * s.fc1_factor * s.moe_ffn_hidden // par.etp * s.hidden * p.model_bytes)
