"""--moe-fp4-fused-attention: the core attention of Megatron's local layer spec on torch's fused
scaled-dot-product-attention kernels.

Megatron's local DotProductAttention keeps the [b, heads, s, s] softmax probabilities for backward
(4 GiB per layer and micro-batch at DeepSeek-V3's 128 heads and sequence 4096); the fused kernels
keep the output and the log-sum-exp and recompute the probabilities blockwise in backward. Which
kernel serves is torch's choice among the fused ones (aten sdp_utils.cpp): flash needs one head
dimension for q, k and v, so MLA's q/k 192 and v 128 go to cuDNN (SM90, cuDNN 9.11 or later) or to
memory-efficient attention. The math backend, which materializes the probabilities, is never
enabled on CUDA; on the CPU (tests) torch's CPU flash kernel serves one head dimension, the math
one the rest.

The output handed to the output projection is a view of the output the kernel saves: an FP8
output projection (linears.module.saved_by_its_producer) finds that in the autograd graph and
keeps it by reference instead of storing a copy.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

from .options import UnsupportedConfiguration

FUSED_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
CPU_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)  # tests: the plugin refuses to train without CUDA
SERVED_MASKS = (AttnMaskType.causal, AttnMaskType.no_mask)
_FLAG = "--moe-fp4-fused-attention"


def _refuse(message: str):
    raise UnsupportedConfiguration(f"{_FLAG} {message}")


def _tp_size(pg_collection) -> int:
    if pg_collection is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


class FusedCoreAttention(MegatronModule):
    """DotProductAttention's constructor and forward contract (query, key, value [s, b, heads, dim]
    in; [s, b, heads * v_dim] out) on torch's fused SDPA kernels. No parameters, no checkpoint
    keys: a checkpoint loads across the two (vanilla softmax only)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            _refuse("does not split attention over context-parallel ranks: use --context-parallel-size 1.")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            _refuse(f"has no attention dropout (got {dropout}): add --attention-dropout 0.")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            _refuse(f"serves the vanilla softmax only (got --softmax-type {config.softmax_type}).")
        if getattr(config, "window_size", None) is not None:
            _refuse("serves full causal attention only: drop --window-size.")
        if attn_mask_type not in SERVED_MASKS:
            _refuse(f"serves causal and unmasked attention only, not the {attn_mask_type.name} mask.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = _tp_size(pg_collection)
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        k_dim = k_channels or config.kv_channels
        self.hidden_size_per_attention_head_v = v_channels or config.kv_channels
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.hidden_size_per_attention_head_v
        # DotProductAttention divides by layer_number under apply_query_key_layer_scaling and
        # multiplies it back inside its fp32 softmax: the product is this scale.
        self.softmax_scale = 1.0 / math.sqrt(k_dim) if softmax_scale is None else softmax_scale

    def _causal(self, mask_type: AttnMaskType, attention_mask, sq: int, sk: int) -> bool:
        if mask_type is AttnMaskType.causal:
            if sq != sk:
                _refuse(f"serves training's causal self-attention (query and key of one length), got {sq} and {sk}.")
            # Like Transformer Engine's causal attention: a mask the data loader sent is the causal one
            # (--reset-attention-mask, which would change it, is refused in options/refusals.py).
            return True
        if mask_type is AttnMaskType.no_mask and attention_mask is None:
            return False
        _refuse(f"serves causal and unmasked attention only, not the {mask_type.name} mask.")

    def forward(self, query, key, value, attention_mask, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            _refuse("does not serve packed sequences (THD): drop --moe-fp4-fused-attention or pack none.")
        if attention_bias is not None:
            _refuse("does not serve an attention bias: drop --moe-fp4-fused-attention.")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b = query.shape[:2]
        causal = self._causal(mask_type, attention_mask, sq, key.shape[0])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        backends = list(FUSED_BACKENDS if query.is_cuda else CPU_BACKENDS)
        try:
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                     enable_gqa=k.shape[1] != q.shape[1])
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            raise UnsupportedConfiguration(
                f"{_FLAG} found no fused SDPA kernel (flash, memory-efficient, cuDNN) for query "
                f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} in {q.dtype} (torch's warnings "
                "above say why each declined), and the math kernel would keep the probabilities it exists to "
                "avoid.") from err
        # [b, h, s, dv] -> [s, b, h * dv]: a view of what the fused kernels save, for any b (they
        # write [b, s, h, dv] or q's [s, b, h, d] order: h and dv adjacent); the math kernel's copies.
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
