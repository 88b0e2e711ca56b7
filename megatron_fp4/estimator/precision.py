"""Which precision a config trains in, and the bytes per element each kind of saved tensor costs.

- bf16: none of the switches below.
- fp8: `fp8_format` set (Transformer Engine FP8 GEMMs, DeepSeek-style blockwise: 1x128 activation
  blocks, 128x128 weight blocks, fp32 scales), or our FP8 layers without the FP4 dispatch:
  `moe_fp4_linears: fp8` (attention projections, MLA up-projections, dense MLP, shared experts,
  less the roles `moe_fp4_bf16_linears` leaves to Megatron's BF16 linears) and / or
  `moe_fp4_experts: fp8` (routed experts; without a payload they quantize the BF16 dispatch and
  keep their three activations in BF16, as megatron_fp4/experts/function.py does). That is the
  FP8 baseline of configs/deepseek_v3_671b/fp8.yaml.
- fp4: `moe_fp4_dispatch: true`. Two memory models:
  - "recipe" (arXiv 2603.02731, docs/design.md §7): the paper's whole recipe, whatever else the config
    sets: the routed tokens dispatched in MXFP4, our FP8 experts fed from the payload (their three
    activations in MXFP4), our FP8 linears with every saved input and the dense-MLP / shared-expert
    SwiGLU inputs in MXFP4 (`moe_fp4_storage: all`), FP8 weight copies cached for the step, and
    under `moe` recompute the received payload cached (no second dispatch); every linear role FP8
    (`moe_fp4_bf16_linears` ignored);
  - "installed": what the config's flags switch on in this package (the flags above,
    `moe_fp4_bf16_linears`, `moe_fp4_storage`, `moe_fp4_cache`, `moe_fp4_saved_input`,
    `moe_fp4_weights_per_use`). The paper's FP4 configs set all of them, so there the two rows agree.
"""

from dataclasses import dataclass

from ..formats import (
    FP8_1X128_BYTES_PER_ELEMENT as FP8_1X128_BYTES,
    FP8_128X128_BYTES_PER_ELEMENT as FP8_128X128_BYTES,
    MXFP4_BYTES_PER_ELEMENT as MXFP4_BYTES,
    MXFP8_BYTES_PER_ELEMENT as MXFP8_BYTES,
)
from ..options import FP4Options, LinearRole


BYTES_OF_DTYPE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "torch.float32": 4, "torch.bfloat16": 2,
                  "torch.float16": 2, "torch.uint8": 1}


def dtype_bytes(value) -> float:
    return BYTES_OF_DTYPE[str(value)]


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16", "fp8" or "fp4" (the config's precision)
    model_bytes: int  # params / activations in the model dtype (bf16: 2)
    fp8: bool  # GEMMs in FP8 through Transformer Engine (`fp8_format`)
    fp8_act_bytes: float  # bytes/element of a Transformer Engine FP8 GEMM input saved for backward
    fp8_recipe: str  # Transformer Engine's scaling recipe ("blockwise", "delayed", ...); unused without fp8
    fp8_weight_bytes: float  # bytes/element of one Transformer Engine FP8 copy of a weight
    fp4_dispatch: bool  # the dispatch all-to-all carries MXFP4 rows
    fp4_experts: bool  # our FP8 experts keep their SwiGLU and fc2 inputs in MXFP4 (not under storage none)
    fp4_cache: bool  # with `moe` recompute, the received MXFP4 payload is kept for the recompute
    grad_wire: str  # format of the dispatch gradient all-to-all: "bf16" or "fp8"
    fp4_expert_input: bool = False  # the experts' saved input (dispatched tokens) kept in MXFP4
    # Our FP8 experts (--moe-fp4-experts fp8): fed from the payload they keep MXFP4 (fp4_experts);
    # without one (the FP8 baseline) their saved tokens, SwiGLU input and fc2 input are BF16.
    fp8_experts: bool = False
    # The roles whose linears are ours in FP8 (--moe-fp4-linears fp8 less --moe-fp4-bf16-linears): each
    # keeps only its input, FP8 1x128 (or MXFP4 under fp4_storage_all outside recomputed modules). The
    # other roles' linears are Megatron's (or Transformer Engine's under `fp8`), as without the flag.
    fp8_linear_roles: frozenset = frozenset()
    # --moe-fp4-storage all: the FP8 roles' linear inputs and dense / shared SwiGLU inputs in MXFP4
    fp4_storage_all: bool = False
    # Our FP8 experts and linears keep one FP8 copy (W, 128x128 blocks) of their weights for the step,
    # also in a run whose other GEMMs are BF16, and make the data gradient's W^T from it in backward
    # (Transformer Engine keeps both); with --moe-fp4-weights-per-use they quantize W and W^T per
    # use instead, one linear at a time.
    weights_per_use: bool = False
    # --moe-fp4-keep-transposed-weights: W^T kept for the step beside W (no transient W^T in backward)
    keep_transposed_weights: bool = False
    # The dispatch carries FP8 1x128 tokens that the experts keep as their input (FP8-Flow-MoE's
    # dataflow; no flag of Megatron 0.19 or ours: only estimate(..., precision={"fp8_dispatch": True})).
    fp8_dispatch: bool = False

    @property
    def gemm_input_bytes(self) -> float:
        """What a GEMM of the baseline (Megatron's or Transformer Engine's) keeps of its input for
        the weight gradient."""
        return self.fp8_act_bytes if self.fp8 else self.model_bytes

    def fp8_linear(self, role: LinearRole) -> bool:
        """Whether the linears of `role` are ours in FP8."""
        return role in self.fp8_linear_roles


def _fp8_bytes(recipe: str) -> tuple:
    if recipe == "mxfp8":
        return MXFP8_BYTES, MXFP8_BYTES
    if recipe == "blockwise":
        return FP8_1X128_BYTES, FP8_128X128_BYTES
    return 1.0, 1.0  # delayed / tensorwise: one scale per tensor


def _switches(args, recipe: bool) -> dict:
    """Our flags as the memory model reads them; `recipe`: the paper's whole recipe instead."""
    if recipe:  # the payload cached where there is a `moe` recompute to replay it (as --moe-fp4-cache asks)
        moe_recompute = args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or ())
        return {"experts": "fp8", "linears": "fp8", "bf16_linears": (), "storage": "all", "cache": moe_recompute,
                "saved_input": False, "weights_per_use": False, "keep_transposed_weights": False}
    return {"experts": getattr(args, "moe_fp4_experts", "bf16"), "linears": getattr(args, "moe_fp4_linears", "bf16"),
            "bf16_linears": getattr(args, "moe_fp4_bf16_linears", None) or (),
            "storage": getattr(args, "moe_fp4_storage", "experts"), "cache": bool(getattr(args, "moe_fp4_cache", False)),
            "saved_input": bool(getattr(args, "moe_fp4_saved_input", False)),
            "weights_per_use": bool(getattr(args, "moe_fp4_weights_per_use", False)),
            "keep_transposed_weights": bool(getattr(args, "moe_fp4_keep_transposed_weights", False))}


def _fp8_linear_roles(flags: dict) -> frozenset:
    """The roles whose linears are ours in FP8, by the plugin's own rule (FP4Options.fp8_linear)."""
    options = FP4Options(linears=flags["linears"], bf16_linears=flags["bf16_linears"])
    return frozenset(role for role in LinearRole if options.fp8_linear(role))


def precision_of(args, mode: str = "recipe") -> Precision:
    """mode: "recipe" (the paper's FP4 recipe) or "installed" (what the config's flags switch on).
    Both are the same for bf16 and fp8 configs."""
    if mode not in ("recipe", "installed"):
        raise ValueError(f"mode must be recipe or installed, got {mode!r}")
    fp4 = bool(getattr(args, "moe_fp4_dispatch", False))
    fp8 = bool(args.fp8)
    recipe = args.fp8_recipe if args.fp8 else "blockwise"
    act, weight = _fp8_bytes(recipe)
    flags = _switches(args, fp4 and mode == "recipe")
    ours_experts = flags["experts"] == "fp8"
    fp8_linear_roles = _fp8_linear_roles(flags)
    ours_linears = bool(fp8_linear_roles)
    # --moe-fp4-saved-input swaps the BF16 input slices Megatron's own experts save for the payload;
    # Transformer Engine's FP8 experts save their own FP8 copy, which it leaves alone.
    saved_input = flags["saved_input"] and not fp8
    model_bytes = 4 if not (args.bf16 or args.fp16) else 2
    if fp4:
        name = "fp4"
    elif fp8 or ours_experts or ours_linears:
        name = "fp8"
    else:
        name = "bf16" if model_bytes == 2 else "fp32"
    return Precision(
        name=name,
        model_bytes=model_bytes,
        fp8=fp8,
        fp8_act_bytes=act,
        fp8_recipe=recipe,
        fp8_weight_bytes=weight,
        fp4_dispatch=fp4,
        fp4_experts=fp4 and ours_experts and flags["storage"] != "none",
        fp4_cache=fp4 and flags["cache"],
        fp4_expert_input=fp4 and (ours_experts or saved_input),
        grad_wire=getattr(args, "moe_fp4_dispatch_grad", "bf16") if fp4 else "bf16",
        fp8_experts=ours_experts,
        fp8_linear_roles=fp8_linear_roles,
        fp4_storage_all=ours_linears and flags["storage"] == "all",
        weights_per_use=(ours_experts or ours_linears) and flags["weights_per_use"],
        keep_transposed_weights=(ours_experts or ours_linears) and flags["keep_transposed_weights"]
        and not flags["weights_per_use"],
    )
