"""Memory that lives for the whole run: weights, main gradients, optimizer states, FP8 weight copies.

- Weights: the model dtype (bf16: 2 bytes/param). Under FP8 (bf16 primary weights), Transformer
  Engine caches each GEMM weight quantized for the step, once row-wise (forward) and once
  column-wise / transposed (data gradient): 2 more FP8 bytes per GEMM weight. With
  `fp8_param_gather` the FP8 copies are the primary weights and the bf16 ones are gone. Our FP8
  experts (`moe_fp4_experts: fp8`) and FP8 linears (`moe_fp4_linears: fp8`) keep one copy of their
  weights (W, 128x128 blocks, padded to multiples of 128), quantized at a step's first forward and
  held to the next step's, in a run without Transformer Engine too, unless
  `moe_fp4_weights_per_use`; the data gradient's W^T is transient (activations.py) unless
  `moe_fp4_keep_transposed_weights` keeps it beside W (padded alike: the same bytes). Only
  the FP8 roles' linears count (ParamCount.fp8_linear): a role `moe_fp4_bf16_linears` names keeps
  Megatron's layers, with Transformer Engine's copies under FP8 as without our linears.
- Gradients: Megatron's DDP accumulates and reduces main gradients in `main_grads_dtype` (fp32 for
  bf16 training: 4 bytes/param), one contiguous buffer.
- Optimizer (Adam): an fp32 master copy (`main_params_dtype`) and the two moments (`exp_avg_dtype`,
  `exp_avg_sq_dtype`; fp32 unless `use_precision_aware_optimizer` says otherwise). The distributed
  optimizer shards them over the data-parallel group for dense parameters and over the
  expert-data-parallel group for routed-expert parameters; without it every rank holds all.
  `optimizer_cpu_offload` moves `optimizer_offload_fraction` of the states to the host; the fp32
  master shard the distributed optimizer builds stays on the GPU unless the precision-aware
  optimizer is on (then the hybrid optimizer holds the master copy itself, offloaded with the rest).
"""

from dataclasses import dataclass

from .params import ParamCount
from .precision import FP8_128X128_BYTES, Precision, dtype_bytes


@dataclass(frozen=True)
class Static:
    weights: float
    grads: float
    optimizer: float
    workspace: float = 0.0  # persistent buffers (unfused attention's score buffer)
    # cuBLAS workspaces and cached dummy weight gradients of the weight-gradient path (wgrad_buffers.py)
    wgrad_buffers: float = 0.0

    @property
    def buffers(self) -> float:
        """Persistent buffers that are neither weights nor optimizer state."""
        return self.workspace + self.wgrad_buffers

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers


def optimizer_bytes_per_param(args) -> float:
    """GPU bytes per parameter held by the sharding group (divide by its size for the shard)."""
    aware = bool(args.use_precision_aware_optimizer)
    master = dtype_bytes(args.main_params_dtype) if aware else 4
    moments = (dtype_bytes(args.exp_avg_dtype) + dtype_bytes(args.exp_avg_sq_dtype)) if aware else 8
    if not args.optimizer_cpu_offload:
        return master + moments
    on_gpu = 1.0 - float(args.optimizer_offload_fraction)
    if aware:
        return on_gpu * (master + moments)
    return master + on_gpu * moments


def static_memory(args, counts: ParamCount, p: Precision, dp: int, edp: int, workspace: float = 0.0,
                  wgrad_buffers: float = 0.0) -> Static:
    weights = counts.total * p.model_bytes
    if p.fp8:  # Transformer Engine's GEMMs: those not replaced by ours (fp8_linear: the FP8 roles' only)
        gemm = counts.dense_gemm - counts.fp8_linear + (0 if p.fp8_experts else counts.expert_gemm)
        if args.fp8_param_gather:
            weights -= gemm * p.model_bytes  # the FP8 copies are the parameters
        weights += 2 * gemm * p.fp8_weight_bytes
    if not p.weights_per_use:  # W of our experts and linears (megatron_fp4/fp8/weight_cache.py), and W^T
        copies = 2 if p.keep_transposed_weights else 1
        if p.fp8_experts:
            weights += copies * counts.expert_gemm * FP8_128X128_BYTES
        weights += copies * counts.fp8_linear_padded * FP8_128X128_BYTES  # the FP8 roles' (none: 0)
    grads = counts.total * dtype_bytes(args.main_grads_dtype)
    per = optimizer_bytes_per_param(args)
    if args.use_distributed_optimizer:
        optimizer = per * (counts.dense / dp + counts.expert / edp)
    else:
        optimizer = per * counts.total
    return Static(weights=weights, grads=grads, optimizer=optimizer, workspace=workspace,
                  wgrad_buffers=wgrad_buffers)
