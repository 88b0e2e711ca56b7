"""Megatron's activation recomputation settings, as the estimator needs them.

Selective recompute (`recompute_granularity: selective`, megatron/core/transformer/*) drops from
the saved activations what each module in `recompute_modules` recomputes in backward:
- core_attn: the core attention's internals (softmax probabilities of unfused attention; the
  output and log-sum-exp a fused attention saves). Its inputs q, k, v stay saved (checkpoint
  inputs), and its output stays saved by the output projection.
- layernorm: the outputs of input_layernorm and pre_mlp_layernorm where they are separate modules
  (not fused into a Transformer Engine LayerNorm+Linear), i.e. the copies their consumers saved.
- mla_up_proj: MLA's up-projections and RoPE: q, k, v and the up-projections' LayerNorm outputs;
  the compressed q / kv stay saved (checkpoint inputs).
- mlp: the whole dense MLP (not MoE layers) but its input.
- moe: the whole MoE layer (router, dispatch, experts, combine, shared expert) but its input, the
  pre-MLP LayerNorm output (itself dropped when layernorm is recomputed too).
- moe_act: the experts' activation output (fc2 input).
- shared_experts: the shared expert's internals but its input.
Two modules of the FP8-Flow-MoE fork (the scope `attn layernorm moe_expert` of its 671B runs),
which Megatron 0.19's TransformerConfig refuses at start-up; the estimator models them so that
those runs can be compared (docs/estimator.md), and `moe_expert` is what --moe-fp4-recompute-experts
does:
- moe_expert: the routed experts alone, checkpointed on their dispatched input: the router, the
  permutation, the shared experts and the combine keep their tensors; the experts keep only the
  checkpoint's input (the permuted tokens as dispatched: BF16, FP8 under an FP8 dispatch, the
  MXFP4 payload under ours) and the routing probabilities.
- attn: read as the self-attention block recomputed from its input: the layer input (and the
  input LayerNorm's output unless `layernorm` drops it) stays, nothing else of the attention.
Full recompute (`recompute_granularity: full`) keeps only each recompute unit's input.
"""

from dataclasses import dataclass

MODULES = ("attn", "core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "moe_expert", "shared_experts")


@dataclass(frozen=True)
class Recompute:
    granularity: str  # "none", "selective" or "full"
    modules: frozenset
    method: str = "uniform"  # full recompute: "uniform" or "block"
    num_layers: int = 1

    def __contains__(self, module: str) -> bool:
        return self.granularity == "selective" and module in self.modules

    def label(self) -> str:
        if self.granularity == "selective":
            return ",".join(m for m in MODULES if m in self.modules) or "-"
        if self.granularity == "full":
            return f"full:{self.method}:{self.num_layers}"
        return "-"


NONE = Recompute("none", frozenset())


def recompute_of(args) -> Recompute:
    """The run's recompute; our --moe-fp4-recompute-experts is the fork's `moe_expert` (our options
    refuse it with full recompute)."""
    granularity = args.recompute_granularity
    experts = {"moe_expert"} if getattr(args, "moe_fp4_recompute_experts", False) else set()
    if granularity == "selective":
        modules = args.recompute_modules if args.recompute_modules is not None else ["core_attn"]
        return Recompute("selective", frozenset(modules) | experts)
    if experts and granularity != "full":
        return Recompute("selective", frozenset(experts))
    if granularity == "full":
        return Recompute("full", frozenset(), args.recompute_method or "uniform", args.recompute_num_layers or 1)
    return NONE
