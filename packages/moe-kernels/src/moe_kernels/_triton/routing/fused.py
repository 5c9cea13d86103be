"""A and C in one cooperative launch: A's body, a grid barrier, C's body (``grid_sync``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid_sync import grid_sync
from .place import COLUMNS, place_kernel
from .topk_columns import topk_columns_kernel
from .topk_rows import topk_rows_kernel


@triton.jit
def fused_kernel(
    # pointers first (a bound relaunch computes them in one pass), then the ints
    x_ptr, vtc_ptr,
    bar_ptr,  # this stream's grid_sync words
    pack_ptr, a_w_ptr,  # a_w_ptr: kernel A's scr_w_ptr
    hist_ptr, scr_w_ptr, inverse_ptr, counts_ptr, expert_ptr, token_ptr, weight_ptr, offsets_ptr,
    tcpe_ptr, stride_t, stride_e, stride_w, T, E, L, start, end, n_programs,
    # topk_rows_kernel's constexprs, then topk_columns_kernel's others (dummies for the other A)
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, L_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr, SUB: tl.constexpr, KIND: tl.constexpr, HAS_VTC: tl.constexpr,
    WEIGHTS: tl.constexpr, RENORM: tl.constexpr, EVEN_E: tl.constexpr, FULL_RANGE: tl.constexpr,
    SENT: tl.constexpr, RANKS: tl.constexpr, HB: tl.constexpr, OLD_INTERP: tl.constexpr,
    INSERT: tl.constexpr, W: tl.constexpr, FKEY: tl.constexpr, MERGE: tl.constexpr,
    PACK_W: tl.constexpr, TP: tl.constexpr, MODE: tl.constexpr,
    # place_kernel's others
    L_PAD: tl.constexpr, NP_PAD: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    CHUNK_T: tl.constexpr, FUSE_SCAN: tl.constexpr, WHILE_LOOPS: tl.constexpr,
    PLACE: tl.constexpr, IDX_BITS: tl.constexpr, IS_BF16: tl.constexpr,
    NW: tl.constexpr, TOK_BITS: tl.constexpr, RUNS: tl.constexpr,
):  # fmt: skip
    """Each program runs kernel A's body for its tokens, waits at a grid barrier until every
    program's ``hist`` column and pairs are written, then runs kernel C's body (which reduces
    the whole ``hist`` itself: FUSE_SCAN). The same code as the two launches, so the same
    results. Only for grids that fit on the GPU at once, launched cooperatively."""
    if PLACE == COLUMNS:
        topk_columns_kernel(
            x_ptr, stride_t, stride_e, stride_w, vtc_ptr, pack_ptr, a_w_ptr, hist_ptr, T, E,
            start, end, n_programs, K, E_PAD, TP, HAS_VTC, FULL_RANGE, MODE, WEIGHTS,
        )  # fmt: skip
    else:
        topk_rows_kernel(
            x_ptr, stride_t, stride_e, stride_w, vtc_ptr, pack_ptr, a_w_ptr, hist_ptr, T, E,
            start, end, n_programs, K, K_PAD, E_PAD, L_BITS, BLOCK_T, SUB, KIND, HAS_VTC,
            WEIGHTS, RENORM, EVEN_E, FULL_RANGE, SENT, RANKS, HB, OLD_INTERP, INSERT, W, FKEY,
            MERGE, PACK_W,
        )  # fmt: skip
    grid_sync(bar_ptr, n_programs)
    place_kernel(
        pack_ptr, scr_w_ptr, inverse_ptr, hist_ptr, counts_ptr, expert_ptr, token_ptr,
        weight_ptr, offsets_ptr, tcpe_ptr, T, E, L, start, n_programs, K, K_PAD, L_PAD, L_BITS,
        NP_PAD, TOK_PER_PROG, CHUNK_T, FUSE_SCAN, WEIGHTS, WHILE_LOOPS, PLACE, IDX_BITS, PACK_W,
        IS_BF16, NW, TOK_BITS, RUNS,
    )  # fmt: skip
