"""Compare-exchange networks on registers: insertion into a running top-8, Batcher's sort of 8,
a bitonic merge of two sorted 8s.

``MODE`` of a compare-exchange: 0 integer keys, 1 exact-integer fp32 keys (``keys.score_fkeys``:
min as two adds on the FMA pipes), 2 / 3 packed bf16x2 / fp16x2 words by inline PTX (both halves
at once), 4 / 5 the same emulated in fp32 for the interpreter (which runs no inline assembly).
Packed max/min need NaN gone first (``h2_nan_to_ninf``).
"""

from __future__ import annotations

import triton
import triton.language as tl


# runs no inline assembly). max/min need NaN gone first (``h2_nan_to_ninf``).
@triton.jit
def _h2_unpack(w, IS_BF16: tl.constexpr):
    """Words -> (low, high) halves as fp32 values."""
    lo = w & 0xFFFF
    hi = (w >> 16) & 0xFFFF
    if IS_BF16:
        return (lo << 16).to(tl.float32, bitcast=True), (hi << 16).to(tl.float32, bitcast=True)
    else:
        lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_pack(lo, hi, IS_BF16: tl.constexpr):
    """(low, high) fp32 values exactly representable in bf16 / fp16 -> words."""
    if IS_BF16:
        lo_b = (lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        return lo_b | (hi.to(tl.int32, bitcast=True) & -65536)
    else:
        lo_b = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo_b | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_asm(a, b, OP: tl.constexpr, IS_BF16: tl.constexpr):
    """One packed PTX op per word: OP 0 max, 1 min, 2 a > b, 3 a == b (0xFFFF / 0 a half)."""
    if IS_BF16:
        if OP == 0:
            asm: tl.constexpr = "max.bf16x2 $0, $1, $2;"
        elif OP == 1:
            asm: tl.constexpr = "min.bf16x2 $0, $1, $2;"
        elif OP == 2:
            asm: tl.constexpr = "set.gt.u32.bf16x2 $0, $1, $2;"
        else:
            asm: tl.constexpr = "set.eq.u32.bf16x2 $0, $1, $2;"
    else:
        if OP == 0:
            asm: tl.constexpr = "max.f16x2 $0, $1, $2;"
        elif OP == 1:
            asm: tl.constexpr = "min.f16x2 $0, $1, $2;"
        elif OP == 2:
            asm: tl.constexpr = "set.gt.u32.f16x2 $0, $1, $2;"
        else:
            asm: tl.constexpr = "set.eq.u32.f16x2 $0, $1, $2;"
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def h2_op(a, b, OP: tl.constexpr, MODE: tl.constexpr):
    """``_h2_asm``'s ops for MODE 2-5 (see above)."""
    if MODE <= 3:
        return _h2_asm(a, b, OP, MODE == 2)
    else:
        alo, ahi = _h2_unpack(a, MODE == 4)
        blo, bhi = _h2_unpack(b, MODE == 4)
        if OP == 0:
            return _h2_pack(tl.maximum(alo, blo), tl.maximum(ahi, bhi), MODE == 4)
        elif OP == 1:
            return _h2_pack(tl.minimum(alo, blo), tl.minimum(ahi, bhi), MODE == 4)
        elif OP == 2:
            return tl.where(alo > blo, 0xFFFF, 0) | tl.where(ahi > bhi, -65536, 0)
        else:
            return tl.where(alo == blo, 0xFFFF, 0) | tl.where(ahi == bhi, -65536, 0)


@triton.jit
def h2_nan_to_ninf(w, MODE: tl.constexpr):
    """NaN halves -> -inf (max with -inf returns the other operand on the GPU)."""
    ninf = -8323200 if MODE % 2 == 0 else -67044352  # 0xFF80FF80 (bf16) / 0xFC00FC00 (fp16)
    if MODE <= 3:
        return _h2_asm(w, tl.full(w.shape, ninf, tl.int32), 0, MODE == 2)
    else:
        lo, hi = _h2_unpack(w, MODE == 4)
        lo = tl.where(lo != lo, float("-inf"), lo)
        return _h2_pack(lo, tl.where(hi != hi, float("-inf"), hi), MODE == 4)


@triton.jit
def _max(a, b, MODE: tl.constexpr):
    if MODE >= 2:
        return h2_op(a, b, 0, MODE)
    else:
        return tl.maximum(a, b)


@triton.jit
def _ce(a, b, MODE: tl.constexpr):
    """Compare-exchange -> (max, min). MODE 0 (False): integer keys; 1 (True, ``FKEY``):
    exact-integer fp32 keys, min by two adds (the FMA pipes) instead of a second min/max (the
    ALU pipe, half as wide); 2-5: both halves of packed 16-bit words (``h2_op``)."""
    if MODE >= 2:
        return h2_op(a, b, 0, MODE), h2_op(a, b, 1, MODE)
    hi = tl.maximum(a, b)
    if MODE:
        return hi, a + (b - hi)
    else:
        return hi, tl.minimum(a, b)


@triton.jit
def _insert(t0, t1, t2, t3, t4, t5, t6, t7, c, K_PAD: tl.constexpr, FKEY: tl.constexpr):
    """Insert key c into the descending list t0 >= t1 >= ... (the first K_PAD are used)."""
    t0, c = _ce(t0, c, FKEY)
    if K_PAD > 1:
        t1, c = _ce(t1, c, FKEY)
    if K_PAD > 2:
        t2, c = _ce(t2, c, FKEY)
        t3, c = _ce(t3, c, FKEY)
    if K_PAD > 4:
        t4, c = _ce(t4, c, FKEY)
        t5, c = _ce(t5, c, FKEY)
        t6, c = _ce(t6, c, FKEY)
        t7 = tl.maximum(t7, c)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def insert4(t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD: tl.constexpr,
             FKEY: tl.constexpr):  # fmt: skip
    """Insert four keys (``_insert``)."""
    t0, t1, t2, t3, t4, t5, t6, t7 = _insert(t0, t1, t2, t3, t4, t5, t6, t7, k0, K_PAD, FKEY)
    t0, t1, t2, t3, t4, t5, t6, t7 = _insert(t0, t1, t2, t3, t4, t5, t6, t7, k1, K_PAD, FKEY)
    t0, t1, t2, t3, t4, t5, t6, t7 = _insert(t0, t1, t2, t3, t4, t5, t6, t7, k2, K_PAD, FKEY)
    return _insert(t0, t1, t2, t3, t4, t5, t6, t7, k3, K_PAD, FKEY)


@triton.jit
def _sort8(c0, c1, c2, c3, c4, c5, c6, c7, FKEY: tl.constexpr):
    """Batcher's odd-even merge sort of 8 keys, descending (19 compare-exchanges)."""
    c0, c1 = _ce(c0, c1, FKEY)
    c2, c3 = _ce(c2, c3, FKEY)
    c4, c5 = _ce(c4, c5, FKEY)
    c6, c7 = _ce(c6, c7, FKEY)
    c0, c2 = _ce(c0, c2, FKEY)
    c1, c3 = _ce(c1, c3, FKEY)
    c4, c6 = _ce(c4, c6, FKEY)
    c5, c7 = _ce(c5, c7, FKEY)
    c1, c2 = _ce(c1, c2, FKEY)
    c5, c6 = _ce(c5, c6, FKEY)
    c0, c4 = _ce(c0, c4, FKEY)
    c1, c5 = _ce(c1, c5, FKEY)
    c2, c6 = _ce(c2, c6, FKEY)
    c3, c7 = _ce(c3, c7, FKEY)
    c2, c4 = _ce(c2, c4, FKEY)
    c3, c5 = _ce(c3, c5, FKEY)
    c1, c2 = _ce(c1, c2, FKEY)
    c3, c4 = _ce(c3, c4, FKEY)
    c5, c6 = _ce(c5, c6, FKEY)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def merge8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, FKEY: tl.constexpr):
    """The 8 largest of two descending lists of 8, descending: elementwise maxima of t and
    reversed c form a bitonic sequence holding them, then a bitonic merge (12 exchanges)."""
    t0 = _max(t0, c7, FKEY)
    t1 = _max(t1, c6, FKEY)
    t2 = _max(t2, c5, FKEY)
    t3 = _max(t3, c4, FKEY)
    t4 = _max(t4, c3, FKEY)
    t5 = _max(t5, c2, FKEY)
    t6 = _max(t6, c1, FKEY)
    t7 = _max(t7, c0, FKEY)
    t0, t4 = _ce(t0, t4, FKEY)
    t1, t5 = _ce(t1, t5, FKEY)
    t2, t6 = _ce(t2, t6, FKEY)
    t3, t7 = _ce(t3, t7, FKEY)
    t0, t2 = _ce(t0, t2, FKEY)
    t1, t3 = _ce(t1, t3, FKEY)
    t4, t6 = _ce(t4, t6, FKEY)
    t5, t7 = _ce(t5, t7, FKEY)
    t0, t1 = _ce(t0, t1, FKEY)
    t2, t3 = _ce(t2, t3, FKEY)
    t4, t5 = _ce(t4, t5, FKEY)
    t6, t7 = _ce(t6, t7, FKEY)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def take8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, MODE: tl.constexpr):
    """The 8 largest of the running descending list t and 8 new keys c (``_sort8``, ``merge8``)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _sort8(c0, c1, c2, c3, c4, c5, c6, c7, MODE)
    return merge8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, MODE)


@triton.jit
def split8(key, BLOCK_T: tl.constexpr):
    """(BLOCK_T, 8) -> its 8 columns."""
    a, b = tl.split(tl.reshape(key, [BLOCK_T, 4, 2]))
    a0, a1 = tl.split(tl.reshape(a, [BLOCK_T, 2, 2]))
    b0, b1 = tl.split(tl.reshape(b, [BLOCK_T, 2, 2]))
    c0, c4 = tl.split(a0)
    c2, c6 = tl.split(a1)
    c1, c5 = tl.split(b0)
    c3, c7 = tl.split(b1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def stack8(t0, t1, t2, t3, t4, t5, t6, t7, jj, K_PAD: tl.constexpr, FILL):
    """The running list's first K_PAD entries as the columns ``jj`` of a (rows, K_PAD) tensor
    (FILL elsewhere)."""
    mk = tl.where(jj[None, :] == 0, t0[:, None], FILL)
    if K_PAD > 1:
        mk = tl.where(jj[None, :] == 1, t1[:, None], mk)
    if K_PAD > 2:
        mk = tl.where(jj[None, :] == 2, t2[:, None], mk)
        mk = tl.where(jj[None, :] == 3, t3[:, None], mk)
    if K_PAD > 4:
        mk = tl.where(jj[None, :] == 4, t4[:, None], mk)
        mk = tl.where(jj[None, :] == 5, t5[:, None], mk)
        mk = tl.where(jj[None, :] == 6, t6[:, None], mk)
        mk = tl.where(jj[None, :] == 7, t7[:, None], mk)
    return mk
