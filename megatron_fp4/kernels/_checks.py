"""Input validation shared by the kernel entry points: one clear sentence per refusal."""

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..formats import FLOAT_INPUT_DTYPES


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of a kernel: rows per program, blocks (of the kernel's own unit) per
    program along the last dimension, and warps per program."""

    block_rows: int
    block_cols: int
    num_warps: int


def launch_config(config: Optional[TileConfig], device: torch.device, on_gpu: TileConfig,
                  interpreted: TileConfig) -> TileConfig:
    """The tile config of a launch: the caller's; else `on_gpu` (the fastest measured) on a GPU, and
    `interpreted` under Triton's CPU interpreter, whose cost is per program and per pass rather than
    per element (one pass, few programs; not necessarily a GPU candidate). tests/ops runs every
    candidate and the interpreter's config under the interpreter, so CI checks the GPU's bit for bit."""
    if config is not None:
        return config
    return on_gpu if device.type == "cuda" else interpreted


def check_rows_per_pass(name: str, rows_per_pass: int, block: int) -> None:
    """A two-pass tile config reads a block of `block` rows in passes of rows_per_pass: a power of
    two from 16 up to the block (a pass is four slices of whole 4-row groups, and a partial last
    pass would write past its block)."""
    if rows_per_pass < 16 or rows_per_pass > block or block % rows_per_pass or rows_per_pass & (rows_per_pass - 1):
        raise ValueError(f"{name}: config.block_rows {rows_per_pass} must be a power of two from 16 to {block}")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    raise RuntimeError(
        f"{name}: the Triton kernels need a CUDA tensor, got one on {t.device} "
        "(set TRITON_INTERPRET=1 to run them on the CPU, or use megatron_fp4.reference)"
    )


def check_float_matrix(name: str, x: torch.Tensor, multiple_of: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name}: input dtype must be one of {FLOAT_INPUT_DTYPES}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: input must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if x.shape[1] == 0 or x.shape[1] % multiple_of:
        raise ValueError(f"{name}: hidden size {x.shape[1]} must be a positive multiple of {multiple_of}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: input must be contiguous (call .contiguous() first)")
    check_kernel_device(name, x)


def check_hidden_multiple(name: str, hidden: int, multiple_of: int) -> None:
    if hidden % multiple_of:
        raise ValueError(f"{name}: hidden size {hidden} must be a multiple of {multiple_of}")


def pair_view(x: torch.Tensor) -> torch.Tensor:
    """View a contiguous float matrix as one integer per two elements (see unpack_float_pair)."""
    return x.view(torch.int64 if x.element_size() == 4 else torch.int32)


def quad_ready(x: torch.Tensor) -> torch.Tensor:
    """pair_view of x for kernels that read four elements per int64 (_bits.load_float_quads): a
    16-bit input must start 8-byte aligned, which a view into the middle of a buffer may not; such
    an input is copied (a rare path: every freshly allocated tensor is aligned)."""
    if x.element_size() == 2 and x.data_ptr() % 8:
        x = x.clone()
    return pair_view(x)


def float_kind(dtype: torch.dtype) -> int:
    """The KIND constexpr of _bits.unpack_float_pair."""
    return {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[dtype]
