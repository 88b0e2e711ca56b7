"""Our command-line flags: one `Flag` per FP4Options field, with its help text, and
`add_arguments`, which puts them on Megatron's parser."""

import argparse
from dataclasses import dataclass, fields
from typing import Optional

from ..formats import ScaleRule
from .fp4_options import ExpertsPrecision, FP4Options, GradFormat, LinearRole, LinearsPrecision, Storage, flag_attribute


@dataclass(frozen=True)
class Flag:
    field: str  # FP4Options' field
    help: str
    choices: Optional[type] = None  # the enum, for valued flags
    many: bool = False  # a list of choices (nargs "+"), an FP4Options frozenset

    @property
    def attribute(self) -> str:
        return flag_attribute(self.field)

    @property
    def option(self) -> str:
        return "--" + self.attribute.replace("_", "-")

    @property
    def default(self):
        return next(f.default for f in fields(FP4Options) if f.name == self.field)


FLAGS = (
    Flag("dispatch", "Quantize routed tokens to MXFP4 before the expert-parallel all-to-all (H/2 + H/32 bytes per "
         "token instead of 2H), under --moe-token-dispatcher-type alltoall, or flex with DeepEP (the payload in "
         "DeepEP's FP8 slot, DeepEP unchanged). Off: stock Megatron dispatch."),
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
    Flag("keep_transposed_weights", "With --moe-fp4-experts fp8 or --moe-fp4-linears fp8: also keep each FP8 "
         "layer's W^T (the data gradient's operand, 128x128 blocks) beside W, made in a step's first backward and "
         "reused by every later micro-batch's, instead of made for each data-gradient GEMM and freed after it. "
         "Costs one more FP8 byte per weight element for the whole run, as W does (Transformer Engine's FP8 "
         "weights keep both too); saves each micro-batch after a step's first the W^T copies (for the routed "
         "experts a read and a write of their FP8 weights), so nothing with one micro-batch per step. Not with "
         "--moe-fp4-weights-per-use."),
    Flag("fused_attention", "Compute the core attention of Megatron's local layers (--transformer-impl local, "
         "standard and MLA self-attention) with torch's fused scaled-dot-product-attention kernels (flash, "
         "memory-efficient or cuDNN, never the math one) instead of the unfused DotProductAttention: backward keeps "
         "the output and its log-sum-exp, not the [b, heads, s, s] softmax probabilities (4 GiB per layer and "
         "micro-batch at 128 heads and sequence 4096); an FP8 output projection (--moe-fp4-linears fp8) keeps "
         "that same output by reference instead of a copy of its own, unless core_attn recompute runs the "
         "attention without saving it. For runs without Transformer Engine, such as "
         "--moe-fp4-linears fp8; causal or unmasked attention without dropout."),
    Flag("recompute_experts", "Recompute the routed experts in backward from their dispatched input, which is all "
         "they keep for it (the FP8-Flow-MoE fork's `moe_expert` scope): with --moe-fp4-dispatch and "
         "--moe-fp4-experts fp8 the received MXFP4 payload (H/2 + H/32 bytes per routed row), otherwise the "
         "dispatched BF16 rows (2H bytes). Backward runs fc1 and the SwiGLU again, no dispatch, router or "
         "permutation: the rest of the MoE layer keeps its tensors. Our FP8 experts then keep nothing in MXFP4 "
         "but the exact payload (the recomputed SwiGLU and fc2 inputs are BF16 / FP8, as under `moe` "
         "recompute); Megatron's own experts run inside Megatron's activation checkpoint. Not with `moe` or "
         "`moe_act` in --recompute-modules or full recompute (they recompute the experts already), "
         "--moe-fp4-saved-input, Transformer Engine's FP8 or FP4 (--fp8-format, --fp4-format), delayed weight "
         "gradients or the flex dispatcher's backends other than DeepEP."),
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
