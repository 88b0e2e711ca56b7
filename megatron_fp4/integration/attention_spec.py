"""--moe-fp4-fused-attention: the layer spec's core attention (standard and MLA self-attention)
built as our FusedCoreAttention instead of Megatron's unfused DotProductAttention."""

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..attention import FusedCoreAttention
from ..options import FP4Options, UnsupportedConfiguration
from .spec_tree import rewrite_spec

_SUBMODULES = (SelfAttentionSubmodules, MLASelfAttentionSubmodules)


def _builds_dot_product_attention(entry) -> bool:
    return entry is DotProductAttention or (isinstance(entry, ModuleSpec) and entry.module is DotProductAttention)


def use_fused_attention(spec, options: FP4Options):
    """`spec` with FusedCoreAttention as every self-attention's core attention when
    options.fused_attention; otherwise the same object."""
    if not options.fused_attention or spec is None:
        return spec

    def swap(node):
        if isinstance(node, _SUBMODULES) and node.core_attention is not None:
            if not _builds_dot_product_attention(node.core_attention):
                raise UnsupportedConfiguration(
                    f"--moe-fp4-fused-attention replaces Megatron's local DotProductAttention only, not "
                    f"{node.core_attention!r}: use --transformer-impl local or drop --moe-fp4-fused-attention.")
            node.core_attention = FusedCoreAttention
        return node

    return rewrite_spec(spec, swap)
