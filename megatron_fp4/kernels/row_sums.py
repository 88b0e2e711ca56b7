"""Sums of rows grouped by token, without atomics: the unpermute of an MoE layer (each token's
output is the sum of its experts' rows) and the gradient of its permute (each token's gradient is
the sum of its copies' gradients).

One program per token and slice of the hidden dimension reads that token's rows in ascending
position order (a CSR table: `order` lists the positions grouped by token, `offsets` where each
token's run starts), adds them in fp32 and rounds once. The sums are deterministic and at least as
accurate as Megatron's unfused path, which adds the rows into a BF16 output with atomics in an order
the GPU picks (scatter_add_ forward, index_add_ for the permute's gradient).
"""

import torch
import triton
import triton.language as tl

from ._bits import store_rounded
from ._checks import check_kernel_device, interpreter_enabled

SUMMED_DTYPES = (torch.bfloat16, torch.float32)
# 16-byte loads for 4 warps of BF16 (8 values a thread); under the interpreter the cost is per
# program, so one program spans the whole width of the tests' rows.
BLOCK_HIDDEN_GPU = 1024
BLOCK_HIDDEN_INTERPRETED = 4096


@triton.jit
def _sum_rows_by_token_kernel(rows_ptr, order_ptr, offsets_ptr, out_ptr, hidden, BLOCK_H: tl.constexpr,
                              OUT_BF16: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    start = tl.load(offsets_ptr + token)
    end = tl.load(offsets_ptr + token + 1)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for i in range(start, end):
        row = tl.load(order_ptr + i)
        acc += tl.load(rows_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    store_rounded(out_ptr + token.to(tl.int64) * hidden + cols, acc, in_row, OUT_BF16)


def sum_rows_by_token(rows: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[T, H]: out[t] = the sum, in fp32 rounded once to rows' dtype, of rows[order[i]] for i in
    [offsets[t], offsets[t + 1]) in that order; 0 for a token without rows. rows: [P, H] BF16 or
    fp32; order: int64 [P'] of row positions (P' <= P; rows not listed are left out); offsets:
    int64 [T + 1], non-decreasing from 0 to P'."""
    name = "sum_rows_by_token"
    check_kernel_device(name, rows)
    if rows.dim() != 2 or rows.dtype not in SUMMED_DTYPES:
        raise ValueError(f"{name}: rows must be a 2-D tensor of {SUMMED_DTYPES}, got {rows.dtype} {tuple(rows.shape)}")
    for index_name, index in (("order", order), ("offsets", offsets)):
        if index.dtype != torch.int64 or index.dim() != 1 or index.device != rows.device:
            raise ValueError(f"{name}: {index_name} must be 1-D int64 on {rows.device}, got {index.dtype} "
                             f"{tuple(index.shape)} on {index.device}")
    if offsets.numel() == 0:
        raise ValueError(f"{name}: offsets needs T + 1 entries, got none")
    rows = rows.contiguous()
    num_tokens, hidden = offsets.numel() - 1, rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    if num_tokens == 0 or hidden == 0:
        return out
    block = BLOCK_HIDDEN_INTERPRETED if interpreter_enabled() else BLOCK_HIDDEN_GPU
    block = min(block, triton.next_power_of_2(hidden))
    out_bf16 = rows.dtype == torch.bfloat16
    _sum_rows_by_token_kernel[(num_tokens, triton.cdiv(hidden, block))](
        rows, order, offsets, out.view(torch.int16) if out_bf16 else out, hidden, BLOCK_H=block, OUT_BF16=out_bf16,
        num_warps=4,
    )
    return out



def sm90_specs(variant) -> list:
    """The kernel at the variant's hidden size on BF16 rows, as sm90_build compiles it."""
    from ._sm90_spec import KernelSpec

    return [KernelSpec("sum_rows_by_token", _sum_rows_by_token_kernel,
                       {"rows_ptr": "*bf16", "order_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": "*i16",
                        "hidden": "i32"},
                       {"BLOCK_H": BLOCK_HIDDEN_GPU, "OUT_BF16": True}, 4, BLOCK_HIDDEN_GPU)]


__all__ = ["sum_rows_by_token"]
