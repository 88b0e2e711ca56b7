"""The one table of configurations the plugin refuses, and `validate`, the only place a
configuration is refused: each refusal is one sentence naming the flag to change."""

from dataclasses import dataclass, fields
from typing import Callable, FrozenSet, Optional, Tuple

from ..formats import FP8_BLOCK
from .fp4_options import ExpertsPrecision, FP4Options, GradFormat, LinearRole, LinearsPrecision, Storage
from .settings import SUPPORTED_MEGATRON_CORE, Environment, ModelSettings, Route


class UnsupportedConfiguration(ValueError):
    """A configuration the plugin refuses; the message is one sentence naming the flag to change."""


# --offload-modules that Megatron implements inside its experts (TEGroupedMLP)
_EXPERT_OFFLOAD_MODULES = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})


def _release_line(version: str) -> Optional[Tuple[int, int]]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _supported_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_MEGATRON_CORE
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}.x"


@dataclass(frozen=True)
class Refusal:
    """One refused configuration: `when` says it for the docs; `message` is the one sentence a
    user sees, formatted with the settings' fields (and `version`)."""

    when: str
    applies: Callable[[FP4Options, ModelSettings, Environment, Route], bool]
    message: str


FP8 = ExpertsPrecision.FP8
_fp8_experts = lambda o: o.experts is FP8  # noqa: E731
_fp8_linears = lambda o: o.linears is LinearsPrecision.FP8  # noqa: E731
_moe = lambda o: o.touches_moe_layers  # noqa: E731
# The FP4 dispatch through Megatron's flex dispatcher (dispatch/flex.py over DeepEP, docs/design.md §4.9).
_flex = lambda o, m: o.dispatch and m.dispatcher_type == "flex"  # noqa: E731


def _linear_roles(model: ModelSettings) -> FrozenSet[LinearRole]:
    """The roles the model's linear layers have."""
    present = {LinearRole.ATTENTION: True, LinearRole.MLA_UP_PROJECTION: model.multi_latent_attention,
               LinearRole.DENSE_MLP: model.has_dense_mlp, LinearRole.SHARED_EXPERTS: model.has_shared_experts}
    return frozenset(role for role, there in present.items() if there)


REFUSALS = (
    # What the flags need of each other.
    Refusal("--moe-fp4-cache without --moe-fp4-dispatch",
            lambda o, m, e, r: o.cache and not o.dispatch,
            "--moe-fp4-cache needs --moe-fp4-dispatch: it caches the FP4 dispatch's payload."),
    Refusal("--moe-fp4-saved-input without --moe-fp4-dispatch",
            lambda o, m, e, r: o.saved_input and not o.dispatch,
            "--moe-fp4-saved-input needs --moe-fp4-dispatch: it keeps the FP4 dispatch's payload."),
    Refusal("--moe-fp4-weights-per-use without FP8 experts or linears",
            lambda o, m, e, r: o.weights_per_use and not (_fp8_experts(o) or _fp8_linears(o)),
            "--moe-fp4-weights-per-use needs --moe-fp4-experts fp8 or --moe-fp4-linears fp8: it is about their FP8 "
            "weight copies."),
    Refusal("--moe-fp4-keep-transposed-weights without FP8 experts or linears",
            lambda o, m, e, r: o.keep_transposed_weights and not (_fp8_experts(o) or _fp8_linears(o)),
            "--moe-fp4-keep-transposed-weights needs --moe-fp4-experts fp8 or --moe-fp4-linears fp8: it is about "
            "their FP8 weight copies."),
    Refusal("--moe-fp4-keep-transposed-weights with --moe-fp4-weights-per-use",
            lambda o, m, e, r: o.keep_transposed_weights and o.weights_per_use,
            "--moe-fp4-weights-per-use keeps no FP8 weight copy, --moe-fp4-keep-transposed-weights keeps two: drop one "
            "of the two flags."),
    Refusal("--moe-fp4-telemetry without --moe-fp4-dispatch",
            lambda o, m, e, r: o.telemetry and not o.dispatch,
            "--moe-fp4-telemetry needs --moe-fp4-dispatch: it reports the FP4 dispatch's traffic, error and storage."),
    Refusal("--moe-fp4-saved-input with --moe-fp4-experts fp8",
            lambda o, m, e, r: o.saved_input and _fp8_experts(o),
            "--moe-fp4-saved-input is for Megatron's BF16 experts; --moe-fp4-experts fp8 already keeps its saved "
            "input in FP4: drop --moe-fp4-saved-input."),
    Refusal("--moe-fp4-recompute-experts with --moe-fp4-saved-input",
            lambda o, m, e, r: o.recompute_experts and o.saved_input,
            "--moe-fp4-saved-input keeps the experts' saved input in FP4, which --moe-fp4-recompute-experts does not "
            "save: drop one of the two flags."),
    Refusal("--moe-fp4-bf16-linears without FP8 linears",
            lambda o, m, e, r: o.bf16_linears and not _fp8_linears(o),
            "--moe-fp4-bf16-linears picks roles to keep out of --moe-fp4-linears fp8: add --moe-fp4-linears fp8 or "
            "drop it."),
    Refusal("--moe-fp4-bf16-linears naming every role the model has",
            lambda o, m, e, r: o.bf16_linears >= _linear_roles(m),
            "--moe-fp4-bf16-linears names every role this model's linear layers have, which leaves no FP8 linear "
            "layer: drop --moe-fp4-linears fp8 and --moe-fp4-bf16-linears instead."),
    Refusal("--moe-fp4-linears-grad bf16 without FP8 linears",
            lambda o, m, e, r: o.linears_grad is GradFormat.BF16 and not _fp8_linears(o),
            "--moe-fp4-linears-grad is about the backward of --moe-fp4-linears fp8: add --moe-fp4-linears fp8 or "
            "drop it."),
    Refusal("--moe-fp4-storage none without the MXFP4 dispatch into FP8 experts",
            lambda o, m, e, r: o.storage is Storage.NONE and not (o.dispatch and _fp8_experts(o)),
            "--moe-fp4-storage none changes what FP8 experts fed from the MXFP4 dispatch keep for backward: it "
            "needs --moe-fp4-dispatch and --moe-fp4-experts fp8 (without them nothing is kept in MXFP4)."),
    Refusal("--moe-fp4-storage all without FP8 linears and FP8 experts",
            lambda o, m, e, r: o.storage is Storage.ALL and not (_fp8_linears(o) and _fp8_experts(o)),
            "--moe-fp4-storage all is the paper's whole recipe: it needs --moe-fp4-linears fp8 and "
            "--moe-fp4-experts fp8."),
    # Where the plugin runs.
    Refusal("a megatron-core release outside the supported lines",
            lambda o, m, e, r: o.active and e is not None and not (
                (line := _release_line(e.megatron_core_version)) is not None
                and SUPPORTED_MEGATRON_CORE[0] <= line <= SUPPORTED_MEGATRON_CORE[1]),
            "megatron_fp4 supports megatron-core " + _supported_text() + ", found {version}: install a supported "
            "megatron-core or drop the --moe-fp4-* flags."),
    Refusal("no CUDA GPU",
            lambda o, m, e, r: o.active and e is not None and not e.cuda_available,
            "--moe-fp4-dispatch, --moe-fp4-experts fp8, --moe-fp4-linears fp8, --moe-fp4-fused-attention and "
            "--moe-fp4-recompute-experts need CUDA GPUs: their Triton kernels, FP8 GEMMs, fused attention kernels "
            "and Megatron's activation checkpoint run only there."),
    Refusal("--moe-fp4-linears fp8 on a GPU other than Hopper (SM90)",
            lambda o, m, e, r: _fp8_linears(o) and e is not None and e.compute_capability not in (None, (9, 0)),
            "--moe-fp4-linears fp8 needs Hopper GPUs (compute capability 9.0, found {compute_capability}): its FP8 "
            "block-scaled GEMMs are SM90's; drop --moe-fp4-linears fp8."),
    Refusal("--moe-fp4-experts fp8 on a GPU other than Hopper (SM90)",
            lambda o, m, e, r: _fp8_experts(o) and e is not None and e.compute_capability not in (None, (9, 0)),
            "--moe-fp4-experts fp8 needs Hopper GPUs (compute capability 9.0, found {compute_capability}): its FP8 "
            "block-scaled GEMMs are SM90's; drop --moe-fp4-experts fp8."),
    Refusal("the patch route (also our launcher on a patched tree) with --moe-fp4-cache, --moe-fp4-saved-input, "
            "--moe-fp4-experts fp8, --moe-fp4-linears fp8, --moe-fp4-telemetry, --moe-fp4-fused-attention or "
            "--moe-fp4-recompute-experts",
            lambda o, m, e, r: r is Route.PATCH and (o.cache or o.saved_input or _fp8_experts(o) or _fp8_linears(o)
                                                     or o.telemetry or o.fused_attention or o.recompute_experts),
            "a megatron-core tree patched with `megatron-fp4 patch` serves --moe-fp4-dispatch only: drop "
            "--moe-fp4-cache, --moe-fp4-saved-input, --moe-fp4-experts fp8, --moe-fp4-linears fp8, "
            "--moe-fp4-telemetry, --moe-fp4-fused-attention and --moe-fp4-recompute-experts, or run "
            "megatron_fp4.launch on an unpatched megatron-core."),
    Refusal("the patch route (also our launcher on a patched tree) with the flex dispatcher",
            # The patched MoELayer builds our dispatcher for alltoall only: flex would run Megatron's own.
            lambda o, m, e, r: r is Route.PATCH and _flex(o, m),
            "a megatron-core tree patched with `megatron-fp4 patch` sends --moe-fp4-dispatch through the alltoall "
            "dispatcher only: use --moe-token-dispatcher-type alltoall, or run megatron_fp4.launch on an unpatched "
            "megatron-core for the flex dispatcher."),
    Refusal("context parallelism (our launcher does not slice batches per CP rank)",
            lambda o, m, e, r: r is Route.LAUNCHER and m.context_parallel_size > 1,
            "megatron_fp4's launcher does not slice batches for context parallelism: use --context-parallel-size 1."),
    # The model.
    Refusal("no MoE layers",
            lambda o, m, e, r: _moe(o) and not m.num_experts,
            "--moe-fp4-dispatch and --moe-fp4-experts fp8 need an MoE model: set --num-experts."),
    Refusal("--moe-fp4-recompute-experts without MoE layers",
            lambda o, m, e, r: o.recompute_experts and not m.num_experts,
            "--moe-fp4-recompute-experts recomputes the routed experts: it needs an MoE model (set --num-experts)."),
    Refusal("a dispatcher other than alltoall or flex",
            lambda o, m, e, r: o.dispatch and m.dispatcher_type not in ("alltoall", "flex"),
            "--moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall or flex (got {dispatcher_type}): it "
            "replaces those dispatchers' token exchange."),
    # Through the flex dispatcher: DeepEP's normal mode only, its combine (the dispatch's backward too)
    # BF16 only. DeepEP being importable and covered (1.2.x) and its buffer not in low-latency mode
    # are checked where it runs (dispatch/deepep.py): a plan for another machine cannot see them.
    Refusal("the flex dispatcher with --moe-flex-dispatcher-backend hybridep or ncclep",
            lambda o, m, e, r: _flex(o, m) and m.flex_backend != "deepep",
            "--moe-fp4-dispatch through the flex dispatcher serves its DeepEP backend only (got "
            "--moe-flex-dispatcher-backend {flex_backend})."),
    Refusal("the flex dispatcher with one expert-parallel rank",
            # megatron-core's DeepEP manager asserts it at the layer's construction.
            lambda o, m, e, r: _flex(o, m) and m.expert_parallel_size * m.expert_tensor_parallel_size == 1,
            "--moe-fp4-dispatch through the flex dispatcher needs --expert-model-parallel-size above 1 (DeepEP "
            "exchanges tokens between ranks; megatron-core asserts it too): use alltoall on one expert rank."),
    Refusal("the flex dispatcher with --moe-fp4-dispatch-grad fp8",
            lambda o, m, e, r: _flex(o, m) and o.dispatch_grad is GradFormat.FP8,
            "--moe-fp4-dispatch-grad fp8 is not served through the flex dispatcher: DeepEP's combine, which carries "
            "the dispatch's gradient back, is BF16 only; use --moe-fp4-dispatch-grad bf16."),
    Refusal("the flex dispatcher with --moe-fp4-telemetry",
            lambda o, m, e, r: _flex(o, m) and o.telemetry,
            "--moe-fp4-telemetry is not served through the flex dispatcher yet (its byte counts are the alltoall "
            "dispatcher's rows): drop --moe-fp4-telemetry or use --moe-token-dispatcher-type alltoall."),
    Refusal("the flex dispatcher with --moe-router-padding-for-quantization",
            lambda o, m, e, r: _flex(o, m) and m.router_padding_for_quantization,
            "--moe-fp4-dispatch through the flex dispatcher does not pad the experts' token counts as "
            "--moe-router-padding-for-quantization (or --moe-router-padding-for-fp8) asks: drop that flag."),
    Refusal("the flex dispatcher with --moe-pad-expert-input-to-capacity",
            # megatron-core's TransformerConfig refuses it with DeepEP too, but only once a launch builds
            # the model's config; here --dry-run and the estimator refuse it as well.
            lambda o, m, e, r: _flex(o, m) and m.pad_to_capacity,
            "--moe-pad-expert-input-to-capacity is not served by the flex dispatcher's DeepEP backend (megatron-core "
            "refuses it there too): drop it or use --moe-token-dispatcher-type alltoall."),
    Refusal("a dispatched width not divisible by 128",
            lambda o, m, e, r: _moe(o) and (m.dispatched_width or 0) % FP8_BLOCK != 0,
            f"--moe-fp4-dispatch and --moe-fp4-experts fp8 need --hidden-size (or --moe-latent-size) divisible by "
            f"{FP8_BLOCK} (got {{dispatched_width}}): FP8 1x128 blocks must not straddle rows."),
    Refusal("expert tensor parallelism",
            lambda o, m, e, r: _moe(o) and m.expert_tensor_parallel_size > 1,
            "megatron_fp4 does not support expert tensor parallelism: use --expert-tensor-parallel-size 1 "
            "(got {expert_tensor_parallel_size}) and expert parallelism instead."),
    Refusal("--overlap-moe-expert-parallel-comm",
            lambda o, m, e, r: _moe(o) and m.overlap_ep_comm,
            "megatron_fp4 does not support --overlap-moe-expert-parallel-comm: its split schedule calls the MoE "
            "layer's parts itself and would bypass the FP4 dispatch; drop the flag."),
    Refusal("--overlap-dispatch-backward-with-experts-wgrad",
            lambda o, m, e, r: _moe(o) and m.overlap_dispatch_wgrad,
            "megatron_fp4 does not support --overlap-dispatch-backward-with-experts-wgrad: its dispatch and "
            "experts do not delay the weight gradients; drop the flag."),
    Refusal("CUDA graphs that capture the MoE layer",
            lambda o, m, e, r: _moe(o) and m.cuda_graph_captures_moe,
            "megatron_fp4 does not support CUDA graphs that capture the MoE layer: use --cuda-graph-impl none or "
            "--cuda-graph-modules attn (mlp for dense layers)."),
    Refusal("transformer_impl inference_optimized",
            lambda o, m, e, r: o.active and m.inference_optimized,
            "megatron_fp4 is for training: --transformer-impl inference_optimized is not supported."),
    Refusal("--fp16 with --moe-fp4-dispatch, --moe-fp4-experts fp8 or --moe-fp4-linears fp8",
            # The dispatch refuses float16 tokens; the experts' SM90 GEMMs write BF16 or fp32 only.
            lambda o, m, e, r: m.fp16 and (o.dispatch or _fp8_experts(o) or _fp8_linears(o)),
            "--moe-fp4-dispatch, --moe-fp4-experts fp8 and --moe-fp4-linears fp8 run on BF16 activations (MXFP4 "
            "values can overflow float16 and the FP8 GEMMs write BF16): use --bf16 instead of --fp16."),
    Refusal("the flex dispatcher without --bf16",
            lambda o, m, e, r: _flex(o, m) and not m.bf16,
            "--moe-fp4-dispatch through the flex dispatcher needs --bf16: DeepEP's combine, which also carries the "
            "dispatch's gradient back, is BF16 only."),
    Refusal("--moe-fp4-cache without whole-layer MoE recompute",
            lambda o, m, e, r: o.cache and not m.moe_recompute,
            "--moe-fp4-cache serves only the recompute of whole MoE layers: add --recompute-granularity selective "
            "--recompute-modules moe, or drop --moe-fp4-cache."),
    Refusal("--moe-fp4-cache with token dropping",
            # The no-grad first pass and the recompute can compute probs one BF16 unit apart (Megatron sorts
            # top-k only with grad), so with dropping they can keep other tokens with the same counts.
            lambda o, m, e, r: o.cache and m.capacity_factor is not None,
            "--moe-fp4-cache does not support --moe-expert-capacity-factor: with token dropping the recompute can "
            "keep other tokens than the first pass, so the cached dispatch could be the wrong tokens; drop one of "
            "the two flags."),
    Refusal("the payload reordered by a fused or padded permutation",
            lambda o, m, e, r: o.dispatch and (o.saved_input or _fp8_experts(o)) and (
                m.permute_fusion or m.pad_to_capacity),
            "--moe-fp4-saved-input and --moe-fp4-experts fp8 (with --moe-fp4-dispatch) do not support "
            "--moe-permute-fusion or --moe-pad-expert-input-to-capacity: the payload rows are reordered like the "
            "experts' input by the unfused sort; drop those flags."),
    # What our FP8 linears implement.
    Refusal("--moe-fp4-linears fp8 with tensor parallelism",
            lambda o, m, e, r: _fp8_linears(o) and m.tensor_parallel_size > 1,
            "--moe-fp4-linears fp8 serves tensor parallelism 1 only (the 671B layout; got "
            "--tensor-model-parallel-size {tensor_parallel_size}): use pipeline or data parallelism instead."),
    # Checked on the routes that read --transformer-impl; a plugin user's spec is checked by the spec swap
    # itself (TransformerConfig's default transformer_impl says nothing about the spec it is used with).
    Refusal("--moe-fp4-linears fp8 with Transformer Engine layers",
            lambda o, m, e, r: _fp8_linears(o) and r is not Route.PLUGIN and m.transformer_impl not in (
                None, "local"),
            "--moe-fp4-linears fp8 replaces Megatron's local linear layers: use --transformer-impl local (got "
            "{transformer_impl})."),
    Refusal("--moe-fp4-linears fp8 with biases",
            lambda o, m, e, r: _fp8_linears(o) and m.add_bias_linear,
            "--moe-fp4-linears fp8 has no biases: add --disable-bias-linear."),
    # What our fused core attention implements.
    Refusal("--moe-fp4-fused-attention with Transformer Engine layers",
            lambda o, m, e, r: o.fused_attention and r is not Route.PLUGIN and m.transformer_impl not in (
                None, "local"),
            "--moe-fp4-fused-attention replaces the local layers' DotProductAttention (Transformer Engine's "
            "attention is fused already): use --transformer-impl local (got {transformer_impl}) or drop the flag."),
    Refusal("--moe-fp4-fused-attention with context parallelism",
            lambda o, m, e, r: o.fused_attention and m.context_parallel_size > 1,
            "--moe-fp4-fused-attention does not split attention over context-parallel ranks: use "
            "--context-parallel-size 1 (got {context_parallel_size})."),
    Refusal("--moe-fp4-fused-attention with attention dropout",
            lambda o, m, e, r: o.fused_attention and m.attention_dropout > 0,
            "--moe-fp4-fused-attention has no attention dropout: add --attention-dropout 0 (got "
            "{attention_dropout}, Megatron's default is 0.1)."),
    Refusal("--moe-fp4-fused-attention with --reset-attention-mask",
            lambda o, m, e, r: o.fused_attention and m.reset_attention_mask,
            "--moe-fp4-fused-attention computes plain causal attention and would ignore the document boundaries "
            "that --reset-attention-mask puts in the mask: drop one of the two flags."),
    # The experts-only recompute (docs/design.md §6.6).
    Refusal("--moe-fp4-recompute-experts where the experts are recomputed already",
            lambda o, m, e, r: o.recompute_experts and (m.recompute_granularity == "full" or (
                m.recompute_granularity == "selective" and bool({"moe", "moe_act"} & set(m.recompute_modules)))),
            "--moe-fp4-recompute-experts recomputes only the routed experts, which full recompute and `moe` or "
            "`moe_act` in --recompute-modules recompute already: drop one of them."),
    Refusal("--moe-fp4-recompute-experts with Transformer Engine's FP8 or FP4",
            # Megatron's activation checkpoint does not restore Transformer Engine's autocast state for a
            # recompute (Megatron's own MoE recompute switches to te_checkpoint there).
            lambda o, m, e, r: o.recompute_experts and m.te_low_precision,
            "--moe-fp4-recompute-experts does not serve Transformer Engine's FP8 or FP4 (--fp8-format, "
            "--fp4-format): use --moe-fp4-experts fp8 for FP8 experts, or drop one of the two flags."),
    Refusal("--moe-fp4-recompute-experts with the flex dispatcher's hybridep or ncclep backend",
            # Their zero-copy buffers are handed to the experts, whose recompute would write them again.
            lambda o, m, e, r: o.recompute_experts and m.dispatcher_type == "flex" and m.flex_backend != "deepep",
            "--moe-fp4-recompute-experts serves the flex dispatcher on DeepEP only (got "
            "--moe-flex-dispatcher-backend {flex_backend}): its other backends hand the experts buffers that a "
            "recompute would write again."),
    Refusal("--moe-fp4-recompute-experts with --delay-wgrad-compute, "
            "--overlap-dispatch-backward-with-experts-wgrad, activation offloading of the experts, CUDA graphs of "
            "the MoE layer or --overlap-moe-expert-parallel-comm",
            lambda o, m, e, r: o.recompute_experts and (
                m.delay_wgrad or m.overlap_dispatch_wgrad or bool(set(m.offloaded_modules) & _EXPERT_OFFLOAD_MODULES)
                or m.cuda_graph_captures_moe or m.overlap_ep_comm),
            "--moe-fp4-recompute-experts recomputes the experts inside an activation checkpoint, which cannot delay "
            "their weight gradients (--delay-wgrad-compute, --overlap-dispatch-backward-with-experts-wgrad), "
            "offload their activations, be captured in a CUDA graph or be split by "
            "--overlap-moe-expert-parallel-comm: drop those flags or --moe-fp4-recompute-experts."),
    # What our FP8 experts implement.
    Refusal("--moe-fp4-experts fp8 with the flex dispatcher, without --moe-fp4-dispatch",
            # With it, the FP4 flex dispatcher feeds the experts from the received payload.
            lambda o, m, e, r: _fp8_experts(o) and m.dispatcher_type == "flex" and not o.dispatch,
            "--moe-fp4-experts fp8 does not take Megatron's own flex dispatcher (it hands the experts DeepEP / "
            "NCCL-EP buffers they do not read): add --moe-fp4-dispatch, whose flex dispatcher feeds them the "
            "received MXFP4 payload, or use --moe-token-dispatcher-type alltoall."),
    Refusal("--moe-fp4-experts fp8 without SwiGLU",
            lambda o, m, e, r: _fp8_experts(o) and not m.swiglu,
            "--moe-fp4-experts fp8 implements SwiGLU experts only: add --swiglu."),
    Refusal("--moe-fp4-experts fp8 with biases",
            lambda o, m, e, r: _fp8_experts(o) and m.add_bias_linear,
            "--moe-fp4-experts fp8 has no expert biases: add --disable-bias-linear."),
    Refusal("--moe-fp4-experts fp8 with an FFN size not divisible by 128",
            lambda o, m, e, r: _fp8_experts(o) and (m.moe_ffn_hidden_size or 0) % FP8_BLOCK != 0,
            f"--moe-fp4-experts fp8 needs --moe-ffn-hidden-size divisible by {FP8_BLOCK} (got "
            "{moe_ffn_hidden_size})."),
    Refusal("--moe-fp4-experts fp8 with --moe-apply-probs-on-input",
            lambda o, m, e, r: _fp8_experts(o) and m.probs_on_input,
            "--moe-fp4-experts fp8 applies the probs after SwiGLU: drop --moe-apply-probs-on-input."),
    Refusal("--moe-fp4-experts fp8 with --delay-wgrad-compute",
            lambda o, m, e, r: _fp8_experts(o) and m.delay_wgrad,
            "--moe-fp4-experts fp8 computes weight gradients in backward: drop --delay-wgrad-compute."),
    Refusal("--moe-fp4-experts fp8 with --activation-func-clamp-value",
            lambda o, m, e, r: _fp8_experts(o) and m.activation_clamp is not None,
            "--moe-fp4-experts fp8 has no SwiGLU clamp: drop --activation-func-clamp-value."),
    Refusal("--moe-fp4-experts fp8 checkpointing the distributed optimizer in its default format",
            # That format stores optimizer state in parameter order, where our experts (like
            # SequentialMLP) differ from Megatron's grouped experts: state would cross-load misplaced.
            lambda o, m, e, r: _fp8_experts(o) and m.bucket_space_checkpoints,
            "--moe-fp4-experts fp8 with --use-distributed-optimizer saves and loads checkpoints only in the "
            "fully reshardable format (the default one stores optimizer state in parameter order, which differs "
            "from Megatron's grouped experts): add --dist-ckpt-optim-fully-reshardable."),
    Refusal("--moe-fp4-experts fp8 with moe_act recompute",
            lambda o, m, e, r: _fp8_experts(o) and "moe_act" in m.recompute_modules,
            "--moe-fp4-experts fp8 keeps its activations in MXFP4 and does not recompute them: drop moe_act from "
            "--recompute-modules."),
    Refusal("--moe-fp4-experts fp8 with fine-grained offloading of the experts' activations",
            # megatron-core 0.18 / 0.19 offload these only inside TEGroupedMLP, which our experts replace.
            lambda o, m, e, r: _fp8_experts(o) and bool(set(m.offloaded_modules) & _EXPERT_OFFLOAD_MODULES),
            "--moe-fp4-experts fp8 does not offload its activations to the host (Megatron offloads them only inside "
            "its own grouped experts): drop expert_fc1, moe_act and fused_group_mlp from --offload-modules."),
)


def validate(options: FP4Options, model: ModelSettings, environment: Optional[Environment],
             route: Route) -> None:
    """Raise UnsupportedConfiguration with the first refusal that applies. environment None skips
    the checks of this machine (the estimator and --dry-run plan for another one)."""
    for refusal in REFUSALS:
        if refusal.applies(options, model, environment, route):
            values = {f.name: getattr(model, f.name) for f in fields(model)}
            if environment is not None:
                values.update(version=environment.megatron_core_version,
                              compute_capability=environment.compute_capability)
            raise UnsupportedConfiguration(refusal.message.format(**values))


def validate_args(args, route: Route, environment: Optional[Environment]) -> FP4Options:
    """validate() for Megatron's parsed arguments; returns the options they ask for."""
    options = FP4Options.from_args(args)
    validate(options, ModelSettings.from_args(args), environment, route)
    return options

