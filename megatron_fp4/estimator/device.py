"""Device-level memory: what a GPU monitor (nvidia-smi, DCGM) counts beyond PyTorch's `max
allocated`, the estimate's peak. Four named rows, each an assumption stated with its source
(docs/estimator.md, "Device-level rows"):

- cuda_context: CUDA_CONTEXT_BYTES, the CUDA context and the kernels of the libraries a Megatron run
  loads. About 0.5 GiB is PyTorch's context on an H100 with lazy module loading (CUDA >= 11.7);
  cuBLAS, cuDNN, Transformer Engine, NCCL and DeepEP load a few hundred MiB of kernels on top:
  0.75 GiB in all, not measured here.
- nccl: NCCL's connection buffers, allocated when a communicator first runs an operation. A ring
  collective holds, per channel, one receive connection of the three protocols' buffers (NCCL's
  defaults: SIMPLE 4 MiB (NCCL_BUFFSIZE), LL128 4.6875 MiB, LL 0.5 MiB); NCCL_CHANNELS channels. The
  communicators a training step runs collectives on: the world group (timers, barriers), data
  parallelism (gradients, parameters, losses), expert data parallelism, the model-parallel group
  (gradient norm), the pipeline group (MoE metrics), tensor parallelism and expert parallelism
  (token counts; DeepEP's handshake), each where its size is above one. Only ring connections are
  counted (no tree), and no other group: a lower bound of what NCCL holds. Point-to-point peers (the pipeline's two neighbours; every other expert-parallel rank
  under the alltoall dispatcher, whose all-to-all is NCCL send / receive) hold P2P_CHANNELS channels
  of SIMPLE buffers each way.
- deepep: DeepEP's buffers under the flex dispatcher (Megatron's fused_a2a.get_buffer: the larger of
  the dispatch and combine configs' size hints, DeepEP's default configs for the EP size, hidden
  bytes of BF16 rows, `moe_flex_dispatcher_num_sms` (or the deprecated `moe_deepep_num_sms`) SMs,
  20 by default): the NVLink buffer, its 32 MiB workspace (cudaMalloc'd by every Buffer), and across
  nodes the RDMA buffer in NVSHMEM's symmetric heap, which DeepEP grows in 512 MiB steps
  (NVSHMEM_CUMEM_GRANULARITY). With --moe-fp4-dispatch the same:
  its MXFP4 rows (H/2 + H/32 bytes) are narrower than the BF16 combine's 2H, for which dispatch/
  deepep.py sizes the one shared buffer (hidden_bytes = 2H, as Megatron's BF16 dispatch does).
- allocator_reserve: ALLOCATOR_RESERVE_FRACTION of the peak: what PyTorch's caching allocator holds
  beyond its allocated memory (expandable segments, as our launcher and the FP8-Flow-MoE scripts
  set). Measured on our one-GPU proxies without a cap: max reserved / max allocated 19630 / 17905
  and 19780 / 18121 MiB (benchmarks/results/proxy_memory.jsonl), 1.094 on average. Under memory
  pressure the allocator gives cached blocks back, so a config that fits only without this row is
  'tight', not out of memory.
"""

import math
from dataclasses import dataclass

from ..options import flex_dispatcher_backend
from .shapes import ModelShape, Parallel

MIB = 2**20
CUDA_CONTEXT_BYTES = 0.75 * 2**30
NCCL_CHANNELS = 32  # the FP8-Flow-MoE scripts' NCCL_MIN_NCHANNELS; NCCL's per-communicator maximum
NCCL_RING_BYTES_PER_CHANNEL = (4 + 4.6875 + 0.5) * MIB  # SIMPLE + LL128 + LL receive buffers
P2P_CHANNELS = 2  # NCCL's channels per point-to-point peer
P2P_BYTES_PER_PEER = P2P_CHANNELS * 4 * MIB * 2  # SIMPLE buffers, send and receive
ALLOCATOR_RESERVE_FRACTION = 0.094

# DeepEP (deep_ep/buffer.py, csrc/config.hpp): NVLink peers per node, its per-token metadata bounds,
# the default (NVLink chunk, RDMA chunk) receive tokens per EP size, the NVSHMEM heap step.
DEEPEP_NVL_PEERS = 8
DEEPEP_TOKEN_META_BYTES = 8 + 128 * 8 + 128 * 4 + 128 * 4  # source meta, top-k ids, weights, scales
DEEPEP_RECV_TOKENS = {2: (256, 128), 4: (256, 128), 8: (256, 128), 16: (288, 128), 24: (288, 128),
                      32: (288, 128), 64: (288, 128), 128: (560, 128)}
NVSHMEM_GRANULARITY = 2**29
DEEPEP_WORKSPACE_BYTES = 32 * MIB  # csrc: NUM_WORKSPACE_BYTES, allocated with the buffer


@dataclass(frozen=True)
class DeviceRows:
    cuda_context: float
    nccl: float
    deepep: float
    allocator_reserve: float

    @property
    def outside_allocator(self) -> float:
        return self.cuda_context + self.nccl + self.deepep

    @property
    def total(self) -> float:
        return self.outside_allocator + self.allocator_reserve

    def as_dict(self) -> dict:
        return {"cuda_context": self.cuda_context, "nccl": self.nccl, "deepep": self.deepep,
                "allocator_reserve": self.allocator_reserve}


def uses_deepep(args) -> bool:
    """The flex dispatcher on DeepEP, the backend resolved as megatron-core's TransformerConfig does."""
    return flex_dispatcher_backend(args) == "deepep"


def deepep_num_sms(args) -> int:
    """The SMs Megatron hands DeepEP (Buffer.set_num_sms): moe_flex_dispatcher_num_sms, else the
    deprecated moe_deepep_num_sms it replaces (megatron-core 0.19), else 20."""
    return getattr(args, "moe_flex_dispatcher_num_sms", None) or getattr(args, "moe_deepep_num_sms", None) or 20


def deepep_bytes(args, s: ModelShape, par: Parallel) -> float:
    """DeepEP's NVLink buffer and workspace plus, across nodes, its RDMA buffer (normal mode)."""
    if not (s.experts and par.ep > 1 and uses_deepep(args)):
        return 0.0
    if par.ep not in DEEPEP_RECV_TOKENS:
        return 0.0
    nvl_tokens, rdma_tokens = DEEPEP_RECV_TOKENS[par.ep]
    channels = deepep_num_sms(args) // 2
    hidden_bytes = s.hidden * 2
    nvl_ranks, rdma_ranks = min(par.ep, DEEPEP_NVL_PEERS), max(par.ep // DEEPEP_NVL_PEERS, 1)
    nvl = channels * nvl_ranks * (nvl_tokens * (hidden_bytes + DEEPEP_TOKEN_META_BYTES) + (2 * rdma_ranks + 3) * 4)
    nvl += DEEPEP_WORKSPACE_BYTES
    if par.ep <= DEEPEP_NVL_PEERS:
        return float(nvl)
    rdma = channels * rdma_ranks * 2 * (rdma_tokens * (hidden_bytes + DEEPEP_TOKEN_META_BYTES + 16)
                                        + (DEEPEP_NVL_PEERS * 2 + 2) * 4)
    return float(nvl + math.ceil(rdma / NVSHMEM_GRANULARITY) * NVSHMEM_GRANULARITY)


def nccl_bytes(args, s: ModelShape, par: Parallel) -> float:
    groups = (par.world, par.dp, par.edp if s.experts else 1, par.tp * par.pp, par.pp, par.tp,
              par.ep if s.experts else 1)
    rings = sum(1 for size in groups if size > 1)
    peers = (2 if par.pp > 1 else 0)
    if s.experts and par.ep > 1 and args.moe_token_dispatcher_type == "alltoall":
        peers += par.ep - 1
    return rings * NCCL_CHANNELS * NCCL_RING_BYTES_PER_CHANNEL + peers * P2P_BYTES_PER_PEER


def device_rows(args, s: ModelShape, par: Parallel, peak: float) -> DeviceRows:
    """The four rows for a rank whose allocated peak is `peak` bytes."""
    return DeviceRows(cuda_context=CUDA_CONTEXT_BYTES, nccl=nccl_bytes(args, s, par),
                      deepep=deepep_bytes(args, s, par), allocator_reserve=ALLOCATOR_RESERVE_FRACTION * peak)
