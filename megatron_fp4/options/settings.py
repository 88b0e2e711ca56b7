"""What the refusals read of the run besides the options: the Megatron settings of the model
(`ModelSettings`, from parsed arguments or a TransformerConfig), this machine (`Environment`) and
the route by which the plugin reached the model (`Route`)."""

import argparse
import enum
from dataclasses import dataclass
from typing import Optional, Tuple

# megatron-core release lines whose MoE seams (docs/design.md §4) the dispatcher is written against and
# tested with (tests/versions).
SUPPORTED_MEGATRON_CORE = ((0, 18), (0, 19))


class Route(enum.StrEnum):
    """How the plugin reached the model."""

    LAUNCHER = "launcher"  # our pretrain_gpt_fp4.py (megatron_fp4.launch)
    PLUGIN = "plugin"  # our layer spec in the user's own training script
    PATCH = "patch"  # a Megatron tree patched with `megatron-fp4 patch` (Megatron's own MoELayer)


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


def flex_dispatcher_backend(source) -> Optional[str]:
    """The flex dispatcher's backend (deepep, hybridep or ncclep) as megatron-core 0.19's
    TransformerConfig resolves it, read the same way from parsed arguments and from a config: the
    deprecated --moe-enable-deepep means deepep, else --moe-flex-dispatcher-backend (Megatron's
    default: deepep). None under another dispatcher type."""
    if getattr(source, "moe_token_dispatcher_type", None) != "flex":
        return None
    if getattr(source, "moe_enable_deepep", False):
        return "deepep"
    return getattr(source, "moe_flex_dispatcher_backend", None) or "deepep"


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
    te_low_precision: bool  # --fp8-format or --fp4-format: Transformer Engine's FP8 / NVFP4 autocast
    bf16: bool  # --bf16: the model's activations in bfloat16 (neither: float32)
    dispatcher_type: Optional[str]
    flex_backend: Optional[str]  # the flex dispatcher's backend (flex_dispatcher_backend); None for others
    hidden_size: Optional[int]
    dispatched_width: Optional[int]  # the MoE latent size when set, else hidden
    moe_ffn_hidden_size: Optional[int]
    expert_tensor_parallel_size: int
    expert_parallel_size: int
    tensor_parallel_size: int
    transformer_impl: Optional[str]
    context_parallel_size: int
    swiglu: bool
    add_bias_linear: bool
    recompute_granularity: Optional[str]
    recompute_modules: Tuple[str, ...]
    capacity_factor: Optional[float]
    pad_to_capacity: bool
    # --moe-router-padding-for-quantization (or its alias --moe-router-padding-for-fp8)
    router_padding_for_quantization: bool
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
            te_low_precision=get("fp8") is not None or get("fp4") is not None,
            bf16=bool(get("bf16", False)),
            dispatcher_type=get("moe_token_dispatcher_type"),
            flex_backend=flex_dispatcher_backend(source),
            hidden_size=hidden,
            dispatched_width=get("moe_latent_size") or hidden,
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            expert_tensor_parallel_size=get("expert_tensor_parallel_size") or 1,
            expert_parallel_size=get("expert_model_parallel_size") or 1,
            tensor_parallel_size=get("tensor_model_parallel_size") or 1,
            transformer_impl=get("transformer_impl"),
            context_parallel_size=get("context_parallel_size") or 1,
            swiglu=swiglu,
            add_bias_linear=bool(get("add_bias_linear", False)),
            recompute_granularity=granularity,
            recompute_modules=tuple(modules or ()),
            capacity_factor=get("moe_expert_capacity_factor"),
            pad_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False)),
            router_padding_for_quantization=bool(get("moe_router_padding_for_quantization", False)
                                                 or get("moe_router_padding_for_fp8", False)),
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
