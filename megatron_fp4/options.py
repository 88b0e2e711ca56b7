"""Every switch of the plugin in one typed value, and the one table of configurations it refuses.

`FP4Options` is built the same way from Megatron's parsed arguments (`from_args`) and from a
`TransformerConfig` that carries our flags (`from_config`, the patch route). `validate` is the only
place a configuration is refused: the launcher, the patch route, the estimator, `--dry-run` and the
MoE layer all call it, and `docs/usage.md` is generated from `FLAGS` and `REFUSALS`
(`python -m megatron_fp4.options` prints it; a test keeps the file in step).
"""

import argparse
import enum
import re
from dataclasses import dataclass, fields
from typing import Callable, FrozenSet, Optional, Tuple

from .formats import FP8_BLOCK, ScaleRule

# megatron-core release lines whose MoE seams (DESIGN §5) the dispatcher is written against and
# tested with (tests/versions).
SUPPORTED_MEGATRON_CORE = ((0, 18), (0, 19))


class GradFormat(enum.StrEnum):
    BF16 = "bf16"  # the gradient unquantized, in the model's dtype
    FP8 = "fp8"  # E4M3 rows with 1x128 power-of-two scales


class ExpertsPrecision(enum.StrEnum):
    BF16 = "bf16"  # Megatron's own experts
    FP8 = "fp8"  # ours: FP8 GEMMs fed from the MXFP4 payload


class LinearsPrecision(enum.StrEnum):
    BF16 = "bf16"  # Megatron's own linear layers
    FP8 = "fp8"  # ours (megatron_fp4.linears): FP8 blockwise GEMMs outside the routed experts


class LinearRole(enum.StrEnum):
    """Where a linear layer outside the routed experts sits; the names of Megatron's selective
    recompute modules, which --moe-fp4-bf16-linears also takes."""

    ATTENTION = "attention"  # q/kv down-projections, qkv, output projection: no selective recompute
    MLA_UP_PROJECTION = "mla_up_proj"  # MLA's q and kv up-projections
    DENSE_MLP = "mlp"
    SHARED_EXPERTS = "shared_experts"


# Megatron's selective-recompute modules that re-run a role's layers (`moe` checkpoints the whole
# MoE layer, shared experts included); full recompute re-runs every role.
RECOMPUTED_BY = {
    LinearRole.ATTENTION: frozenset(),
    LinearRole.MLA_UP_PROJECTION: frozenset({"mla_up_proj"}),
    LinearRole.DENSE_MLP: frozenset({"mlp"}),
    LinearRole.SHARED_EXPERTS: frozenset({"shared_experts", "moe"}),
}


class Storage(enum.StrEnum):
    """Where activations saved for backward are kept in MXFP4."""

    # Nowhere inexact: the routed FP8 experts keep the received payload (exact FP4 values) but their
    # SwiGLU input in BF16 and fc2 input as FP8 columns, as the FP8 baseline and recompute keep them
    NONE = "none"
    EXPERTS = "experts"  # inside the routed FP8 experts only (their SwiGLU and fc2 inputs)
    ALL = "all"  # the paper's recipe: also every FP8 linear's saved input and every SwiGLU input


class Route(enum.StrEnum):
    """How the plugin reached the model."""

    LAUNCHER = "launcher"  # our pretrain_gpt_fp4.py (megatron_fp4.launch)
    PLUGIN = "plugin"  # our layer spec in the user's own training script
    PATCH = "patch"  # a Megatron tree patched with `megatron-fp4 patch` (Megatron's own MoELayer)


class UnsupportedConfiguration(ValueError):
    """A configuration the plugin refuses; the message is one sentence naming the flag to change."""


@dataclass(frozen=True)
class FP4Options:
    dispatch: bool = False
    dispatch_grad: GradFormat = GradFormat.BF16
    scale_rule: ScaleRule = ScaleRule.CEIL
    cache: bool = False
    saved_input: bool = False
    experts: ExpertsPrecision = ExpertsPrecision.BF16
    telemetry: bool = False
    weights_per_use: bool = False
    linears: LinearsPrecision = LinearsPrecision.BF16
    storage: Storage = Storage.EXPERTS
    bf16_linears: FrozenSet[LinearRole] = frozenset()  # roles --moe-fp4-linears fp8 leaves to Megatron
    linears_grad: GradFormat = GradFormat.FP8  # the FP8 linears' backward GEMMs
    fused_attention: bool = False

    def __post_init__(self):
        # Accept the flags' strings; keep the enums.
        object.__setattr__(self, "dispatch_grad", GradFormat(self.dispatch_grad))
        object.__setattr__(self, "scale_rule", ScaleRule(self.scale_rule))
        object.__setattr__(self, "experts", ExpertsPrecision(self.experts))
        object.__setattr__(self, "linears", LinearsPrecision(self.linears))
        object.__setattr__(self, "storage", Storage(self.storage))
        object.__setattr__(self, "bf16_linears", frozenset(LinearRole(r) for r in self.bf16_linears))
        object.__setattr__(self, "linears_grad", GradFormat(self.linears_grad))

    @property
    def active(self) -> bool:
        """Whether anything of the plugin touches the model (off: stock Megatron)."""
        return self.touches_moe_layers or self.linears is LinearsPrecision.FP8 or self.fused_attention

    @property
    def touches_moe_layers(self) -> bool:
        """Whether the plugin builds parts of the MoE layers (the FP8 linears and the fused attention,
        which also serve dense layers, alone do not)."""
        return self.dispatch or self.experts is ExpertsPrecision.FP8

    def fp8_linear(self, role: LinearRole) -> bool:
        """Whether the linear layers of `role` are ours (FP8) rather than Megatron's."""
        return self.linears is LinearsPrecision.FP8 and role not in self.bf16_linears

    @classmethod
    def from_args(cls, args) -> "FP4Options":
        """From Megatron's parsed arguments (or any object with the flags' attribute names, which a
        patched TransformerConfig also has)."""
        values = {}
        for flag in FLAGS:
            value = getattr(args, flag.attribute, None)
            if value is not None:
                values[flag.field] = value
        return cls(**values)

    from_config = from_args  # the patch route copies the moe_fp4_* arguments onto the config


@dataclass(frozen=True)
class Flag:
    field: str  # FP4Options' field
    help: str
    choices: Optional[type] = None  # the enum, for valued flags
    many: bool = False  # a list of choices (nargs "+"), an FP4Options frozenset

    @property
    def attribute(self) -> str:
        return f"moe_fp4_{self.field}"

    @property
    def option(self) -> str:
        return "--" + self.attribute.replace("_", "-")

    @property
    def default(self):
        return next(f.default for f in fields(FP4Options) if f.name == self.field)


FLAGS = (
    Flag("dispatch", "Quantize routed tokens to MXFP4 before the expert-parallel all-to-all (H/2 + H/32 bytes per "
         "token instead of 2H). Off: stock Megatron dispatch."),
    Flag("dispatch_grad", "Format of the gradient sent back through the dispatch all-to-all: bf16 (unquantized, "
         "exact) or fp8 (E4M3 with 1x128 power-of-two scales).", GradFormat),
    Flag("scale_rule", "MXFP4 block scale: ceil (2^ceil(log2(amax/6)), never clips) or floor (OCP: "
         "2^(floor(log2(amax)) - 2), saturates at 6).", ScaleRule),
    Flag("cache", "With --recompute-modules moe (or Megatron's alias --moe-layer-recompute): keep each MoE layer's received MXFP4 payload from its first pass "
         "so that the recompute does not send the dispatch again (the gradient all-to-all still runs). Off by "
         "default: it holds the payload of every checkpointed MoE layer and micro-batch in flight, memory that "
         "`moe` recompute was chosen to save."),
    Flag("saved_input", "Keep the saved fc1 input of Megatron's own experts (SequentialMLP) as the received MXFP4 "
         "payload instead of BF16 (lossless: those values are FP4 values)."),
    Flag("experts", "Routed experts: bf16 (Megatron's own, behind the exact FP4 -> BF16 dequantization) or fp8 "
         "(ours: fc1/fc2 and their gradients as FP8 GEMMs with 1x128 / 128x128 power-of-two scales on SM90, fed "
         "straight from the MXFP4 payload, which they keep for backward with MXFP4 copies of the SwiGLU and "
         "fc2 inputs; the same parameters and checkpoint keys as SequentialMLP). Without --moe-fp4-dispatch, "
         "fp8 quantizes the BF16 dispatch itself and keeps FP8 columns of the fc1 and fc2 inputs and the BF16 "
         "SwiGLU input (the FP8 baseline, as Transformer Engine's FP8 layers keep them); so does the recompute "
         "of `moe` or full recompute for the SwiGLU and fc2 inputs (nothing inexact in FP4 there).",
         ExpertsPrecision),
    Flag("telemetry", "Add the FP4 dispatch's numbers per training step to Megatron's iteration log line (and to "
         "TensorBoard / W&B when those are on), averaged per GPU over the --log-interval: bytes the dispatch "
         "all-to-all sent forward and backward next to what BF16 would have sent, the relative RMS error of the "
         "dispatched tokens' MXFP4 quantization (on up to 64 sampled rows per dispatch), recompute-cache hits, and "
         "the peak bytes held in FP4 storage (cached payloads, activations saved in MXFP4). The layers read "
         "nothing back from the GPU; the numbers are read once per logged iteration. Off by default: it adds a few "
         "small kernels per MoE layer and micro-batch."),
    Flag("linears", "The linear layers outside the routed experts (attention projections: MLA's q down/up, kv "
         "down/up and output projection, or standard attention's qkv and projection; the dense MLP; the shared "
         "experts): bf16 (Megatron's own) or fp8 (ours: FP8 GEMMs with 1x128 activation / 128x128 weight "
         "power-of-two scales on SM90, weights quantized once per optimizer step, each saved input kept as FP8 "
         "1x128 columns for the weight gradient, except two kept by reference at no cost: a layernorm output "
         "that Megatron recomputes (--recompute-modules layernorm, outside the layer's own module recompute) and "
         "the output projection's input where --moe-fp4-fused-attention saves it for its own backward (not "
         "under core_attn recompute); the same parameters and checkpoint keys as Megatron's local linears). "
         "Tensor parallelism 1 and --transformer-impl local only.", LinearsPrecision),
    Flag("storage", "Where activations kept for backward are stored in MXFP4: experts (inside the routed FP8 "
         "experts only, fed from the MXFP4 dispatch: their SwiGLU and fc2 inputs), all (the paper's recipe: "
         "also the saved input of every FP8 linear and the SwiGLU inputs of the dense MLP and shared experts) or "
         "none (the FP8 experts fed from the dispatch keep its exact MXFP4 payload but their SwiGLU input in BF16 "
         "and fc2 input as FP8 columns, as without the MXFP4 dispatch: more memory, no MXFP4 rounding in "
         "backward; the FP8 linears save FP8; for convergence comparisons: on the convergence proxy it did not "
         "bring the loss closer to BF16's, docs/convergence.md). "
         "Modules that Megatron recomputes "
         "(--recompute-modules mla_up_proj, mlp, shared_experts, moe, or full recompute) keep FP8 / BF16 there: "
         "nothing inside a recomputation is stored in FP4; under --recompute-modules layernorm the layers that "
         "read a layernorm's output keep it by reference instead, storing nothing, and so does the attention "
         "output projection where --moe-fp4-fused-attention saves its input (not under core_attn recompute).",
         Storage),
    Flag("bf16_linears", "With --moe-fp4-linears fp8: the roles whose linear layers stay Megatron's own BF16 ones "
         "(attention: the qkv or MLA q/kv down-projections and the output projection; mla_up_proj: MLA's q and kv "
         "up-projections, and its one q projection when there is no q LoRA, which Megatron recomputes with them; "
         "mlp: the dense MLP; shared_experts), with their inputs and SwiGLU inputs saved in BF16 "
         "as Megatron saves them, also under --moe-fp4-storage all. Default: none, every role FP8.",
         LinearRole, many=True),
    Flag("linears_grad", "With --moe-fp4-linears fp8: the gradients of those layers' backward GEMMs: fp8 (the "
         "gradient in E4M3 1x128 blocks, the input gradient against the FP8 weight, the weight gradient against "
         "the FP8 saved input) or bf16 (the gradient unquantized: both backward GEMMs in BF16, against the BF16 "
         "weight and the saved input dequantized to BF16, exactly its FP8 or MXFP4 values, or the input itself "
         "where it is kept by reference). The forward and what "
         "is saved stay as they are; bf16 costs backward time (two of the three GEMMs in BF16) and, during each "
         "layer's backward, a BF16 copy of its saved input. For convergence comparisons (docs/convergence.md).",
         GradFormat),
    Flag("weights_per_use", "With --moe-fp4-experts fp8 or --moe-fp4-linears fp8: quantize the weights to FP8 at "
         "every use instead of once per optimizer step. The default keeps one FP8 copy (128x128 blocks) of each FP8 "
         "layer's weight from the step's first forward to the next step's, about 1 byte per weight element, and "
         "saves every later micro-batch the quantization of W (backward quantizes W^T for the data gradient, "
         "one layer at a time); this flag gives that memory back."),
    Flag("fused_attention", "Compute the core attention of Megatron's local layers (--transformer-impl local, "
         "standard and MLA self-attention) with torch's fused scaled-dot-product-attention kernels (flash, "
         "memory-efficient or cuDNN, never the math one) instead of the unfused DotProductAttention: backward keeps "
         "the output and its log-sum-exp, not the [b, heads, s, s] softmax probabilities (4 GiB per layer and "
         "micro-batch at 128 heads and sequence 4096); an FP8 output projection (--moe-fp4-linears fp8) keeps "
         "that same output by reference instead of a copy of its own, unless core_attn recompute runs the "
         "attention without saving it. For runs without Transformer Engine, such as "
         "--moe-fp4-linears fp8; causal or unmasked attention without dropout."),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags on Megatron's parser (the signature of Megatron's extra_args_provider)."""
    group = parser.add_argument_group("megatron_fp4", "MXFP4 dispatch and FP8 experts for MoE layers "
                                      "(refusals: docs/usage.md)")
    for flag in FLAGS:
        if flag.choices is None:
            group.add_argument(flag.option, action="store_true", help=flag.help)
        elif flag.many:
            group.add_argument(flag.option, nargs="+", choices=[c.value for c in flag.choices], default=[],
                               metavar="{" + ",".join(c.value for c in flag.choices) + "}", help=flag.help)
        else:
            group.add_argument(flag.option, choices=[c.value for c in flag.choices], default=flag.default.value,
                               help=flag.help + f" Default: {flag.default.value}.")
    return parser


def megatron_recompute(granularity: Optional[str], modules,
                       moe_layer_recompute: bool) -> Tuple[Optional[str], Optional[list]]:
    """(recompute_granularity, recompute_modules) as Megatron's TransformerConfig resolves them
    (megatron-core 0.18 and 0.19): the deprecated --moe-layer-recompute is selective recompute with
    `moe` added to the modules (core_attn, the modules' default, when none are given); with full
    granularity Megatron refuses it, and it is left as it is here."""
    if not moe_layer_recompute or granularity == "full":
        return granularity, modules
    modules = list(modules) if modules is not None else ["core_attn"]
    return "selective", modules + ["moe"] * ("moe" not in modules)


def _some_layer_dense(moe_layer_freq) -> bool:
    """Megatron's moe_layer_freq: every N-th layer MoE (N > 1 leaves dense layers) or a 0/1 list per
    layer; anything else (an unparsed pattern string) counts as possibly dense."""
    if isinstance(moe_layer_freq, int):
        return moe_layer_freq > 1
    if isinstance(moe_layer_freq, (list, tuple)):
        return 0 in moe_layer_freq
    return True


@dataclass(frozen=True)
class ModelSettings:
    """What the refusals need to know of the Megatron run, read the same way from parsed arguments
    and from a TransformerConfig (whose names differ for a few settings)."""

    num_experts: Optional[int]
    fp16: bool  # --fp16: the model's activations in float16
    dispatcher_type: Optional[str]
    hidden_size: Optional[int]
    dispatched_width: Optional[int]  # the MoE latent size when set, else hidden
    moe_ffn_hidden_size: Optional[int]
    expert_tensor_parallel_size: int
    tensor_parallel_size: int
    transformer_impl: Optional[str]
    context_parallel_size: int
    swiglu: bool
    add_bias_linear: bool
    recompute_granularity: Optional[str]
    recompute_modules: Tuple[str, ...]
    capacity_factor: Optional[float]
    pad_to_capacity: bool
    permute_fusion: bool
    probs_on_input: bool
    delay_wgrad: bool
    activation_clamp: Optional[float]
    overlap_ep_comm: bool
    overlap_dispatch_wgrad: bool
    cuda_graph_captures_moe: bool
    local_cuda_graphs: bool  # Megatron then never checkpoints a MoE layer (moe_layer_recompute off)
    inference_optimized: bool
    attention_dropout: float
    multi_latent_attention: bool
    has_dense_mlp: bool  # some layer's MLP is dense (no experts, or moe_layer_freq leaves layers dense)
    has_shared_experts: bool
    reset_attention_mask: bool  # data-loader masks with document boundaries (arguments only)
    # --offload-modules under --fine-grained-activation-offloading (else none)
    offloaded_modules: Tuple[str, ...]
    # Checkpoints of the distributed optimizer in its default, parameter-ordered format (a config
    # does not say: then FP8Experts check the format at save and load).
    bucket_space_checkpoints: bool

    @classmethod
    def from_args(cls, args) -> "ModelSettings":
        return cls._read(args, num_experts=getattr(args, "num_experts", None),
                         swiglu=bool(getattr(args, "swiglu", False)))

    @classmethod
    def from_config(cls, config) -> "ModelSettings":
        import torch.nn.functional as F

        swiglu = bool(getattr(config, "gated_linear_unit", False)) and getattr(config, "activation_func", None) is F.silu
        return cls._read(config, num_experts=getattr(config, "num_moe_experts", None), swiglu=swiglu)

    @classmethod
    def _read(cls, source, num_experts, swiglu) -> "ModelSettings":
        get = lambda name, default=None: getattr(source, name, default)  # noqa: E731
        hidden = get("hidden_size")
        granularity, modules = megatron_recompute(get("recompute_granularity"), get("recompute_modules"),
                                                  bool(get("moe_layer_recompute", False)))
        return cls(
            num_experts=num_experts,
            fp16=bool(get("fp16", False)),
            dispatcher_type=get("moe_token_dispatcher_type"),
            hidden_size=hidden,
            dispatched_width=get("moe_latent_size") or hidden,
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            expert_tensor_parallel_size=get("expert_tensor_parallel_size") or 1,
            tensor_parallel_size=get("tensor_model_parallel_size") or 1,
            transformer_impl=get("transformer_impl"),
            context_parallel_size=get("context_parallel_size") or 1,
            swiglu=swiglu,
            add_bias_linear=bool(get("add_bias_linear", False)),
            recompute_granularity=granularity,
            recompute_modules=tuple(modules or ()),
            capacity_factor=get("moe_expert_capacity_factor"),
            pad_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False)),
            permute_fusion=bool(get("moe_permute_fusion", False)),
            probs_on_input=bool(get("moe_apply_probs_on_input", False)),
            delay_wgrad=bool(get("delay_wgrad_compute", False)),
            activation_clamp=get("activation_func_clamp_value"),
            overlap_ep_comm=bool(get("overlap_moe_expert_parallel_comm", False)),
            overlap_dispatch_wgrad=bool(get("overlap_dispatch_backward_with_experts_wgrad", False)),
            cuda_graph_captures_moe=_cuda_graph_captures_moe(source),
            local_cuda_graphs=get("cuda_graph_impl") == "local",
            inference_optimized=get("transformer_impl") == "inference_optimized",
            attention_dropout=get("attention_dropout") or 0.0,
            multi_latent_attention=bool(get("multi_latent_attention", False)),
            has_dense_mlp=not num_experts or _some_layer_dense(get("moe_layer_freq", 1)),
            has_shared_experts=bool(num_experts and get("moe_shared_expert_intermediate_size")),
            reset_attention_mask=bool(get("reset_attention_mask", False)),
            offloaded_modules=tuple(get("offload_modules") or ()) if get("fine_grained_activation_offloading") else (),
            bucket_space_checkpoints=bool(
                (get("use_distributed_optimizer", False) or get("use_layer_wise_distributed_optimizer", False))
                and (get("save") or get("load")) and not get("dist_ckpt_optim_fully_reshardable", False)),
        )

    @property
    def moe_recompute(self) -> bool:
        """Whether Megatron checkpoints whole MoE layers (MoELayer.moe_layer_recompute)."""
        return self.recompute_granularity == "selective" and "moe" in self.recompute_modules and not self.local_cuda_graphs


# --offload-modules that Megatron implements inside its experts (TEGroupedMLP)
_EXPERT_OFFLOAD_MODULES = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})

# CUDA-graph regions that contain (part of) the MoE layer; an empty list means the whole layer.
_MOE_GRAPH_MODULES = {"moe", "moe_router", "moe_preprocess"}


def _cuda_graph_captures_moe(source) -> bool:
    if getattr(source, "enable_cuda_graph", False) or getattr(source, "external_cuda_graph", False):
        return True  # the pre-0.19 switches captured whole layers
    impl = getattr(source, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return False
    if impl == "full_iteration":
        return True
    # Megatron's validation moves the deprecated --cuda-graph-scope into cuda_graph_modules; the
    # estimator and --dry-run read the arguments before it.
    modules = getattr(source, "cuda_graph_scope_deprecated", None) or getattr(source, "cuda_graph_modules", None)
    names = {getattr(m, "name", str(m)) for m in (modules or [])}
    return not names or bool(names & (_MOE_GRAPH_MODULES | {"full_iteration"}))


@dataclass(frozen=True)
class Environment:
    megatron_core_version: str
    cuda_available: bool
    compute_capability: Optional[Tuple[int, int]] = None  # of this process's GPU

    @classmethod
    def here(cls) -> "Environment":
        import megatron.core
        import torch

        cuda = torch.cuda.is_available()
        return cls(megatron.core.__version__, cuda, tuple(torch.cuda.get_device_capability()) if cuda else None)


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
_fp4_payload = lambda o: o.dispatch or o.cache or o.saved_input  # noqa: E731
_moe = lambda o: o.touches_moe_layers  # noqa: E731


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
    Refusal("--moe-fp4-telemetry without --moe-fp4-dispatch",
            lambda o, m, e, r: o.telemetry and not o.dispatch,
            "--moe-fp4-telemetry needs --moe-fp4-dispatch: it reports the FP4 dispatch's traffic, error and storage."),
    Refusal("--moe-fp4-saved-input with --moe-fp4-experts fp8",
            lambda o, m, e, r: o.saved_input and _fp8_experts(o),
            "--moe-fp4-saved-input is for Megatron's BF16 experts; --moe-fp4-experts fp8 already keeps its saved "
            "input in FP4: drop --moe-fp4-saved-input."),
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
            "--moe-fp4-dispatch, --moe-fp4-experts fp8, --moe-fp4-linears fp8 and --moe-fp4-fused-attention need "
            "CUDA GPUs: their Triton kernels, FP8 GEMMs and fused attention kernels run only there."),
    Refusal("--moe-fp4-linears fp8 on a GPU other than Hopper (SM90)",
            lambda o, m, e, r: _fp8_linears(o) and e is not None and e.compute_capability not in (None, (9, 0)),
            "--moe-fp4-linears fp8 needs Hopper GPUs (compute capability 9.0, found {compute_capability}): its FP8 "
            "block-scaled GEMMs are SM90's; drop --moe-fp4-linears fp8."),
    Refusal("--moe-fp4-experts fp8 on a GPU other than Hopper (SM90)",
            lambda o, m, e, r: _fp8_experts(o) and e is not None and e.compute_capability not in (None, (9, 0)),
            "--moe-fp4-experts fp8 needs Hopper GPUs (compute capability 9.0, found {compute_capability}): its FP8 "
            "block-scaled GEMMs are SM90's; drop --moe-fp4-experts fp8."),
    Refusal("the patch route (also our launcher on a patched tree) with --moe-fp4-cache, --moe-fp4-saved-input, "
            "--moe-fp4-experts fp8, --moe-fp4-linears fp8, --moe-fp4-telemetry or --moe-fp4-fused-attention",
            lambda o, m, e, r: r is Route.PATCH and (o.cache or o.saved_input or _fp8_experts(o) or _fp8_linears(o)
                                                     or o.telemetry or o.fused_attention),
            "a megatron-core tree patched with `megatron-fp4 patch` serves --moe-fp4-dispatch only: drop "
            "--moe-fp4-cache, --moe-fp4-saved-input, --moe-fp4-experts fp8, --moe-fp4-linears fp8, "
            "--moe-fp4-telemetry and --moe-fp4-fused-attention, or run megatron_fp4.launch on an unpatched "
            "megatron-core."),
    Refusal("context parallelism (our launcher does not slice batches per CP rank)",
            lambda o, m, e, r: r is Route.LAUNCHER and m.context_parallel_size > 1,
            "megatron_fp4's launcher does not slice batches for context parallelism: use --context-parallel-size 1."),
    # The model.
    Refusal("no MoE layers",
            lambda o, m, e, r: _moe(o) and not m.num_experts,
            "--moe-fp4-dispatch and --moe-fp4-experts fp8 need an MoE model: set --num-experts."),
    Refusal("a dispatcher other than alltoall",
            lambda o, m, e, r: o.dispatch and m.dispatcher_type != "alltoall",
            "--moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall (got {dispatcher_type}): it replaces "
            "that dispatcher's all-to-all."),
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
    # What our FP8 experts implement.
    Refusal("--moe-fp4-experts fp8 with the flex dispatcher",
            lambda o, m, e, r: _fp8_experts(o) and m.dispatcher_type == "flex",
            "--moe-fp4-experts fp8 does not support --moe-token-dispatcher-type flex: that dispatcher hands the "
            "experts DeepEP / NCCL-EP buffers it does not serve; use alltoall."),
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


def before_megatron_validation(args, defaults: Optional[dict] = None) -> argparse.Namespace:
    """A copy of Megatron's parsed, not yet validated arguments with what its validate_args would
    fill in that the refusals read: `defaults` (its args_defaults) where a flag is unset, and the
    few settings it derives from other flags. For checks that come before Megatron's own: ahead of
    its argument dump at start-up, and in plans for another machine (--dry-run, the estimator),
    where its validation cannot run (it asks the GPU)."""
    args = argparse.Namespace(**vars(args))
    for name, value in (defaults or {}).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.num_experts == 0:
        args.num_experts = None
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    return args


def validate_args(args, route: Route, environment: Optional[Environment]) -> FP4Options:
    """validate() for Megatron's parsed arguments; returns the options they ask for."""
    options = FP4Options.from_args(args)
    validate(options, ModelSettings.from_args(args), environment, route)
    return options


def usage_markdown() -> str:
    """The flags and refusals tables of docs/usage.md."""
    lines = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for flag in FLAGS:
        default = "off" if flag.choices is None else "none" if flag.many else f"`{flag.default.value}`"
        choices = "" if flag.choices is None else " {" + ",".join(c.value for c in flag.choices) + "}" + (
            " ..." if flag.many else "")
        lines.append(f"| `{flag.option}`{choices} | {default} | {flag.help} |")
    lines += ["", "| refused | message |", "| --- | --- |"]
    for refusal in REFUSALS:
        message = re.sub(r"\{(\w+)\}", r"<\1>", refusal.message)  # the values the user's run fills in
        lines.append(f"| {refusal.when} | {message} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(usage_markdown(), end="")
