"""A project-written stand-in for DeepEP's normal-mode (high-throughput) Buffer, over
torch.distributed.all_to_all_single, so that Megatron-Core's flex token dispatcher with its DeepEP
backend (megatron/core/transformer/moe/fused_a2a.py, token_dispatcher._DeepepManager) runs on
CPU ranks under gloo (written for NCCL too, its exchange buffers on x's device, but tested under
gloo only). None of DeepEP's code is used; its behaviour was read from DeepEP v1.2.1 (tag v1.2.1
of github.com/deepseek-ai/DeepEP, commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee):
deep_ep/buffer.py, deep_ep/utils.py, csrc/deep_ep.cpp, csrc/config.hpp, csrc/event.hpp,
csrc/kernels/layout.cu and csrc/kernels/intranode.cu.

What it mirrors (the intranode path, which every group of up to 8 ranks takes in DeepEP):
- Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...): DeepEP's signature and
  attributes (rank, group, group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
  explicitly_destroy), the class attribute num_sms (20) and set_num_sms (even counts only).
- get_dispatch_config / get_combine_config: a Config with DeepEP's fields and their defaults, for
  the group sizes DeepEP has configs for (others are refused, as there). The chunk sizes are the
  stand-in's own (they only size buffers here), not DeepEP's tuned table.
- get_dispatch_layout: num_tokens_per_rank [R] int32 (tokens with at least one expert on the
  rank), None for num_tokens_per_rdma_rank, num_tokens_per_expert [E] int32 (every top-k hit,
  -1 and out-of-range indices skipped), is_token_in_rank [T, R] bool.
- dispatch (DeepEP's parameters, names and order, num_worst_tokens included): each token goes once
  to each rank that holds one of its experts; the received rows come in source-rank order, then
  in the source's token order (DeepEP's rank_prefix_matrix offsets plus its channels, which split
  each source's tokens into consecutive ranges); x is moved byte for byte (BF16, or an (FP8,
  scales) tuple whose scales come back contiguous [N, S] in their dtype); recv_topk_idx holds the
  expert index relative to the receiving rank's first expert, -1 where the expert lives elsewhere,
  and recv_topk_weights holds 0.0 at those -1 positions (the sender zeroes them); the per-expert
  count list sums the senders' num_tokens_per_expert for this rank's experts, each rounded up to
  expert_alignment; with num_worst_tokens > 0 the received tensors have num_worst_tokens rows, the
  list is empty and the rows past the real ones carry -1 in recv_topk_idx. Cached mode (a handle
  given) refuses top-k arguments and returns (recv_x, None, None, None, None, event).
- combine: BF16 only (DeepEP's combine kernel is instantiated for BF16 alone); each token's rows
  from the ranks it went to are summed in float32 as DeepEP's receiver does: bias_0 + bias_1
  first (zero where absent), then the rows in ascending source-rank order, one rounding to BF16 at
  the end, so the bits should be DeepEP's (by reading its kernel; not compared on a GPU); top-k
  weights likewise (from 0.0). A token sent nowhere gets its bias (or zeros) and zero weights.
- The input checks a caller would hit (as assertions): contiguity, dtypes, x's row size a multiple
  of 16 bytes, scales 2-D float32/int32 with one row per token and a 1-byte x, top-k shapes and
  float32 weights, at most 32 top-k (a kernel assert in DeepEP), experts divisible by ranks, at
  most 1024 per rank, allocate_on_comm_stream only with async_finish and a previous event, an
  even SM count, and that the dispatch and combine fit num_nvl_bytes (the same terms DeepEP adds
  up: rank prefix, channel offsets and queues, and per slot the row, its source index, top-k
  indices and weights, and scales).

Where it differs:
- No NVLink or RDMA buffers, no IPC handles, no NVSHMEM, no communication stream, no SM or channel
  scheduling: every call is a few all_to_all_single calls on the current stream (counts first,
  then one packed uint8 row buffer). Buffer() is not collective (DeepEP's constructor is).
- No low-latency mode (refused) and no internode path: every group size behaves as DeepEP's
  intranode path, num_tokens_per_rdma_rank is always None and the RDMA hint is 0 (DeepEP's value
  for groups of up to 8 ranks). DeepEP's intranode kernels exist for 2, 4 and 8 ranks; the
  stand-in takes every group size DeepEP has a config for. No mpi4py `comm`, no get_comm_stream /
  get_local_buffer_tensor / low-latency helpers.
- DeepEP's other kernel-side limits are not checked (e.g. on SM90 builds a row of at most 16368
  bytes and a multiple of 32).
- Events: async_finish returns an EventOverlap around an event recorded after the work on the
  current stream (a real CUDA event on a GPU, nothing on the CPU); previous_event is not waited
  on, the work being on the caller's stream already.
- The NVLink size hint counts the same terms as DeepEP's intranode estimate but not its internode
  source-metadata term, and uses the stand-in's chunk sizes; it is not DeepEP's number.
- The handle is the stand-in's own tuple (below). DeepEP's intranode handle is (rank_prefix_matrix
  [R, R] int32, channel_prefix_matrix [R, C] int32, recv_channel_prefix_matrix [R, C] int32,
  recv_src_idx [N] int32, is_token_in_rank [T, R] bool, send_head [T, R] int32).
- Padding rows under num_worst_tokens are zeros (x) and 0.0 (weights); DeepEP leaves them
  uninitialized. The stand-in also asserts what DeepEP assumes: num_tokens_per_rank agrees with
  is_token_in_rank, and num_worst_tokens is at least the rows received.

The stand-in's handle: (is_token_in_rank [T, R] bool, send_token_idx [S] int64 (this rank's
tokens in sending order: destination rank, then token), send_counts [R] int64 (CPU),
recv_counts [R] int64 (CPU), recv_src_idx [N] int32 (each received row's token index at its
source, -1 on num_worst_tokens padding rows; N is the received tensors' row count))."""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .utils import EventHandle, EventOverlap

_NVL_PEERS = 8  # ranks one NVLink domain holds in DeepEP; larger groups go internode there
_MAX_TOPK, _MAX_SCALES = 128, 128  # the per-token metadata bounds the size hint assumes
_MAX_LOCAL_EXPERTS = 1024
_CONFIGURED_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)  # group sizes DeepEP has configs for


class Config:
    """DeepEP's performance config: SMs and the chunk sizes (in tokens) of its NVLink and RDMA
    queues. Here only the SM count's parity and the buffer sizes derived from it matter."""

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        assert num_sms >= 0, "num_sms must not be negative"
        assert 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, \
            "NVLink chunks: 0 < send tokens < receive tokens"
        assert num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, \
            "RDMA chunks must be positive"
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer for rows of `hidden_bytes` among `num_ranks` ranks, with room for
        up to 128 top-k entries and 128 scales per token (module docstring: not DeepEP's number)."""
        peers, channels = min(num_ranks, _NVL_PEERS), self.num_sms // 2
        slots = channels * peers * self.num_max_nvl_chunked_recv_tokens
        per_slot = hidden_bytes + 4 + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4
        size = num_ranks * num_ranks * 4 + channels * peers * 4 * 4 + slots * per_slot
        return -(-size // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: the stand-in has no RDMA buffer (DeepEP's hint is 0 too for up to 8 ranks)."""
        return 0


def _unpack_bias(bias) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    assert isinstance(bias, tuple) and len(bias) == 2, "bias: a tensor or a tuple of two"
    return bias


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] as its raw bytes, uint8 [N, bytes per row] (gloo carries uint8, not FP8)."""
    width = t.element_size()
    for size in t.shape[1:]:
        width *= size
    return t.reshape(-1).view(torch.uint8).reshape(t.size(0), width)  # reshape(-1): one stride-1 run


def _from_rows(rows: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """The inverse of _rows for [N, width] tensors of `dtype` (copied: a slice of the received
    bytes need not start at a multiple of the element size)."""
    return rows.clone(memory_format=torch.contiguous_format).view(dtype).reshape(rows.size(0), width)


class Buffer:
    """DeepEP's normal-mode Buffer over all_to_all_single (module docstring)."""

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup],
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False,
                 comm=None) -> None:
        if low_latency_mode:
            raise NotImplementedError("The DeepEP stand-in has no low-latency mode, only normal dispatch and combine.")
        if group is None:
            if comm is not None:
                raise NotImplementedError("The DeepEP stand-in takes a torch.distributed group, not an mpi4py comm.")
            raise ValueError("Buffer needs a process group.")
        self.rank = group.rank()
        self.group = group
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = False

    def destroy(self) -> None:
        assert self.explicitly_destroy, "destroy() is for buffers made with explicitly_destroy=True"
        self._destroyed = True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "the SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _CONFIGURED_RANKS, f"no DeepEP config for {num_ranks} EP ranks"
        return Config(Buffer.num_sms, 8, 256, 8, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _CONFIGURED_RANKS, f"no DeepEP config for {num_ranks} EP ranks"
        return Config(Buffer.num_sms, 8, 256, 8, 128)

    # ---------------------------------------------------------------- layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        self._check_usable(previous_event, async_finish, allocate_on_comm_stream)
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx must be a contiguous [tokens, topk] tensor"
        assert topk_idx.dtype == torch.int64, "topk_idx must be int64"
        assert num_experts > 0 and num_experts % self.group_size == 0, \
            "num_experts must be a positive multiple of the ranks"
        ranks, local = self.group_size, num_experts // self.group_size
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        # Out-of-range and -1 entries land in an extra bin that is dropped.
        experts = torch.where(valid, topk_idx, num_experts).flatten()
        num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
        num_tokens_per_expert.scatter_add_(0, experts, torch.ones_like(experts))
        num_tokens_per_expert = num_tokens_per_expert[:num_experts].int()
        target = torch.where(valid, topk_idx // local, ranks)
        in_rank = torch.zeros(topk_idx.size(0), ranks + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, target, True)
        is_token_in_rank = in_rank[:, :ranks].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, self._event(async_finish)

    # ---------------------------------------------------------------- dispatch

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], Optional[List[int]], Optional[Tuple], EventOverlap]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self._check_usable(previous_event, async_finish, allocate_on_comm_stream)
        assert config.num_sms % 2 == 0, "config.num_sms must be even"
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        assert x.dim() == 2 and x.is_contiguous(), "x must be a contiguous [tokens, hidden] tensor"
        assert x.size(1) * x.element_size() % 16 == 0, "x's rows must be a multiple of 16 bytes"
        # DeepEP's intranode dispatch kernel (v1.2.1 intranode.cu:235) device-asserts whole 32-byte rows.
        assert x.size(1) * x.element_size() % 32 == 0, "x's rows must be a multiple of 32 bytes (intranode kernel)"
        if x_scales is not None:
            assert x.element_size() == 1, "x with scales must have 1-byte elements (FP8)"
            assert x_scales.dtype in (torch.float32, torch.int32), "x scales must be float32 or int32"
            assert x_scales.dim() == 2 and x_scales.size(0) == x.size(0), "x scales must be [tokens, scales]"
        num_scales = 0 if x_scales is None else x_scales.size(1)

        if handle is not None:
            assert topk_idx is None and topk_weights is None, "cached dispatch (with a handle) takes no top-k"
            is_token_in_rank, send_token_idx, send_counts, recv_counts, recv_src_idx = handle
            assert is_token_in_rank.size(0) == x.size(0), "x must have the handle's token count"
            self._check_room(config, x.size(1) * x.element_size(), 0, num_scales)
            parts = [_rows(x)[send_token_idx]]
            if x_scales is not None:
                parts.append(_rows(x_scales)[send_token_idx])
            received = self._exchange(parts, send_counts.tolist(), recv_counts.tolist(), recv_src_idx.size(0))
            recv_x = _from_rows(received[0], x.dtype, x.size(1))
            if x_scales is not None:
                recv_x = (recv_x, _from_rows(received[1], x_scales.dtype, num_scales))
            return recv_x, None, None, None, None, self._event(async_finish)

        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None, \
            "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert"
        ranks = self.group_size
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.is_contiguous(), \
            "is_token_in_rank must be a contiguous bool [tokens, ranks] tensor"
        assert tuple(is_token_in_rank.shape) == (x.size(0), ranks), "is_token_in_rank must be [tokens, ranks]"
        assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32, \
            "num_tokens_per_rank and num_tokens_per_expert must be int32"
        assert num_tokens_per_rank.is_contiguous() and tuple(num_tokens_per_rank.shape) == (ranks,), \
            "num_tokens_per_rank must be a contiguous [ranks] tensor"
        assert num_tokens_per_expert.is_contiguous() and num_tokens_per_expert.dim() == 1, \
            "num_tokens_per_expert must be a contiguous [experts] tensor"
        assert num_tokens_per_expert.size(0) % ranks == 0, "the experts must be a multiple of the ranks"
        local = num_tokens_per_expert.size(0) // ranks
        assert local <= _MAX_LOCAL_EXPERTS, f"at most {_MAX_LOCAL_EXPERTS} experts per rank"
        assert (topk_idx is None) == (topk_weights is None), "give both topk_idx and topk_weights, or neither"
        num_topk = 0
        if topk_idx is not None:
            num_topk = topk_idx.size(1)
            assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64, \
                "topk_idx must be a contiguous int64 [tokens, topk] tensor"
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32, \
                "topk_weights must be a contiguous float32 [tokens, topk] tensor"
            assert topk_idx.size(0) == x.size(0) and tuple(topk_weights.shape) == tuple(topk_idx.shape), \
                "topk_idx and topk_weights must be [tokens, topk]"
            assert num_topk <= 32, "at most 32 top-k entries per token"
        if num_worst_tokens > 0:
            assert topk_idx is not None, "num_worst_tokens needs topk_idx and topk_weights"
        self._check_room(config, x.size(1) * x.element_size(), num_topk, num_scales, local)

        send_counts = is_token_in_rank.sum(0).cpu()
        assert send_counts.tolist() == num_tokens_per_rank.tolist(), \
            "num_tokens_per_rank disagrees with is_token_in_rank"
        # Counts first: to each rank, the tokens it gets from me and my hits on its experts.
        counts = torch.cat([send_counts.to(x.device).view(ranks, 1),
                            num_tokens_per_expert.view(ranks, local).long()], dim=1)
        their_counts = torch.empty_like(counts)
        dist.all_to_all_single(their_counts, counts, group=self.group)
        their_counts = their_counts.cpu()
        recv_counts = their_counts[:, 0].clone()
        num_recv = int(recv_counts.sum())
        align = expert_alignment
        per_expert = [-(-int(n) // align) * align for n in their_counts[:, 1:].sum(0).tolist()]
        if num_worst_tokens > 0:
            assert num_recv <= num_worst_tokens, f"{num_recv} rows arrive, more than num_worst_tokens"
            per_expert = []
        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv

        # The rows, by destination rank then token; top-k made relative to the destination's experts.
        send_token_idx = torch.cat([is_token_in_rank[:, d].nonzero().view(-1) for d in range(ranks)])
        parts = [_rows(x)[send_token_idx]]
        if x_scales is not None:
            parts.append(_rows(x_scales)[send_token_idx])
        parts.append(_rows(send_token_idx.int().view(-1, 1)))
        if topk_idx is not None:
            destination = torch.repeat_interleave(torch.arange(ranks, device=x.device), send_counts.to(x.device))
            first = (destination * local).view(-1, 1)
            idx = topk_idx[send_token_idx]
            here = (idx >= first) & (idx < first + local)
            parts.append(_rows(torch.where(here, idx - first, -1)))
            parts.append(_rows(torch.where(here, topk_weights[send_token_idx], 0.0)))
        received = self._exchange(parts, send_counts.tolist(), recv_counts.tolist(), rows)
        recv_x = _from_rows(received[0], x.dtype, x.size(1))
        if x_scales is not None:
            recv_x = (recv_x, _from_rows(received[1], x_scales.dtype, num_scales))
        k = 2 if x_scales is not None else 1
        recv_src_idx = _from_rows(received[k], torch.int32, 1).view(-1)
        recv_src_idx[num_recv:] = -1
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            recv_topk_idx = _from_rows(received[k + 1], torch.int64, num_topk)
            recv_topk_idx[num_recv:] = -1
            recv_topk_weights = _from_rows(received[k + 2], torch.float32, num_topk)
        handle = (is_token_in_rank, send_token_idx, send_counts, recv_counts, recv_src_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, self._event(async_finish)

    # ---------------------------------------------------------------- combine

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        config = self.get_combine_config(self.group_size) if config is None else config
        self._check_usable(previous_event, async_finish, allocate_on_comm_stream)
        assert config.num_sms % 2 == 0, "config.num_sms must be even"
        is_token_in_rank, send_token_idx, send_counts, recv_counts, recv_src_idx = handle
        assert x.dim() == 2 and x.is_contiguous(), "x must be a contiguous [tokens, hidden] tensor"
        assert x.dtype == torch.bfloat16, "DeepEP's normal combine takes BF16 only"
        assert x.size(1) * x.element_size() % 16 == 0, "x's rows must be a multiple of 16 bytes"
        assert x.size(0) == recv_src_idx.size(0), "x must have the rows the handle's dispatch received"
        num_tokens, hidden = is_token_in_rank.size(0), x.size(1)
        num_topk = 0
        if topk_weights is not None:
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32, \
                "topk_weights must be a contiguous float32 [tokens, topk] tensor"
            assert topk_weights.size(0) == x.size(0), "topk_weights must have x's rows"
            num_topk = topk_weights.size(1)
        bias_0, bias_1 = _unpack_bias(bias)
        for b in (b for b in (bias_0, bias_1) if b is not None):
            assert b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype, "bias must be contiguous, in x's dtype"
            assert tuple(b.shape) == (num_tokens, hidden), "bias must be [combined tokens, hidden]"
        self._check_room(config, hidden * x.element_size(), num_topk, 0, combine=True)

        num_recv = int(recv_counts.sum())
        parts = [_rows(x[:num_recv])]
        if topk_weights is not None:
            parts.append(_rows(topk_weights[:num_recv]))
        # Back the way they came: my received rows to their sources, my sent rows from their destinations.
        back = self._exchange(parts, recv_counts.tolist(), send_counts.tolist(), int(send_counts.sum()))
        values = _from_rows(back[0], x.dtype, hidden)
        # DeepEP's receiver starts from float(bias_0) + float(bias_1), an absent one counting +0.0.
        zero = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
        combined = (zero if bias_0 is None else bias_0.float()) + (zero if bias_1 is None else bias_1.float())
        combined_weights = None
        if topk_weights is not None:
            weights = _from_rows(back[1], torch.float32, num_topk)
            combined_weights = torch.zeros(num_tokens, num_topk, dtype=torch.float32, device=x.device)
        start = 0
        for count in send_counts.tolist():  # ascending source rank, as DeepEP's receiver adds them
            tokens = send_token_idx[start:start + count]  # distinct within one rank's rows
            combined[tokens] += values[start:start + count].float()
            if combined_weights is not None:
                combined_weights[tokens] += weights[start:start + count]
            start += count
        return combined.to(x.dtype), combined_weights, self._event(async_finish)

    # ---------------------------------------------------------------- helpers

    def _check_usable(self, previous_event, async_finish, allocate_on_comm_stream) -> None:
        assert not self._destroyed, "the buffer was destroyed"
        if allocate_on_comm_stream:
            assert getattr(previous_event, "event", None) is not None and async_finish, \
                "allocate_on_comm_stream needs previous_event and async_finish"

    @staticmethod
    def _event(async_finish: bool) -> EventOverlap:
        return EventOverlap(EventHandle() if async_finish else None)

    def _check_room(self, config: Config, row_bytes: int, num_topk: int, num_scales: int, num_local_experts: int = 0,
                    combine: bool = False) -> None:
        """DeepEP asserts that its queues fit num_nvl_bytes: the same terms here."""
        # Groups of more than 8 ranks take DeepEP's internode path; counted here as 8 NVLink peers.
        ranks, channels = min(self.group_size, _NVL_PEERS), config.num_sms // 2
        slots = channels * ranks * config.num_max_nvl_chunked_recv_tokens
        if combine:
            needed = channels * ranks * 2 * 4 + slots * (row_bytes + 4 + num_topk * 4)
        else:
            per_slot = row_bytes + 4 + num_topk * (8 + 4) + num_scales * 4
            needed = ranks * ranks * 4 + channels * ranks * 4 * 4 + slots * per_slot
            needed = max(needed, ranks * (ranks + num_local_experts) * 4)
        assert needed <= self.num_nvl_bytes, f"num_nvl_bytes {self.num_nvl_bytes} too small, {needed} needed"

    def _exchange(self, parts: List[torch.Tensor], send_counts: List[int], recv_counts: List[int],
                  rows: int) -> List[torch.Tensor]:
        """Rows of uint8 `parts` (side by side) to the ranks by send_counts, from them by
        recv_counts, in one all_to_all_single; the received parts, zero-padded to `rows` rows."""
        widths = [p.size(1) for p in parts]
        send = torch.cat(parts, dim=1)
        received = send.new_zeros((rows, send.size(1)))
        dist.all_to_all_single(received[:sum(recv_counts)], send, output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return list(received.split(widths, dim=1))


__all__ = ["Buffer", "Config"]
