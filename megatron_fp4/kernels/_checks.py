"""Input validation shared by the kernel entry points: one clear sentence per refusal."""

import os
from dataclasses import dataclass
from typing import Optional, Tuple

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
    """View a contiguous float matrix as one integer per two elements (see unpack_float_pair). x must
    start aligned to a pair (pairs_ready, quad_ready and readable_at see to it)."""
    return x.view(torch.int64 if x.element_size() == 4 else torch.int32)


def readable_at(x: torch.Tensor, alignment: int) -> torch.Tensor:
    """x, or a contiguous copy of it where it does not start `alignment`-byte aligned: a kernel that
    reads an input as wider words (pairs, quads, 16-byte vectors) needs it to start on such a word, which
    a view into the middle of a buffer (a storage offset of one element, say) may not. A rare path:
    every freshly allocated tensor is aligned, and so is the copy."""
    if x.data_ptr() % alignment or x.storage_offset() * x.element_size() % alignment:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def pairs_ready(x: torch.Tensor) -> torch.Tensor:
    """pair_view of x for kernels that read two elements per integer: x copied first where it starts
    inside a pair (readable_at)."""
    return pair_view(readable_at(x, 2 * x.element_size()))


def quad_ready(x: torch.Tensor) -> torch.Tensor:
    """pair_view of x for kernels that read four elements per int64 (_bits.load_float_quads; fp32 as
    int64 pairs): x must start 8-byte aligned, else it is copied first (readable_at)."""
    return pair_view(readable_at(x, 8))


def check_contiguous(name: str, argument: str, t: torch.Tensor) -> None:
    """Kernels read a tensor of a quantized operand (its data, its block_scales) as one row-major
    buffer: refuse any other strides rather than read the wrong elements."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: {argument} must be contiguous (row-major), got shape {tuple(t.shape)} with "
                         f"strides {t.stride()}; call .contiguous() on it first")


def check_segment_offsets(name: str, argument: str, offsets, entries: int, device: torch.device, end: int, *,
                          exact_end: bool = True, multiple_of: int = 1, same_as: Optional[Tuple[str, object]] = None,
                          on_device: bool = True) -> None:
    """Segment offsets as the kernels read them (where segment e starts and ends: offsets[e],
    offsets[e + 1]). On the host, no sync: an int64 [entries] tensor on `device`, as is same_as's
    (its argument's name, the tensor). With on_device, its values: from 0, never decreasing,
    multiples of `multiple_of`, ending at `end` (exact_end) or at most there, equal to same_as's.
    Those are asserted on the device with torch._assert_async, as the column kernels assert their
    counts (_segments.check_segments): no host sync; on the CPU it raises at once, on a GPU it is a
    device-side assert that stops every launch after it (the kernel that would have read the offsets
    among them) and surfaces as a CUDA error at the next synchronization. A caller whose offsets are
    right by construction (built on the host from counts it checked there, as
    fp8.segments.TokenSegments builds them) may pass on_device=False and save a few small launches."""
    for what, tensor in ((argument, offsets),) + ((same_as,) if same_as is not None else ()):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.int64 or tuple(tensor.shape) != (entries,) or tensor.device != device:
            raise ValueError(f"{name}: {what} must be int64 [{entries}] on {device}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)} on {tensor.device}")
    if entries == 0:
        raise ValueError(f"{name}: {argument} is empty: it needs one entry per segment and one more")
    if not on_device:
        return
    ok = (offsets.diff() >= 0).all() & (offsets[0] == 0) & ((offsets[-1] == end) if exact_end else (offsets[-1] <= end))
    rules = f"start at 0, never decrease and end {'at' if exact_end else 'at or before'} {end}"
    if multiple_of > 1:
        ok &= (offsets % multiple_of == 0).all()
        rules = f"be multiples of {multiple_of}, " + rules
    if same_as is not None:
        rules += f", equal to {same_as[0]}"
        if same_as[1] is not offsets:
            ok &= (offsets == same_as[1]).all()
    torch._assert_async(ok, f"{name}: {argument} must {rules}")


def float_kind(dtype: torch.dtype) -> int:
    """The KIND constexpr of _bits.unpack_float_pair."""
    return {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[dtype]
