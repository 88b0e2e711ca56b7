"""Tiles read along rows and written transposed, for the quantizers whose FP8 blocks run down the
columns (ragged expert columns, transposed weights).

A tile of 128 rows x 4Q columns is read as four slices: slice k holds rows 4j + k (j < 32). Then
element (j, q) of slice k, component i, is x[4j + k, 4q + i], so the four slices' component i
are four consecutive rows of column 4q + i, and packing their FP8 bytes into one int32 (element
by element, in registers) gives four consecutive bytes of that column in the transposed output.
Loads are 16-byte vectors along rows; each packed store goes through one layout conversion
(shared memory, four bytes per element moved) into 16-byte vectors along the transposed rows.
"""

import triton
import triton.language as tl

from ._bits import abs_max4, load_float_quads


@triton.jit
def load_slice(x_pairs_ptr, rows, row_ok, quad, quad_ok, QUADS_PER_ROW: tl.constexpr, KIND: tl.constexpr):
    """rows [32] x quads [Q] -> four [32, Q] fp32 bit patterns (columns 4q .. 4q + 3); masked
    elements read as +0. row_ok and quad_ok both None: a whole tile, no masks."""
    offsets = rows[:, None].to(tl.int64) * QUADS_PER_ROW + quad[None, :]
    if row_ok is None:
        return load_float_quads(x_pairs_ptr, offsets, None, KIND)
    else:
        return load_float_quads(x_pairs_ptr, offsets, row_ok[:, None] & quad_ok[None, :], KIND)


@triton.jit
def column_abs_max(a, b, c, d):
    """[Q]: per column, the largest |x| bits over four slices' [32, Q] components (one column's 128
    rows)."""
    return tl.max(abs_max4(a, b, c, d), axis=0)


@triton.jit
def store_column_words(out_words_ptr, words, column, column_ok, word_start, row_words):
    """words [32, Q]: four FP8 bytes (rows 4j .. 4j + 3) of column `column` [Q] -> the transposed
    output's int32 row `column`, words word_start + j (row_words int32 per row); column_ok None:
    no mask."""
    offsets = column[None, :].to(tl.int64) * row_words + word_start + tl.arange(0, 32)[:, None]
    if column_ok is None:
        tl.store(out_words_ptr + offsets, words)
    else:
        tl.store(out_words_ptr + offsets, words, mask=column_ok[None, :])
