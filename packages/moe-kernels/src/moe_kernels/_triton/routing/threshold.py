"""Top-k by threshold over packed 16-bit pairs (the ``columns`` plan's first step).

One row a thread, its 64 or 128 scores read as int32 words of two: the K-th largest value by the
sort-and-merge network run on both halves of every word at once (one PTX instruction per
compare-exchange pair), then bitmasks of the experts above and equal to it; the equal ones are
trimmed to the lowest experts K needs (``keep_lowest``: ties to the lower expert).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import popc
from .networks import h2_nan_to_ninf, h2_op, merge8, take8


@triton.jit
def _interleave_halves(x):
    """Bit i of the low half to bit 2i, bit i of the high half to bit 2i + 1 (int32)."""
    x = (x & -16776961) | ((x >> 8) & 0x0000FF00) | ((x & 0x0000FF00) << 8)  # keep 0xFF0000FF
    x = (x & -267390961) | ((x >> 4) & 0x00F000F0) | ((x & 0x00F000F0) << 4)  # keep 0xF00FF00F
    x = (x & -1010580541) | ((x >> 2) & 0x0C0C0C0C) | ((x & 0x0C0C0C0C) << 2)  # keep 0xC3C3C3C3
    return (x & -1717986919) | ((x >> 1) & 0x22222222) | ((x & 0x22222222) << 1)  # 0x99999999


@triton.jit
def _load8w(xw_ptr, roff, row_ok, g: tl.constexpr, MODE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Words 8g .. 8g+7 of each row (16 scores, two 16-byte loads), NaN -> -inf: 8 columns."""
    cols = g * 8 + tl.arange(0, 4)
    a = tl.load(xw_ptr + roff[:, None] + cols[None, :], mask=row_ok[:, None], other=0)
    b = tl.load(xw_ptr + roff[:, None] + 4 + cols[None, :], mask=row_ok[:, None], other=0)
    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_T, 2, 2]))  # words (0, 2), (1, 3)
    w0, w2 = tl.split(a_even)
    w1, w3 = tl.split(a_odd)
    b_even, b_odd = tl.split(tl.reshape(b, [BLOCK_T, 2, 2]))
    w4, w6 = tl.split(b_even)
    w5, w7 = tl.split(b_odd)
    return (
        h2_nan_to_ninf(w0, MODE), h2_nan_to_ninf(w1, MODE), h2_nan_to_ninf(w2, MODE),
        h2_nan_to_ninf(w3, MODE), h2_nan_to_ninf(w4, MODE), h2_nan_to_ninf(w5, MODE),
        h2_nan_to_ninf(w6, MODE), h2_nan_to_ninf(w7, MODE),
    )  # fmt: skip


@triton.jit
def _cmp8(gt, eq, w0, w1, w2, w3, w4, w5, w6, w7, v, SH: tl.constexpr, MODE: tl.constexpr):
    """Words at positions SH .. SH+7 of a 16-word run against the threshold pair ``v``: their
    halves' ``>`` and ``==`` bits into gt / eq (low half at bit SH + i, high half 16 higher)."""
    m = tl.full([1], 0x00010001, tl.int32)  # shifted as int32 (bit 31 is the sign)
    gt |= h2_op(w0, v, 2, MODE) & (m << SH)
    eq |= h2_op(w0, v, 3, MODE) & (m << SH)
    gt |= h2_op(w1, v, 2, MODE) & (m << (SH + 1))
    eq |= h2_op(w1, v, 3, MODE) & (m << (SH + 1))
    gt |= h2_op(w2, v, 2, MODE) & (m << (SH + 2))
    eq |= h2_op(w2, v, 3, MODE) & (m << (SH + 2))
    gt |= h2_op(w3, v, 2, MODE) & (m << (SH + 3))
    eq |= h2_op(w3, v, 3, MODE) & (m << (SH + 3))
    gt |= h2_op(w4, v, 2, MODE) & (m << (SH + 4))
    eq |= h2_op(w4, v, 3, MODE) & (m << (SH + 4))
    gt |= h2_op(w5, v, 2, MODE) & (m << (SH + 5))
    eq |= h2_op(w5, v, 3, MODE) & (m << (SH + 5))
    gt |= h2_op(w6, v, 2, MODE) & (m << (SH + 6))
    eq |= h2_op(w6, v, 3, MODE) & (m << (SH + 6))
    gt |= h2_op(w7, v, 2, MODE) & (m << (SH + 7))
    eq |= h2_op(w7, v, 3, MODE) & (m << (SH + 7))
    return gt, eq


@triton.jit
def threshold_masks(
    x_ptr, rows64, row_ok, stride_w, K: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """Top-K (<= 8) experts of each row of 64 or 128 16-bit scores, read as int32 words of two
    (``stride_w``: words per row), one row per thread, all of it in registers.

    1. The K-th largest value: both halves of every word go through the packed sort-and-merge
       network at once (``_sort8`` / ``merge8`` on ``h2_op``: one instruction does two
       compare-exchange halves), keeping the 8 largest even and the 8 largest odd experts; one
       merge of the two lists gives the row's 8 largest values.
    2. Bitmasks of the experts above it and equal to it (packed compares). Taking the equal ones
       lowest expert first, as many as K needs, breaks ties to the lower expert; NaN is -inf and
       -0.0 equals +0.0, as in the float comparisons.
    -> 128-bit masks (4 int32 words, bit i of word m: expert 32m + i; words 2, 3 zero for 64
    experts) of the experts above the threshold and of those equal to it, and the count above
    (< K); ``keep_lowest`` then takes the equal ones needed."""
    ASM: tl.constexpr = MODE <= 3
    xw = x_ptr.to(tl.pointer_type(tl.int32))
    roff = rows64 * stride_w
    t0 = tl.full([BLOCK_T], -8323200 if MODE % 2 == 0 else -67044352, tl.int32)  # -inf pairs
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    t6 = t0
    t7 = t0
    a0, a1, a2, a3, a4, a5, a6, a7 = _load8w(xw, roff, row_ok, 0, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = take8(
        t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7, MODE
    )
    b0, b1, b2, b3, b4, b5, b6, b7 = _load8w(xw, roff, row_ok, 1, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = take8(
        t0, t1, t2, t3, t4, t5, t6, t7, b0, b1, b2, b3, b4, b5, b6, b7, MODE
    )
    d0, d1, d2, d3, d4, d5, d6, d7 = _load8w(xw, roff, row_ok, 2, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = take8(
        t0, t1, t2, t3, t4, t5, t6, t7, d0, d1, d2, d3, d4, d5, d6, d7, MODE
    )
    f0, f1, f2, f3, f4, f5, f6, f7 = _load8w(xw, roff, row_ok, 3, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = take8(
        t0, t1, t2, t3, t4, t5, t6, t7, f0, f1, f2, f3, f4, f5, f6, f7, MODE
    )
    if E_PAD == 128:
        g0, g1, g2, g3, g4, g5, g6, g7 = _load8w(xw, roff, row_ok, 4, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = take8(
            t0, t1, t2, t3, t4, t5, t6, t7, g0, g1, g2, g3, g4, g5, g6, g7, MODE
        )
        h0, h1, h2, h3, h4, h5, h6, h7 = _load8w(xw, roff, row_ok, 5, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = take8(
            t0, t1, t2, t3, t4, t5, t6, t7, h0, h1, h2, h3, h4, h5, h6, h7, MODE
        )
        i0, i1, i2, i3, i4, i5, i6, i7 = _load8w(xw, roff, row_ok, 6, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = take8(
            t0, t1, t2, t3, t4, t5, t6, t7, i0, i1, i2, i3, i4, i5, i6, i7, MODE
        )
        j0, j1, j2, j3, j4, j5, j6, j7 = _load8w(xw, roff, row_ok, 7, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = take8(
            t0, t1, t2, t3, t4, t5, t6, t7, j0, j1, j2, j3, j4, j5, j6, j7, MODE
        )
    # Even and odd experts' lists (low / high halves) -> the row's 8 largest, in both halves.
    c0 = ((t0 >> 16) & 0xFFFF) | (t0 << 16)
    c1 = ((t1 >> 16) & 0xFFFF) | (t1 << 16)
    c2 = ((t2 >> 16) & 0xFFFF) | (t2 << 16)
    c3 = ((t3 >> 16) & 0xFFFF) | (t3 << 16)
    c4 = ((t4 >> 16) & 0xFFFF) | (t4 << 16)
    c5 = ((t5 >> 16) & 0xFFFF) | (t5 << 16)
    c6 = ((t6 >> 16) & 0xFFFF) | (t6 << 16)
    c7 = ((t7 >> 16) & 0xFFFF) | (t7 << 16)
    t0, t1, t2, t3, t4, t5, t6, t7 = merge8(t0, t1, t2, t3, t4, t5, t6, t7,
                                             c0, c1, c2, c3, c4, c5, c6, c7, MODE)  # fmt: skip
    v = t0
    if K == 2:
        v = t1
    elif K == 3:
        v = t2
    elif K == 4:
        v = t3
    elif K == 5:
        v = t4
    elif K == 6:
        v = t5
    elif K == 7:
        v = t6
    elif K == 8:
        v = t7
    zero = tl.zeros([BLOCK_T], tl.int32)
    gt0, eq0 = _cmp8(zero, zero, a0, a1, a2, a3, a4, a5, a6, a7, v, 0, MODE)
    gt0, eq0 = _cmp8(gt0, eq0, b0, b1, b2, b3, b4, b5, b6, b7, v, 8, MODE)
    gt1, eq1 = _cmp8(zero, zero, d0, d1, d2, d3, d4, d5, d6, d7, v, 0, MODE)
    gt1, eq1 = _cmp8(gt1, eq1, f0, f1, f2, f3, f4, f5, f6, f7, v, 8, MODE)
    gt2 = zero
    eq2 = zero
    gt3 = zero
    eq3 = zero
    if E_PAD == 128:
        gt2, eq2 = _cmp8(gt2, eq2, g0, g1, g2, g3, g4, g5, g6, g7, v, 0, MODE)
        gt2, eq2 = _cmp8(gt2, eq2, h0, h1, h2, h3, h4, h5, h6, h7, v, 8, MODE)
        gt3, eq3 = _cmp8(gt3, eq3, i0, i1, i2, i3, i4, i5, i6, i7, v, 0, MODE)
        gt3, eq3 = _cmp8(gt3, eq3, j0, j1, j2, j3, j4, j5, j6, j7, v, 8, MODE)
    gt0 = _interleave_halves(gt0)  # bit i: expert 32 * word + i
    gt1 = _interleave_halves(gt1)
    gt2 = _interleave_halves(gt2)
    gt3 = _interleave_halves(gt3)
    eq0 = _interleave_halves(eq0)
    eq1 = _interleave_halves(eq1)
    eq2 = _interleave_halves(eq2)
    eq3 = _interleave_halves(eq3)
    n_gt = popc(gt0, ASM) + popc(gt1, ASM) + popc(gt2, ASM) + popc(gt3, ASM)
    return gt0, gt1, gt2, gt3, eq0, eq1, eq2, eq3, n_gt


@triton.jit
def _select_bit(x, r, ASM: tl.constexpr):
    """Position of the r-th (from 0) set bit of each int32 x (r < popcount(x))."""
    pos = tl.zeros(x.shape, tl.int32)
    for b in tl.static_range(5):
        s = 16 >> b
        c = popc(x & ((1 << s) - 1), ASM)
        go = r >= c
        r = tl.where(go, r - c, r)
        x = tl.where(go, x >> s, x)
        pos += tl.where(go, s, 0)
    return pos


@triton.jit
def keep_lowest(q0, q1, q2, q3, need, ASM: tl.constexpr):
    """The lowest ``need`` (>= 1, at most the count) set bits of the 128-bit (q0, .., q3)."""
    c0 = popc(q0, ASM)
    c1 = popc(q1, ASM)
    c2 = popc(q2, ASM)
    r = need - 1  # index of the last bit kept
    w = tl.where(r < c0, 0, tl.where(r < c0 + c1, 1, tl.where(r < c0 + c1 + c2, 2, 3)))
    r -= tl.where(w > 0, c0, 0) + tl.where(w > 1, c1, 0) + tl.where(w > 2, c2, 0)
    x = tl.where(w == 0, q0, tl.where(w == 1, q1, tl.where(w == 2, q2, q3)))
    p = _select_bit(x, r, ASM)
    low = tl.where(p == 31, -1, (2 << p) - 1)  # bits 0 .. p
    q0 = tl.where(w > 0, q0, tl.where(w == 0, q0 & low, 0))
    q1 = tl.where(w > 1, q1, tl.where(w == 1, q1 & low, 0))
    q2 = tl.where(w > 2, q2, tl.where(w == 2, q2 & low, 0))
    q3 = tl.where(w == 3, q3 & low, 0)
    return q0, q1, q2, q3
