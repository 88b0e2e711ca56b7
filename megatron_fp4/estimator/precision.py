"""Which precision a config trains in, and the bytes per element each kind of saved tensor costs.

- bf16: no `fp8_format`, no `moe_fp4_dispatch`.
- fp8: `fp8_format` set: Transformer Engine FP8 GEMMs (DeepSeek-style blockwise: 1x128 activation
  blocks, 128x128 weight blocks, fp32 scales).
- fp4: `moe_fp4_dispatch: true` (GEMMs in FP8 when `fp8_format` is set too, as in the paper's
  recipe and configs/deepseek_v3_671b/fp4.yaml; BF16 otherwise). Two memory models, because the
  installed package does not yet deliver everything the paper's recipe does:
  - "recipe" (arXiv 2603.02731): the routed tokens dispatched in MXFP4, the experts' saved
    activations (dispatched tokens, SwiGLU input, fc2 input) kept in MXFP4, and under `moe`
    recompute the received payload cached so that the recompute does not dispatch again;
  - "installed" (this package today): the dispatch all-to-all carries MXFP4, but the payload is
    dequantized to BF16 before Megatron's own experts, so the saved activations are those of the
    baseline precision (bf16, or fp8 if `fp8_format` is also set). With `moe_fp4_cache` and `moe`
    recompute it also keeps the received MXFP4 payload for the recompute.
  With `moe_fp4_experts: fp8` (our FP8 experts keep those three tensors in MXFP4) "installed"
  follows the recipe for them, and the routed experts' FP8 weights are transient (quantized per
  use) instead of two copies cached for the step; with `moe_fp4_saved_input` (BF16 experts) it
  follows the recipe for the dispatched tokens.
"""

from dataclasses import dataclass

from ..formats import (
    FP8_1X128_BYTES_PER_ELEMENT as FP8_1X128_BYTES,
    FP8_128X128_BYTES_PER_ELEMENT as FP8_128X128_BYTES,
    MXFP4_BYTES_PER_ELEMENT as MXFP4_BYTES,
    MXFP8_BYTES_PER_ELEMENT as MXFP8_BYTES,
)


BYTES_OF_DTYPE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "torch.float32": 4, "torch.bfloat16": 2,
                  "torch.float16": 2, "torch.uint8": 1}


def dtype_bytes(value) -> float:
    return BYTES_OF_DTYPE[str(value)]


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16", "fp8" or "fp4" (the config's precision)
    model_bytes: int  # params / activations in the model dtype (bf16: 2)
    fp8: bool  # GEMMs in FP8 through Transformer Engine
    fp8_act_bytes: float  # bytes/element of an FP8 GEMM input saved for backward
    fp8_recipe: str  # Transformer Engine's scaling recipe ("blockwise", "delayed", ...); unused without fp8
    fp8_weight_bytes: float  # bytes/element of one FP8 copy of a weight
    fp4_dispatch: bool  # the dispatch all-to-all carries MXFP4 rows
    fp4_experts: bool  # expert activations (dispatched tokens, SwiGLU input, fc2 input) kept in MXFP4
    fp4_cache: bool  # with `moe` recompute, the received MXFP4 payload is kept for the recompute
    grad_wire: str  # format of the dispatch gradient all-to-all: "bf16" or "fp8"
    fp4_expert_input: bool = False  # the experts' saved input (dispatched tokens) kept in MXFP4
    # Our FP8 experts (installed, --moe-fp4-experts fp8) keep two FP8 copies (128x128 blocks) of the
    # routed experts' weights for the step, as Transformer Engine does for its FP8 GEMMs, also in a
    # run whose other GEMMs are BF16; with --moe-fp4-weights-per-use they quantize them per use instead,
    # one linear's experts at a time.
    fp8_experts_installed: bool = False
    expert_weights_per_use: bool = False

    @property
    def gemm_input_bytes(self) -> float:
        """What a GEMM keeps of its input for the weight gradient."""
        return self.fp8_act_bytes if self.fp8 else self.model_bytes


def _fp8_bytes(recipe: str) -> tuple:
    if recipe == "mxfp8":
        return MXFP8_BYTES, MXFP8_BYTES
    if recipe == "blockwise":
        return FP8_1X128_BYTES, FP8_128X128_BYTES
    return 1.0, 1.0  # delayed / tensorwise: one scale per tensor


def precision_of(args, mode: str = "recipe") -> Precision:
    """mode: "recipe" (the paper's FP4 recipe) or "installed" (what this package delivers now).
    Both are the same for bf16 and fp8 configs."""
    if mode not in ("recipe", "installed"):
        raise ValueError(f"mode must be recipe or installed, got {mode!r}")
    fp4 = bool(getattr(args, "moe_fp4_dispatch", False))
    fp8 = bool(args.fp8)
    recipe = args.fp8_recipe if args.fp8 else "blockwise"
    act, weight = _fp8_bytes(recipe)
    installed_experts = getattr(args, "moe_fp4_experts", "bf16") == "fp8"  # FP8Experts save MXFP4
    cache = bool(getattr(args, "moe_fp4_cache", False))
    # --moe-fp4-saved-input swaps the BF16 input slices Megatron's own experts save for the payload;
    # Transformer Engine's FP8 experts save their own FP8 copy, which it leaves alone.
    saved_input = bool(getattr(args, "moe_fp4_saved_input", False)) and not fp8
    model_bytes = 4 if not (args.bf16 or args.fp16) else 2
    name = "fp4" if fp4 else ("fp8" if args.fp8 else ("bf16" if model_bytes == 2 else "fp32"))
    return Precision(
        name=name,
        model_bytes=model_bytes,
        fp8=fp8,
        fp8_act_bytes=act,
        fp8_recipe=recipe,
        fp8_weight_bytes=weight,
        fp4_dispatch=fp4,
        fp4_experts=fp4 and (mode == "recipe" or installed_experts),
        fp4_cache=fp4 and (mode == "recipe" or cache),
        fp4_expert_input=fp4 and (mode == "recipe" or installed_experts or saved_input),
        grad_wire=getattr(args, "moe_fp4_dispatch_grad", "bf16") if fp4 else "bf16",
        fp8_experts_installed=mode == "installed" and installed_experts,
        expert_weights_per_use=mode == "installed" and installed_experts
        and bool(getattr(args, "moe_fp4_weights_per_use", False)),
    )
