"""Our command-line flags and the configurations the FP4 dispatcher refuses, each with one
sentence that says what and why.

`add_fp4_args` has the signature of Megatron's `extra_args_provider`; YAML configs use the same
names with underscores (moe_fp4_dispatch, moe_fp4_dispatch_grad, moe_fp4_scale_rule, moe_fp4_cache,
moe_fp4_saved_input, moe_fp4_experts).
"""

import argparse
from typing import Optional

import torch

from ..dispatch import GRAD_FORMATS
from ..dispatch.options import CACHE_WITH_CAPACITY
from .experts_spec import EXPERTS_CHOICES
from ..formats import FP8_BLOCK, SCALE_RULES

# megatron-core releases whose MoE dispatcher seams (DESIGN §5) this package is written against.
SUPPORTED_MEGATRON_CORE = ((0, 17), (0, 19))


class FP4DispatchUnsupported(ValueError):
    """A configuration the FP4 dispatcher cannot serve."""


def add_fp4_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron_fp4", "MXFP4 token dispatch for MoE layers")
    group.add_argument(
        "--moe-fp4-dispatch",
        action="store_true",
        help="Quantize routed tokens to MXFP4 before the expert-parallel all-to-all (H/2 + H/32 bytes "
        "per token instead of 2H). Needs --moe-token-dispatcher-type alltoall. Off: stock Megatron.",
    )
    group.add_argument(
        "--moe-fp4-dispatch-grad",
        choices=GRAD_FORMATS,
        default="bf16",
        help="Format of the gradient sent back through the dispatch all-to-all: bf16 (default: unquantized, "
        "in the model's dtype, exact) or fp8 (E4M3 with 1x128 power-of-two scales).",
    )
    group.add_argument(
        "--moe-fp4-scale-rule",
        choices=SCALE_RULES,
        default="ceil",
        help="MXFP4 block scale: ceil (default; 2^ceil(log2(amax/6)), never clips) or floor (OCP: "
        "2^(floor(log2(amax)) - 2), saturates at 6).",
    )
    group.add_argument(
        "--moe-fp4-cache",
        action="store_true",
        help="With --recompute-modules moe: keep each MoE layer's received MXFP4 payload (26.6%% of the "
        "BF16 bytes) from its first pass, so that the recompute does not send the dispatch again. The "
        "gradient all-to-all still runs. Needs --moe-fp4-dispatch; not with --moe-expert-capacity-factor. "
        "Off by default: faster, but it holds the "
        "payload of every checkpointed MoE layer and micro-batch in flight, memory that `moe` recompute "
        "was chosen to save.",
    )
    group.add_argument(
        "--moe-fp4-saved-input",
        action="store_true",
        help="Keep the saved fc1 input of Megatron's own experts (SequentialMLP) as the received MXFP4 payload "
        "instead of BF16 (lossless: those values are FP4 values). Needs --moe-fp4-dispatch; not with "
        "--moe-permute-fusion, not with --moe-fp4-experts fp8 (which keeps FP4 itself).",
    )
    group.add_argument(
        "--moe-fp4-experts",
        choices=EXPERTS_CHOICES,
        default="bf16",
        help="Routed experts: bf16 (default: Megatron's own, behind the exact FP4 -> BF16 dequantization) or fp8 "
        "(ours: fc1/fc2 and their gradients as FP8 GEMMs with 1x128 / 128x128 power-of-two scales on SM90, "
        "fed straight from the MXFP4 payload, SwiGLU and fc2 inputs saved in MXFP4; same parameters and "
        "checkpoint keys as Megatron's SequentialMLP). Without --moe-fp4-dispatch, fp8 quantizes the BF16 "
        "dispatch itself (the FP8 baseline). SwiGLU experts without bias, expert tensor parallel size 1, no "
        "--moe-apply-probs-on-input, --delay-wgrad-compute or moe_act recompute. Through the plugin's layer spec "
        "(scripts/pretrain_gpt_fp4.py, use_fp8_experts) only: a tree patched with `megatron-fp4 patch` refuses it.",
    )
    return parser


def _parse_version(version: str):
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise FP4DispatchUnsupported(f"--moe-fp4-dispatch cannot read the megatron-core version {version!r}")


def check_fp4_dispatch_supported(args, megatron_core_version: Optional[str] = None,
                                 cuda_available: Optional[bool] = None) -> None:
    """Raise FP4DispatchUnsupported if `args` (Megatron's parsed arguments, or any object with the
    same attribute names) asks for FP4 dispatch in a configuration it cannot serve."""
    check_fp8_experts_args(args)
    if not getattr(args, "moe_fp4_dispatch", False):
        if getattr(args, "moe_fp4_cache", False):
            raise FP4DispatchUnsupported("--moe-fp4-cache needs --moe-fp4-dispatch: it caches the FP4 dispatch's payload.")
        if getattr(args, "moe_fp4_saved_input", False):
            raise FP4DispatchUnsupported("--moe-fp4-saved-input needs --moe-fp4-dispatch: it keeps the FP4 dispatch's payload.")
        return
    if megatron_core_version is None:
        import megatron.core

        megatron_core_version = megatron.core.__version__
    low, high = SUPPORTED_MEGATRON_CORE
    found = _parse_version(megatron_core_version)
    if not low <= found <= high:
        raise FP4DispatchUnsupported(
            f"--moe-fp4-dispatch supports megatron-core {low[0]}.{low[1]} to {high[0]}.{high[1]}.x, found "
            f"{megatron_core_version}: its MoE dispatcher may differ from the seams this plugin overrides."
        )
    if not getattr(args, "num_experts", None):
        raise FP4DispatchUnsupported("--moe-fp4-dispatch needs an MoE model (--num-experts): there is nothing to dispatch.")
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if dispatcher != "alltoall":
        raise FP4DispatchUnsupported(
            f"--moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall (got {dispatcher}): it replaces that "
            "dispatcher's all-to-all, and the allgather and flex dispatchers move tokens differently."
        )
    hidden = getattr(args, "hidden_size", None)
    if hidden is None or hidden % FP8_BLOCK:
        raise FP4DispatchUnsupported(
            f"--moe-fp4-dispatch needs a hidden size divisible by {FP8_BLOCK} (got {hidden}): the FP8 1x128 "
            "blocks of the expert GEMMs must not straddle rows."
        )
    if (getattr(args, "expert_tensor_parallel_size", None) or 1) > 1:
        raise FP4DispatchUnsupported(
            "--moe-fp4-dispatch does not support expert tensor parallelism yet "
            f"(--expert-tensor-parallel-size {args.expert_tensor_parallel_size}): use expert parallelism instead."
        )
    if getattr(args, "moe_fp4_cache", False) and not (
        getattr(args, "recompute_granularity", None) == "selective" and "moe" in (getattr(args, "recompute_modules", None) or [])
    ):
        raise FP4DispatchUnsupported(
            "--moe-fp4-cache serves only the recompute of whole MoE layers: add --recompute-granularity selective "
            "--recompute-modules moe (...), or drop --moe-fp4-cache."
        )
    if getattr(args, "moe_fp4_cache", False) and getattr(args, "moe_expert_capacity_factor", None) is not None:
        raise FP4DispatchUnsupported(CACHE_WITH_CAPACITY)
    if getattr(args, "moe_fp4_saved_input", False) and getattr(args, "moe_permute_fusion", False):
        raise FP4DispatchUnsupported(
            "--moe-fp4-saved-input does not support --moe-permute-fusion yet: the payload rows are reordered like "
            "the experts' input by the unfused sort."
        )
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise FP4DispatchUnsupported("--moe-fp4-dispatch needs CUDA GPUs: its Triton kernels run only there.")


def check_fp8_experts_args(args) -> None:
    """Refusals of --moe-fp4-experts fp8 that show on the command line (the module checks the rest)."""
    if getattr(args, "moe_fp4_experts", "bf16") != "fp8":
        return
    if not getattr(args, "num_experts", None):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 needs an MoE model (--num-experts).")
    if not getattr(args, "swiglu", False):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 implements SwiGLU experts only: add --swiglu.")
    if getattr(args, "add_bias_linear", False):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 has no expert biases: add --disable-bias-linear.")
    if getattr(args, "moe_fp4_saved_input", False):
        raise FP4DispatchUnsupported("--moe-fp4-saved-input is for Megatron's BF16 experts; --moe-fp4-experts fp8 "
                                     "already keeps its saved input in FP4.")
    for flag, why in (("moe_apply_probs_on_input", "it applies the probs after SwiGLU"),
                      ("delay_wgrad_compute", "it computes weight gradients in backward"),
                      ("activation_func_clamp_value", "its SwiGLU has no clamp")):
        if getattr(args, flag, None):
            raise FP4DispatchUnsupported(f"--moe-fp4-experts fp8 does not support --{flag.replace('_', '-')}: {why}.")
    if "moe_act" in (getattr(args, "recompute_modules", None) or []):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 keeps its activations in MXFP4 and does not recompute them: "
                                     "drop moe_act from --recompute-modules.")
    if getattr(args, "moe_fp4_dispatch", False) and getattr(args, "moe_pad_expert_input_to_capacity", False):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 with --moe-fp4-dispatch does not support "
                                     "--moe-pad-expert-input-to-capacity: the payload rows follow the unfused sort.")
    if (getattr(args, "expert_tensor_parallel_size", None) or 1) > 1:
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 does not support expert tensor parallelism: use "
                                     "--expert-tensor-parallel-size 1.")
    if getattr(args, "moe_fp4_dispatch", False) and getattr(args, "moe_permute_fusion", False):
        raise FP4DispatchUnsupported("--moe-fp4-experts fp8 with --moe-fp4-dispatch does not support "
                                     "--moe-permute-fusion yet: the payload rows are reordered like the experts' "
                                     "input by the unfused sort.")
    for name in ("hidden_size", "moe_ffn_hidden_size"):
        value = getattr(args, name, None)
        if value is None or value % FP8_BLOCK:
            raise FP4DispatchUnsupported(f"--moe-fp4-experts fp8 needs --{name.replace('_', '-')} divisible by "
                                         f"{FP8_BLOCK} (got {value}).")
