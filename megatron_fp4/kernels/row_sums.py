"""Sums of rows grouped by token, without atomics: the unpermute of an MoE layer (each token's
output is the sum of its experts' rows) and the gradient of its permute (each token's gradient is
the sum of its copies' gradients).

A program takes a block of tokens (one on the GPU) and a slice of the hidden dimension and reads
each token's rows in ascending position order (a CSR table: `order` lists the positions grouped by token, `offsets` where each
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
# On the GPU one token and 1024 columns a program (16-byte loads for 4 warps of BF16). Under the
# interpreter the cost is per program and per operation, not per element: 256 tokens and up to 4096
# columns a program, stepping through their rows together (masked where a token has fewer).
BLOCK_TOKENS_GPU, BLOCK_HIDDEN_GPU = 1, 1024
BLOCK_TOKENS_INTERPRETED, BLOCK_HIDDEN_INTERPRETED = 256, 4096


@triton.jit
def _sum_rows_by_token_kernel(rows_ptr, order_ptr, offsets_ptr, out_ptr, num_tokens, hidden,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_token, in_row = tokens < num_tokens, cols < hidden
    start = tl.load(offsets_ptr + tokens, mask=is_token, other=0)
    count = tl.load(offsets_ptr + tokens + 1, mask=is_token, other=0) - start
    # A token without a j-th row adds +0.0, which leaves every sum's bits as they are (an fp32 sum
    # started at +0.0 is never -0.0).
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(tl.max(count, axis=0)):
        has_row = j < count
        row = tl.load(order_ptr + start + j, mask=has_row, other=0)
        acc += tl.load(rows_ptr + row[:, None] * hidden + cols[None, :], mask=has_row[:, None] & in_row[None, :],
                       other=0.0).to(tl.float32)
    out = out_ptr + tokens[:, None].to(tl.int64) * hidden + cols[None, :]
    store_rounded(out, acc, is_token[:, None] & in_row[None, :], OUT_BF16)


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
    interpreted = interpreter_enabled()
    block_t = BLOCK_TOKENS_INTERPRETED if interpreted else BLOCK_TOKENS_GPU
    block_h = min(BLOCK_HIDDEN_INTERPRETED if interpreted else BLOCK_HIDDEN_GPU, triton.next_power_of_2(hidden))
    out_bf16 = rows.dtype == torch.bfloat16
    _sum_rows_by_token_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))](
        rows, order, offsets, out.view(torch.int16) if out_bf16 else out, num_tokens, hidden, BLOCK_T=block_t,
        BLOCK_H=block_h, OUT_BF16=out_bf16, num_warps=4,
    )
    return out



def sm90_specs(variant) -> list:
    """The kernel at the variant's hidden size on BF16 rows, as sm90_build compiles it."""
    from ._sm90_spec import KernelSpec

    return [KernelSpec("sum_rows_by_token", _sum_rows_by_token_kernel,
                       {"rows_ptr": "*bf16", "order_ptr": "*i64", "offsets_ptr": "*i64", "out_ptr": "*i16",
                        "num_tokens": "i32", "hidden": "i32"},
                       {"BLOCK_T": BLOCK_TOKENS_GPU, "BLOCK_H": BLOCK_HIDDEN_GPU, "OUT_BF16": True}, 4,
                       BLOCK_TOKENS_GPU * BLOCK_HIDDEN_GPU)]


__all__ = ["sum_rows_by_token"]
