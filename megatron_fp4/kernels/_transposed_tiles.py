"""Tiles read along rows and written transposed, for the quantizers whose FP8 blocks run down the
columns (ragged expert columns, transposed weights).

A tile of 128 rows x 4Q columns is read as four slices: slice k holds rows 4j + k (j < 32), each
as a [32, Q, 2, 2] tensor whose element [j, q, a, b] is column 4q + a + 2b (join4). The four
slices' elements at one index are then four consecutive rows of one column, and packing their
FP8 bytes into one int32 (elementwise, in registers) gives four consecutive bytes of a row of the
transposed output. Loads are 16-byte vectors along rows; the packed words take one layout
conversion (shared memory, four bytes per element moved) into 16-byte vectors along the
transposed rows, and a column's amax is one reduction over j for all four columns of a quad.
"""

import triton
import triton.language as tl

from ._bits import load_float_quads


@triton.jit
def join4(w0, w1, w2, w3):
    """Four [32, Q] tensors -> [32, Q, 2, 2] with w(a + 2b) at [..., a, b]: new dimensions held
    in registers, no data movement."""
    return tl.join(tl.join(w0, w1), tl.join(w2, w3))


@triton.jit
def quad_columns(quad):
    """Quads [Q] -> [Q, 2, 2] column indices 4q + a + 2b, join4's order."""
    two = tl.arange(0, 2)
    return 4 * quad[:, None, None] + two[None, :, None] + 2 * two[None, None, :]


@triton.jit
def load_slice(x_pairs_ptr, rows, row_ok, quad, quad_ok, QUADS_PER_ROW: tl.constexpr, KIND: tl.constexpr):
    """rows [J] x quads [Q] of a row-major float matrix -> [J, Q, 2, 2] fp32 bit patterns in
    join4's order; masked elements read as +0. A mask of None: nothing masked along it."""
    offsets = rows[:, None].to(tl.int64) * QUADS_PER_ROW + quad[None, :]
    if row_ok is None:
        if quad_ok is None:
            e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, offsets, None, KIND)
        else:
            e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, offsets, quad_ok[None, :], KIND)
    elif quad_ok is None:
        e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, offsets, row_ok[:, None], KIND)
    else:
        e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, offsets, row_ok[:, None] & quad_ok[None, :], KIND)
    return join4(e0, e1, e2, e3)


@triton.jit
def store_column_words(out_words_ptr, words, quad, quad_ok, word_start, row_words):
    """words [J, Q, 2, 2]: four FP8 bytes (rows 4j .. 4j + 3) of column quad_columns(quad) ->
    that int32 row of the transposed output, word word_start + j (row_words int32 per row).
    quad_ok None: no mask."""
    columns = quad_columns(quad)[None, :, :, :].to(tl.int64)
    offsets = columns * row_words + word_start + tl.arange(0, words.shape[0])[:, None, None, None]
    if quad_ok is None:
        tl.store(out_words_ptr + offsets, words)
    else:
        tl.store(out_words_ptr + offsets, words, mask=quad_ok[None, :, None, None])
