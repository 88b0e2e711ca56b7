"""The BF16 experts a user could write without our package: all local experts' SwiGLU MLPs over
the ragged per-expert segments with two `torch._grouped_mm` calls (fc1, fc2), autograd giving
the backward. The MoE layer benchmark's peer for our FP8 experts; swapped into a stock MoELayer in
place of its SequentialMLP, with the same weights (`from_sequential_mlp`).

torch._grouped_mm (checked on torch 2.13, the same contract as torch 2.10's
aten/src/ATen/native/GroupedMMUtils.h and GroupedBlas.cpp, which 2.11 carries):
- out[offs[e-1]:offs[e]] = a[offs[e-1]:offs[e]] @ b[e] for a 2-D a [tokens, K] and a 3-D b
  [experts, K, N]; `offs` the int32 cumulative ends of the segments (an int64 tensor is refused),
  on a's device, one per expert; empty segments are fine, rows past offs[-1] are left unwritten.
- each operand row-major or column-major in its last two dimensions with the leading stride a
  multiple of 16 bytes (K and N multiples of 8 in BF16) and, on CUDA, a 16-byte aligned start.
  The stored weights are [experts, N, K] like Megatron's linear layers; b is their transposed view.
- on SM90/SM100 with BF16 operands and output a CUTLASS grouped kernel without host sync; any
  other device or dtype (the CPU included) a loop of mm over the segments after copying offs to
  the host.
- differentiable: backward is two more grouped GEMMs (dgrad 2-D x 3-D, wgrad 2-D x 2-D grouped
  by offs); it needs a gradient with real strides (not an expanded one, e.g. of out.sum()).
"""

import torch
import torch.nn.functional as F


class GroupedMMExperts(torch.nn.Module):
    """SequentialMLP's math (SwiGLU, probs applied before fc2, no bias) in two grouped GEMMs.
    Parameters: fc1 [experts, 2 x FFN, hidden] (gate rows first, as Megatron stores them), fc2
    [experts, hidden, FFN]."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, glu_linear_offset: float = 0.0):
        super().__init__()
        experts, two_ffn, hidden = fc1.shape
        if fc2.shape != (experts, hidden, two_ffn // 2):
            raise ValueError(f"fc2 {tuple(fc2.shape)} does not match fc1 {tuple(fc1.shape)}")
        if hidden % 8 or two_ffn % 16:
            raise ValueError(f"torch._grouped_mm needs 16-byte strides: hidden {hidden} and FFN {two_ffn // 2} "
                             "must be multiples of 8")
        self.fc1 = torch.nn.Parameter(fc1.detach().clone())
        self.fc2 = torch.nn.Parameter(fc2.detach().clone())
        self.glu_linear_offset = glu_linear_offset

    @classmethod
    def from_sequential_mlp(cls, experts) -> "GroupedMMExperts":
        """The same weights as Megatron's SequentialMLP `experts` (its local experts, stacked);
        refuses what the peer does not compute (bias, a non-gated or non-SiLU activation, clamping,
        probs applied on the input)."""
        config = experts.config
        unsupported = {
            "add_bias_linear": config.add_bias_linear, "gated_linear_unit": not config.gated_linear_unit,
            "activation_func": config.activation_func is not F.silu,
            "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None) is not None,
            "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
        }
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(f"GroupedMMExperts computes SwiGLU experts without bias only: {', '.join(refused)}")
        fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts.local_experts])
        return cls(fc1, fc2, float(config.glu_linear_offset))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **kwargs):
        """Megatron's experts call: (tokens sorted by local expert, their counts per expert, their
        routing probs) -> (output, None)."""
        if kwargs:
            raise ValueError(f"GroupedMMExperts does not take the experts' extra arguments {sorted(kwargs)}")
        counts = torch.as_tensor(tokens_per_expert).to(tokens.device, non_blocking=True)
        if counts.numel() != self.fc1.shape[0]:
            raise ValueError(f"{counts.numel()} token counts for {self.fc1.shape[0]} experts")
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        fc1_out = torch._grouped_mm(tokens, self.fc1.transpose(1, 2), offs=offs)
        gate, linear = fc1_out.chunk(2, dim=-1)
        # As Megatron's MLP without fused activation: the product in BF16, probs in fp32, then BF16.
        hidden = F.silu(gate) * (linear + self.glu_linear_offset)
        hidden = (hidden * probs.unsqueeze(-1)).to(tokens.dtype)
        return torch._grouped_mm(hidden, self.fc2.transpose(1, 2), offs=offs), None

    def backward_dw(self):
        raise RuntimeError("GroupedMMExperts computes weight gradients in backward (no delayed wgrad)")
