"""Triton routing kernels and their launchers (top-k, per-expert bucket sort, routing plan).

Two to four launches (one for small eager calls, below), no host sync, no atomics but the fused
launch's grid barrier; the result is a pure function of the inputs:

A. ``_topk_rank_kernel``: one program per run of ``SUB`` blocks of ``BLOCK_T`` (<= 32) tokens. Per
   block it loads the (BLOCK_T, E) scores, turns each into a unique integer key (order-preserving
   code of the score in the high bits, ``E_PAD - 1 - e`` in the low bits, so ties go to the lower
   expert, NaN is -inf and -0.0 is +0.0; int32 keys for 16-bit scores, int64 for fp32) and takes
   the top_k keys: for the sorted placement with top_k <= 8 per thread (``INSERT``: each thread
   owns a row and loads its scores 16 bytes at a time; each load's keys go into top_k registers
   by compare-exchange chains or, for top_k in 5..8 and 16-bit scores, are sorted by a network
   and merged into them, ``MERGE``; with 16-bit scores and E <= 128 the keys are fp32 values
   holding exact integers, so a compare-exchange is one max plus two adds, ``FKEY``), else
   ``top_k`` rounds of row maxima (``tl.topk``, bitonic, measured slower than both). The
   weights go to fp32 scratch, or (``PACK_W``: sorted placement, 16-bit scores, no renormalize)
   their 16 bits go above the local expert in the packed choice word. Then, by the placement C
   will use:
   * ranked (``SORTED=False``, small problems): a per-expert bitmask of the block's tokens that
     picked it, with a popcount of the earlier tokens' bits plus the program's running count,
     ranks every pair inside its expert; ``rank << L_BITS | local expert`` (or -1) to scratch;
   * sorted (``SORTED=True``, above ``_SORT_FROM`` pairs): the bare local expert (or -1) to
     scratch and a histogram of them.
   The program's per-expert count goes to ``hist[l, program]``.
A'. ``_topk_cols_kernel`` (``COLS``: 16-bit scores read as int32 pairs, 64 or 128 experts,
   k <= 8; route too unless it renormalizes): one token a thread. The k-th largest value by the
   sort-and-merge network on packed pairs (one PTX instruction per compare-exchange of two
   experts), masks of the experts above and equal to it (ties trimmed to the lowest experts),
   then, per warp, 32 x 32 bit transposes by shuffles into per-expert words of token bits (the
   program's columns; their popcounts are ``hist``). It then places each routed pair among the
   program's pairs sorted by (expert, token): its expert's run start for the token's warp plus
   the popcount of the expert's column word below the token's bit, both read from the expert's
   lane by shuffles (``_store_presorted``); the pair (token, local expert, score bits) goes to
   that slot, and for route each token's choices by descending score go to ``inverse`` as
   (slot, local expert) entries.
B. ``_scan_kernel``: exclusive scans of the ``hist`` rows over programs, a few experts per program
   (skipped for small problems: every C program then reduces the whole, small, ``hist`` itself).
C. ``_place_kernel``: one program per A-program. It turns the per-expert totals into expert offsets
   and writes the sorted pairs (``expert_indices``, ``token_indices``, ``weights``), ``inverse``
   and its own slice of the tail. Ranked: each pair at ``offset[e] + hist[e, program] + rank``,
   in token order (scattered 4-byte stores). Sorted: the program's pairs sorted in registers by
   (expert, token, j) with ``tl.sort``, then stored in that order, each expert's run contiguous
   (with ``PACK_W`` the weight's 16 bits are the key's low bits, so they sort along); or, for
   at most ``_COUNT_MAX_L`` local experts (``COUNT``), ranked without a sort: per token the
   counts of every expert packed a byte each into int32 words, an exclusive prefix sum of them
   over the program's tokens, then each pair's byte of it is its rank (stores in token order);
   or, for index_shuffling with 16-32 local experts (``CUMSUM``), ranked by prefix sums over
   the program's one-hot (token, expert) grid, one expert per thread, each pair's key sent to
   its sorted index in a scratch slice and read back in order (``_scatter_in_sorted_order``).
   After A' (``_place_presorted``), C turns route's ``inverse`` entries into positions (slot +
   the expert's base) and copies the placed pairs out, or leaves that to D. Program 0 also
   writes ``counts``/``offsets`` and ``token_count_per_expert``.
D. ``_expert_runs_kernel`` (``RUNS``: after A' and the scan's launch): one program per
   (group of ``P`` A-programs, local expert) writes the group's pairs of that expert, one
   contiguous run of the output, each read from its A-program's slots. C's stores per A-program
   were runs of ~8 pairs at unaligned addresses, and partial 32-byte sectors cost: 2^23 int32
   in runs of 8 took 38.6 us shifted by one element, 16.7 aligned, 11.5 coalesced (H200).

Measured on the H200 (``gpu/routing_gpu.py``): at T=2^20, E=128, k=8 (bf16) the k rounds cost
~34 us each and the bitmask ranks ~210 us; sorted placement (512 pairs per program) brought
index_shuffling from 711 to 550 us and route from 992 to 697 us, insertion top-k then to 445 and
490 us, fp32 keys and the merge network to 353 and 402 us (kernel A 174 us, its load pattern's
floor 110 us; C 164 / 204 us, mostly ``tl.sort``), route's weights carried in the packed choices
and sort keys (``PACK_W``) and B's wider chunks to 344 and 382 us, index_shuffling's token
columns (A', 128-token programs, C placing from the stored columns) to 222 us (A 112, C 101),
and route on them (C looking up per-token lists) to 343 us, then 322 (C 177); with A' placing
the pairs and D, to 280 us (A 181, C 35, D 54) and index_shuffling to 187 (A 128, C 7, D 42).
At T=4096 the kernels take 5-11 us and eager calls are bound by the host (H200 host: ~6 us a
launch, 2.5 an allocation, 7-10 a torch op). So an eager call after the first of its kind
relaunches the compiled handles with int addresses into one new buffer and splits it into the
outputs in one op (``routing_eager.py``, the public ops' fast lane); and where the plan is
A and C alone (no scan launch, C reducing ``hist`` itself) and its programs fit one per SM, A
and C run as one cooperative launch, ``_fused_kernel``: A's body, a grid barrier
(``grid_sync.py``), C's body. H200, T=4096, k=8: index_shuffling's host time 41 -> 25 us a call
(E=128), the device time 5.3-10.7 us against the two launches' 6.4-10.9. Eager calls also take
the sorted plan where it saves the scan's launch (``_launch_plan``'s ``eager``).

``OLD_INTERP`` (only under triton < 3.6's interpreter): kernel A's per-program histogram by
one-hot sums instead of ``tl.histogram`` (wrong counts for program 0 there), and NaN scores
replaced by a ``where`` instead of ``max.f32``'s NaN dropping (that interpreter's ``maxnumf`` is
``np.maximum``, which keeps NaN).

``WHILE_LOOPS`` (True only under the interpreter, from ``INTERPRET``): triton 3.5's interpreter
holds runtime scalars as 1-element arrays and its ``range()`` calls ``int()`` on them, an error
with numpy 2.4 (deprecated since 1.25; triton 3.8 squeezes first). So the two loops with a runtime
bound (B's over programs, C's ``token_count_per_expert`` over E) are ``while`` loops there; the GPU
compiles the ``for`` loops (same sm_90 PTX as without the flag). The flag also keeps C's one mask
built from a runtime scalar comparison a vector comparison there: the interpreter splats such a
scalar into int32 data, which triton 3.9's interpreter rejects as a mask ("mask has unsupported
dtype"; earlier versions took it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._dispatch import INTERPRET
from . import routing_eager as lane
from .blocks import cdiv, next_pow2
from .grid_sync import barrier_words, grid_sync
from .launch import BoundLaunches, FastKernel, Rel, current_stream, fast_path_open


@triton.jit
def _bits16_to_f32(bits, IS_BF16: tl.constexpr):
    """Raw bf16/fp16 bits (int32 holding the 16-bit pattern, sign-extended) -> fp32 value."""
    if IS_BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _popcount(x):
    """Set bits of each int32 (SWAR bit counting; the interpreter has no popc)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _score_keys(
    x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
    E_PAD: tl.constexpr, KIND: tl.constexpr, EVEN_E: tl.constexpr, SENT: tl.constexpr,
):  # fmt: skip
    """(rows, cols) scores -> unique integer keys: the order-preserving code of the score in the
    high bits, ``E_PAD - 1 - e`` in the low bits (ties to the lower expert), NaN as -inf, -0.0 as
    +0.0; int32 for 16-bit scores, int64 for fp32; SENT in padded columns."""
    col_ok = cols < E
    low = E_PAD - 1 - cols
    offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
    if EVEN_E:
        ld_mask = row_ok[:, None]
    else:
        ld_mask = row_ok[:, None] & col_ok[None, :]
    if KIND == 0:
        x = tl.load(x_ptr + offs, mask=ld_mask, other=0.0)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == 0.0, 0.0, x)
        bits = x.to(tl.int32, bitcast=True)
        code = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (code.to(tl.int64) << 32) | low[None, :].to(tl.int64)
    else:
        bits = tl.load(x_ptr + offs, mask=ld_mask, other=0).to(tl.int32)  # sign-extended
        mag = bits & 0x7FFF
        if KIND == 1:
            bits = tl.where(mag > 0x7F80, -128, bits)  # NaN -> -inf (0xFF80)
        else:
            bits = tl.where(mag > 0x7C00, -1024, bits)  # NaN -> -inf (0xFC00)
        code = bits ^ ((bits >> 15) & 0x7FFF)
        code = tl.where(mag == 0, 0, code)  # -0.0 -> +0.0
        key = (code << 16) | low[None, :]
    if not EVEN_E:
        key = tl.where(col_ok[None, :], key, SENT)
    return key


@triton.jit
def _score_fkeys(
    x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
    E_PAD: tl.constexpr, KIND: tl.constexpr, EVEN_E: tl.constexpr, OLD_INTERP: tl.constexpr,
):  # fmt: skip
    """16-bit scores (E_PAD <= 128) -> the same order as ``_score_keys`` as fp32 keys holding
    exact integers in [2^23, 2^24): (sortable 16-bit code) << 7 | (E_PAD - 1 - e). Differences
    of such keys are exact, so a compare-exchange needs one max and two adds (``_ce``). 0.0 in
    padded columns."""
    col_ok = cols < E
    offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
    if EVEN_E:
        ld_mask = row_ok[:, None]
    else:
        ld_mask = row_ok[:, None] & col_ok[None, :]
    bits = tl.load(x_ptr + offs, mask=ld_mask, other=0).to(tl.int32)  # sign-extended
    low = (E_PAD - 1 - cols)[None, :] | 0x4B000000  # exponent of 2^23
    if KIND == 1:
        f = (bits << 16).to(tl.float32, bitcast=True)
        if OLD_INTERP:
            f = tl.where(f != f, float("-inf"), f)
        else:
            f = tl.maximum(f, float("-inf"))  # NaN -> -inf: max.f32 returns the other operand
        f = f + 0.0  # -0.0 -> +0.0
        b = f.to(tl.int32, bitcast=True)
        u = (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)  # order as unsigned
        key = ((u >> 9) & 0x7FFF80).to(tl.int32) | low
    else:
        mag = bits & 0x7FFF
        bits = tl.where(mag > 0x7C00, -1024, bits)  # NaN -> -inf (0xFC00)
        code = bits ^ ((bits >> 15) & 0x7FFF)
        code = tl.where(mag == 0, 0, code)  # -0.0 -> +0.0
        key = ((code + 0x8000) << 7) | low
    key = key.to(tl.float32, bitcast=True)
    if not EVEN_E:
        key = tl.where(col_ok[None, :], key, 0.0)
    return key


@triton.jit
def _fkeys_to_keys(mk):
    """fp32 keys of ``_score_fkeys`` -> the int32 keys of ``_score_keys`` (INT32_MIN for 0.0)."""
    kb = mk.to(tl.int32, bitcast=True) & 0x7FFFFF
    return tl.where(mk == 0.0, -2147483648, (((kb >> 7) - 0x8000) << 16) | (kb & 0x7F))


# Packed 16-bit pairs: int32 words each holding two bf16 or fp16 scores (``MODE`` of ``_ce``: 2
# bf16x2 and 3 fp16x2 by inline PTX, 4 and 5 the same emulated in fp32 for the interpreter, which
# runs no inline assembly). max/min need NaN gone first (``_h2_nan_to_ninf``).
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
def _h2_op(a, b, OP: tl.constexpr, MODE: tl.constexpr):
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
def _h2_nan_to_ninf(w, MODE: tl.constexpr):
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
        return _h2_op(a, b, 0, MODE)
    else:
        return tl.maximum(a, b)


@triton.jit
def _ce(a, b, MODE: tl.constexpr):
    """Compare-exchange -> (max, min). MODE 0 (False): integer keys; 1 (True, ``FKEY``):
    exact-integer fp32 keys, min by two adds (the FMA pipes) instead of a second min/max (the
    ALU pipe, half as wide); 2-5: both halves of packed 16-bit words (``_h2_op``)."""
    if MODE >= 2:
        return _h2_op(a, b, 0, MODE), _h2_op(a, b, 1, MODE)
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
def _insert4(t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD: tl.constexpr,
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
def _merge8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, FKEY: tl.constexpr):
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
def _take8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, MODE: tl.constexpr):
    """The 8 largest of the running descending list t and 8 new keys c (``_sort8``, ``_merge8``)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _sort8(c0, c1, c2, c3, c4, c5, c6, c7, MODE)
    return _merge8(t0, t1, t2, t3, t4, t5, t6, t7, c0, c1, c2, c3, c4, c5, c6, c7, MODE)


@triton.jit
def _split8(key, BLOCK_T: tl.constexpr):
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
def _insert_topk(x_ptr, rows64, row_ok, stride_t, stride_e, E, jj,
                 BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, W: tl.constexpr,
                 KIND: tl.constexpr, EVEN_E: tl.constexpr, SENT: tl.constexpr,
                 FKEY: tl.constexpr, MERGE: tl.constexpr, OLD_INTERP: tl.constexpr):  # fmt: skip
    """The K_PAD (<= 8) largest keys of each row, descending, with no cross-lane work: W
    adjacent scores per thread and load (one 16-byte vector). Each load's keys go in by
    compare-exchange chains (insertion), or (MERGE, K_PAD == W == 8) are sorted by a network
    and merged into the running 8 (~4.5 instead of ~7.5 exchanges per score). FKEY: fp32 keys
    (``_score_fkeys``). -> (BLOCK_T, K_PAD) int32/int64 keys of ``_score_keys``."""
    if FKEY:
        t0 = tl.zeros([BLOCK_T], tl.float32)
    else:
        t0 = tl.full([BLOCK_T], SENT, tl.int64 if KIND == 0 else tl.int32)
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    t6 = t0
    t7 = t0
    for c0 in range(0, E_PAD, W):
        cols = c0 + tl.arange(0, W)
        if FKEY:
            key = _score_fkeys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
                               E_PAD, KIND, EVEN_E, OLD_INTERP)  # fmt: skip
        else:
            key = _score_keys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
                              E_PAD, KIND, EVEN_E, SENT)  # fmt: skip
        if W == 8:
            k0, k1, k2, k3, k4, k5, k6, k7 = _split8(key, BLOCK_T)
            if MERGE:
                t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
                    t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, k4, k5, k6, k7, FKEY
                )
            else:
                t0, t1, t2, t3, t4, t5, t6, t7 = _insert4(
                    t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD, FKEY
                )
                t0, t1, t2, t3, t4, t5, t6, t7 = _insert4(
                    t0, t1, t2, t3, t4, t5, t6, t7, k4, k5, k6, k7, K_PAD, FKEY
                )
        else:  # W == 4
            a, b = tl.split(tl.reshape(key, [BLOCK_T, 2, 2]))
            k0, k2 = tl.split(a)
            k1, k3 = tl.split(b)
            t0, t1, t2, t3, t4, t5, t6, t7 = _insert4(
                t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD, FKEY
            )
    S = 0.0 if FKEY else SENT
    mk = tl.where(jj[None, :] == 0, t0[:, None], S)
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
    if FKEY:
        mk = _fkeys_to_keys(mk)
    return mk


@triton.jit
def _popc(x, ASM: tl.constexpr):
    """Set bits of each int32: ``popc`` on the GPU, ``_popcount`` in the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return _popcount(x)


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
        _h2_nan_to_ninf(w0, MODE), _h2_nan_to_ninf(w1, MODE), _h2_nan_to_ninf(w2, MODE),
        _h2_nan_to_ninf(w3, MODE), _h2_nan_to_ninf(w4, MODE), _h2_nan_to_ninf(w5, MODE),
        _h2_nan_to_ninf(w6, MODE), _h2_nan_to_ninf(w7, MODE),
    )  # fmt: skip


@triton.jit
def _cmp8(gt, eq, w0, w1, w2, w3, w4, w5, w6, w7, v, SH: tl.constexpr, MODE: tl.constexpr):
    """Words at positions SH .. SH+7 of a 16-word run against the threshold pair ``v``: their
    halves' ``>`` and ``==`` bits into gt / eq (low half at bit SH + i, high half 16 higher)."""
    m = tl.full([1], 0x00010001, tl.int32)  # shifted as int32 (bit 31 is the sign)
    gt |= _h2_op(w0, v, 2, MODE) & (m << SH)
    eq |= _h2_op(w0, v, 3, MODE) & (m << SH)
    gt |= _h2_op(w1, v, 2, MODE) & (m << (SH + 1))
    eq |= _h2_op(w1, v, 3, MODE) & (m << (SH + 1))
    gt |= _h2_op(w2, v, 2, MODE) & (m << (SH + 2))
    eq |= _h2_op(w2, v, 3, MODE) & (m << (SH + 2))
    gt |= _h2_op(w3, v, 2, MODE) & (m << (SH + 3))
    eq |= _h2_op(w3, v, 3, MODE) & (m << (SH + 3))
    gt |= _h2_op(w4, v, 2, MODE) & (m << (SH + 4))
    eq |= _h2_op(w4, v, 3, MODE) & (m << (SH + 4))
    gt |= _h2_op(w5, v, 2, MODE) & (m << (SH + 5))
    eq |= _h2_op(w5, v, 3, MODE) & (m << (SH + 5))
    gt |= _h2_op(w6, v, 2, MODE) & (m << (SH + 6))
    eq |= _h2_op(w6, v, 3, MODE) & (m << (SH + 6))
    gt |= _h2_op(w7, v, 2, MODE) & (m << (SH + 7))
    eq |= _h2_op(w7, v, 3, MODE) & (m << (SH + 7))
    return gt, eq


@triton.jit
def _threshold_masks(
    x_ptr, rows64, row_ok, stride_w, K: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """Top-K (<= 8) experts of each row of 64 or 128 16-bit scores, read as int32 words of two
    (``stride_w``: words per row), one row per thread, all of it in registers.

    1. The K-th largest value: both halves of every word go through the packed sort-and-merge
       network at once (``_sort8`` / ``_merge8`` on ``_h2_op``: one instruction does two
       compare-exchange halves), keeping the 8 largest even and the 8 largest odd experts; one
       merge of the two lists gives the row's 8 largest values.
    2. Bitmasks of the experts above it and equal to it (packed compares). Taking the equal ones
       lowest expert first, as many as K needs, breaks ties to the lower expert; NaN is -inf and
       -0.0 equals +0.0, as in the float comparisons.
    -> 128-bit masks (4 int32 words, bit i of word m: expert 32m + i; words 2, 3 zero for 64
    experts) of the experts above the threshold and of those equal to it, and the count above
    (< K); ``_keep_lowest`` then takes the equal ones needed."""
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
    t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
        t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7, MODE
    )
    b0, b1, b2, b3, b4, b5, b6, b7 = _load8w(xw, roff, row_ok, 1, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
        t0, t1, t2, t3, t4, t5, t6, t7, b0, b1, b2, b3, b4, b5, b6, b7, MODE
    )
    d0, d1, d2, d3, d4, d5, d6, d7 = _load8w(xw, roff, row_ok, 2, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
        t0, t1, t2, t3, t4, t5, t6, t7, d0, d1, d2, d3, d4, d5, d6, d7, MODE
    )
    f0, f1, f2, f3, f4, f5, f6, f7 = _load8w(xw, roff, row_ok, 3, MODE, BLOCK_T)
    t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
        t0, t1, t2, t3, t4, t5, t6, t7, f0, f1, f2, f3, f4, f5, f6, f7, MODE
    )
    if E_PAD == 128:
        g0, g1, g2, g3, g4, g5, g6, g7 = _load8w(xw, roff, row_ok, 4, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
            t0, t1, t2, t3, t4, t5, t6, t7, g0, g1, g2, g3, g4, g5, g6, g7, MODE
        )
        h0, h1, h2, h3, h4, h5, h6, h7 = _load8w(xw, roff, row_ok, 5, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
            t0, t1, t2, t3, t4, t5, t6, t7, h0, h1, h2, h3, h4, h5, h6, h7, MODE
        )
        i0, i1, i2, i3, i4, i5, i6, i7 = _load8w(xw, roff, row_ok, 6, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
            t0, t1, t2, t3, t4, t5, t6, t7, i0, i1, i2, i3, i4, i5, i6, i7, MODE
        )
        j0, j1, j2, j3, j4, j5, j6, j7 = _load8w(xw, roff, row_ok, 7, MODE, BLOCK_T)
        t0, t1, t2, t3, t4, t5, t6, t7 = _take8(
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
    t0, t1, t2, t3, t4, t5, t6, t7 = _merge8(t0, t1, t2, t3, t4, t5, t6, t7,
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
    n_gt = _popc(gt0, ASM) + _popc(gt1, ASM) + _popc(gt2, ASM) + _popc(gt3, ASM)
    return gt0, gt1, gt2, gt3, eq0, eq1, eq2, eq3, n_gt


@triton.jit
def _select_bit(x, r, ASM: tl.constexpr):
    """Position of the r-th (from 0) set bit of each int32 x (r < popcount(x))."""
    pos = tl.zeros(x.shape, tl.int32)
    for b in tl.static_range(5):
        s = 16 >> b
        c = _popc(x & ((1 << s) - 1), ASM)
        go = r >= c
        r = tl.where(go, r - c, r)
        x = tl.where(go, x >> s, x)
        pos += tl.where(go, s, 0)
    return pos


@triton.jit
def _keep_lowest(q0, q1, q2, q3, need, ASM: tl.constexpr):
    """The lowest ``need`` (>= 1, at most the count) set bits of the 128-bit (q0, .., q3)."""
    c0 = _popc(q0, ASM)
    c1 = _popc(q1, ASM)
    c2 = _popc(q2, ASM)
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


def _warp_transpose_ptx() -> str:
    """PTX for four 32 x 32 bit-matrix transposes across a warp: lane r holds row r (bit c:
    column c) of each; after it lane c holds column c (bit r: row r). Five butterfly stages:
    lanes r and r ^ j trade the off-diagonal j x j blocks (one shuffle, two shifts, a select and
    a bit-select per word)."""
    lines = ["{", ".reg .b32 l, t, m, y, s1, s2, s;", ".reg .pred p;", "mov.u32 l, %laneid;"]
    for j, keep in ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333),
                    (1, 0x55555555)):  # fmt: skip
        # lanes with bit j set keep the columns with bit j set and take the partner's from j
        # higher; the others keep the rest and take the partner's from j lower
        lines += [f"and.b32 t, l, {j};", "setp.ne.u32 p, t, 0;",
                  f"selp.b32 m, {keep ^ 0xFFFFFFFF}, {keep}, p;"]  # fmt: skip
        for w in range(4):
            lines += [
                f"shfl.sync.bfly.b32 y, ${w}, {j}, 0x1f, -1;",
                f"shr.b32 s1, y, {j};",
                f"shl.b32 s2, y, {j};",
                "selp.b32 s, s1, s2, p;",
                f"lop3.b32 ${w}, ${w}, s, m, 0xE4;",
            ]  # lop3 0xE4: m ? word : s, bit by bit
    return "\n".join([*lines, "}"])


_WARP_TRANSPOSE: tl.constexpr = tl.constexpr(_warp_transpose_ptx())


@triton.jit
def _emulated_columns(s, TP: tl.constexpr):
    """``_token_columns`` for one word in tensor ops (the interpreter runs no PTX)."""
    i = tl.arange(0, 32)
    bits = tl.reshape((s[:, None] >> i[None, :]) & 1, [TP // 32, 32, 32])
    return tl.reshape(tl.sum(bits << i[None, :, None], 1), [TP])  # distinct bits: sum == or


@triton.jit
def _token_columns(s0, s1, s2, s3, TP: tl.constexpr, ASM: tl.constexpr):
    """(TP,) 128-bit token masks (words s0..s3), token t in thread t (TP / 32 warps) -> (TP,)
    column words: element 32h + i of word m has bit u set where token 32h + u picked expert
    32m + i."""
    if ASM:  # the layout puts token t in lane t % 32 of warp t // 32: transposes inside warps
        return tl.inline_asm_elementwise(
            _WARP_TRANSPOSE, "=r,=r,=r,=r,0,1,2,3", [s0, s1, s2, s3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return (_emulated_columns(s0, TP), _emulated_columns(s1, TP), _emulated_columns(s2, TP),
                _emulated_columns(s3, TP))  # fmt: skip


@triton.jit
def _range_bits(m: tl.constexpr, start, end):
    """Bits of word m (experts 32m .. 32m+31) for the experts in [start, end)."""
    lo = tl.minimum(tl.maximum(start - 32 * m, 0), 32)
    hi = tl.minimum(tl.maximum(end - 32 * m, 0), 32)
    below_hi = tl.where(hi >= 32, -1, (1 << tl.minimum(hi, 31)) - 1)
    below_lo = tl.where(lo >= 32, -1, (1 << tl.minimum(lo, 31)) - 1)
    return below_hi & ~below_lo


@triton.jit
def _pop_lowest(s0, s1, s2, s3, ASM: tl.constexpr):
    """The lowest set bit of the 128-bit (s0, .., s3) -> (its index, the words without it)."""
    w = tl.where(s0 != 0, 0, tl.where(s1 != 0, 1, tl.where(s2 != 0, 2, 3)))
    s = tl.where(w == 0, s0, tl.where(w == 1, s1, tl.where(w == 2, s2, s3)))
    bit = s & -s
    e = w * 32 + _popc(bit - 1, ASM)
    s0 ^= tl.where(w == 0, bit, 0)
    s1 ^= tl.where(w == 1, bit, 0)
    s2 ^= tl.where(w == 2, bit, 0)
    s3 ^= tl.where(w == 3, bit, 0)
    return e, s0, s1, s2, s3


@triton.jit
def _choice_entry(x_ptr, rows64, row_ok, stride_t, s0, s1, s2, s3, in_row, start, end,
                  KIND: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The next (lowest) chosen expert of each row: (its entry without the rank: expert | routed
    << 11 | the score's 16 bits << 16, its key: canonical score code << 8 | (255 - e), the
    remaining words). ``in_row``: valid rows (routed tokens)."""
    e, s0, s1, s2, s3 = _pop_lowest(s0, s1, s2, s3, ASM)
    bits = tl.load(x_ptr + rows64 * stride_t + e, mask=row_ok, other=0).to(tl.int32)
    mag = bits & 0x7FFF
    if KIND == 1:
        canon = tl.where(mag > 0x7F80, -128, bits)  # NaN -> -inf (0xFF80)
    else:
        canon = tl.where(mag > 0x7C00, -1024, bits)  # NaN -> -inf (0xFC00)
    code = tl.where(mag == 0, 0, canon ^ ((canon >> 15) & 0x7FFF))  # -0.0 -> +0.0
    routed = in_row & (e >= start) & (e < end)
    entry = e | tl.where(routed, 1 << 11, 0) | (bits << 16)
    return entry, (code << 8) | (255 - e), s0, s1, s2, s3


@triton.jit
def _rank_of(k, k0, k1, k2, k3, k4, k5, k6, k7):
    """How many of k0..k7 are larger than k (its rank by descending key)."""
    r = (k0 > k).to(tl.int32) + (k1 > k).to(tl.int32) + (k2 > k).to(tl.int32)
    r += (k3 > k).to(tl.int32) + (k4 > k).to(tl.int32) + (k5 > k).to(tl.int32)
    return r + (k6 > k).to(tl.int32) + (k7 > k).to(tl.int32)


@triton.jit
def _shfl(x, lane, TP: tl.constexpr, ASM: tl.constexpr):
    """``x`` of lane ``lane`` of the same warp (element (t // 32) * 32 + lane for thread t)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [x, lane], dtype=tl.int32,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.gather(x, tl.arange(0, TP) // 32 * 32 + lane, 0)


@triton.jit
def _run_starts(c, first, lbt_ptr, hist_ptr, pid, start, end, n_programs, m: tl.constexpr,
                TP: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Word m's columns (``_token_columns``) -> (TP,): element 32g + i = where expert 32m + i's
    pairs of token group g start among the program's pairs sorted by (expert, token), for
    ``first`` = the pairs of experts below 32m; and the pairs of experts up to 32m + 31. Each
    expert's count goes to ``hist`` (local experts), where its run starts to ``lbt_ptr[32m + i]``
    (for ``_expert_runs_kernel``)."""
    n = tl.reshape(_popc(c, ASM), [TP // 32, 32])
    tot = tl.sum(n, 0)
    le = 32 * m + tl.arange(0, 32) - start
    tl.store(hist_ptr + le * n_programs + pid, tot, mask=(le >= 0) & (le < end - start))
    lb = tl.cumsum(tot, 0) - tot + first
    tl.store(lbt_ptr + 32 * m + tl.arange(0, 32), lb)
    pre = tl.cumsum(n, 0) - n + lb[None, :]
    return tl.reshape(pre, [TP]), first + tl.sum(tot, 0)


@triton.jit
def _presort_choice(x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3,
                    c0, c1, c2, c3, p01, p23, start, end, K: tl.constexpr, KIND: tl.constexpr,
                    TP: tl.constexpr, E_PAD: tl.constexpr, ASM: tl.constexpr,
                    WEIGHTS: tl.constexpr):  # fmt: skip
    """The next (lowest) chosen expert e of each token: when routed, its pair goes to its place
    among the program's pairs sorted by (expert, token): the run start of e's token group plus
    the popcount of e's column word below the token's bit (both read from e's lane by
    shuffles), as ``token in program | local expert << TB | score bits << 16`` (TB = 7, or 8 for
    256-token programs). -> (the pair's ``inverse`` entry for C: place | local expert << PB (10,
    or 11 above 1024 places), or -1; its key; the remaining words)."""
    if WEIGHTS:
        ent, key, s0, s1, s2, s3 = _choice_entry(x_ptr, rows64, row_ok, stride_t, s0, s1, s2,
                                                 s3, in_row, start, end, KIND, ASM)  # fmt: skip
        e = ent & 0xFF
        routed = (ent & (1 << 11)) != 0
        hi = ent & -65536  # the score's bits
    else:
        e, s0, s1, s2, s3 = _pop_lowest(s0, s1, s2, s3, ASM)
        routed = in_row & (e >= start) & (e < end)
        key = e
        hi = 0
    lane = e & 31
    m = e >> 5
    word = _shfl(c0, lane, TP, ASM)
    word = tl.where(m == 1, _shfl(c1, lane, TP, ASM), word)
    pre = _shfl(p01, lane, TP, ASM)
    if E_PAD == 128:
        word = tl.where(m == 2, _shfl(c2, lane, TP, ASM), word)
        word = tl.where(m == 3, _shfl(c3, lane, TP, ASM), word)
        pre = tl.where(m >= 2, _shfl(p23, lane, TP, ASM), pre)
    pre = (pre >> ((m & 1) * 16)) & 0xFFFF
    u = tl.arange(0, TP) % 32
    place = pre + _popc(word & ~(-1 << u), ASM)
    le = e - start
    pid = tl.program_id(0)
    TB: tl.constexpr = 8 if TP > 128 else 7  # bits of the token in the program
    PB: tl.constexpr = 11 if TP * K > 1024 else 10  # bits of the place
    tl.store(srt_ptr + pid * TP * K + place, (rows - pid * TP) | (le << TB) | hi,
             mask=routed & row_ok)  # fmt: skip
    return tl.where(routed, place | (le << PB), -1), key, s0, s1, s2, s3


@triton.jit
def _store_presorted(
    srt_ptr, inverse_ptr, hist_ptr, x_ptr, rows, row_ok, in_row, stride_t, s0, s1, s2, s3,
    c0, c1, c2, c3, start, end, n_programs, K: tl.constexpr, KIND: tl.constexpr, TP: tl.constexpr,
    E_PAD: tl.constexpr, ASM: tl.constexpr, WEIGHTS: tl.constexpr,
):  # fmt: skip
    """The program's pairs placed by A: its counts to ``hist``, each routed pair to its place
    among the program's pairs sorted by (expert, token) (``_presort_choice``; ``srt_ptr``: the
    program's TP * K slots), and for route (WEIGHTS) per token its K choices by descending score
    (ties to the lower expert) as ``inverse`` entries (place | local expert << PB, or -1) that
    C turns into positions."""
    pid = tl.program_id(0)
    lbt_ptr = srt_ptr + n_programs * TP * K + pid * E_PAD  # after all the slots
    p0, first = _run_starts(c0, 0, lbt_ptr, hist_ptr, pid, start, end, n_programs, 0, TP, ASM)
    p1, first = _run_starts(c1, first, lbt_ptr, hist_ptr, pid, start, end, n_programs, 1, TP,
                            ASM)  # fmt: skip
    p01 = p0 | (p1 << 16)  # places < TP * 8 <= 2048: two to a word
    p23 = p01
    if E_PAD == 128:
        p2, first = _run_starts(c2, first, lbt_ptr, hist_ptr, pid, start, end, n_programs, 2, TP,
                                ASM)  # fmt: skip
        p3, first = _run_starts(c3, first, lbt_ptr, hist_ptr, pid, start, end, n_programs, 3, TP,
                                ASM)  # fmt: skip
        p23 = p2 | (p3 << 16)
    rows64 = rows.to(tl.int64)
    low = tl.full(rows.shape, -2147483648, tl.int32)  # below every key (choices >= K)
    v0, k0, s0, s1, s2, s3 = _presort_choice(
        x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2, c3,
        p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    v1, v2, v3, v4, v5, v6, v7 = v0, v0, v0, v0, v0, v0, v0
    k1, k2, k3, k4, k5, k6, k7 = low, low, low, low, low, low, low
    if K > 1:
        v1, k1, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 2:
        v2, k2, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 3:
        v3, k3, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 4:
        v4, k4, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 5:
        v5, k5, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 6:
        v6, k6, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if K > 7:
        v7, k7, s0, s1, s2, s3 = _presort_choice(
            x_ptr, srt_ptr, rows, rows64, row_ok, in_row, stride_t, s0, s1, s2, s3, c0, c1, c2,
            c3, p01, p23, start, end, K, KIND, TP, E_PAD, ASM, WEIGHTS)  # fmt: skip
    if WEIGHTS:  # route: inverse entries (index_shuffling has none)
        dst = inverse_ptr + rows * K
        tl.store(dst + _rank_of(k0, k0, k1, k2, k3, k4, k5, k6, k7), v0, mask=row_ok)
        if K > 1:
            tl.store(dst + _rank_of(k1, k0, k1, k2, k3, k4, k5, k6, k7), v1, mask=row_ok)
        if K > 2:
            tl.store(dst + _rank_of(k2, k0, k1, k2, k3, k4, k5, k6, k7), v2, mask=row_ok)
        if K > 3:
            tl.store(dst + _rank_of(k3, k0, k1, k2, k3, k4, k5, k6, k7), v3, mask=row_ok)
        if K > 4:
            tl.store(dst + _rank_of(k4, k0, k1, k2, k3, k4, k5, k6, k7), v4, mask=row_ok)
        if K > 5:
            tl.store(dst + _rank_of(k5, k0, k1, k2, k3, k4, k5, k6, k7), v5, mask=row_ok)
        if K > 6:
            tl.store(dst + _rank_of(k6, k0, k1, k2, k3, k4, k5, k6, k7), v6, mask=row_ok)
        if K > 7:
            tl.store(dst + _rank_of(k7, k0, k1, k2, k3, k4, k5, k6, k7), v7, mask=row_ok)


@triton.jit
def _topk_cols_kernel(
    x_ptr,  # (T, E) 16-bit scores as int16; rows of 4-byte aligned pairs (stride_w words)
    stride_t,
    stride_e,
    stride_w,
    vtc_ptr,
    pack_ptr,  # int32 out: TP * K slots a program for its placed pairs, then (programs, E_PAD)
    # run starts (_store_presorted)
    scr_w_ptr,  # (T, K) int32 out (route, WEIGHTS): the inverse entries (the inverse output)
    hist_ptr,  # (L, n_programs) int32 out: pairs per local expert and program
    T,
    E,
    start,
    end,
    n_programs,
    K: tl.constexpr,
    E_PAD: tl.constexpr,  # 64 or 128
    TP: tl.constexpr,  # tokens a program, one a thread: 32 a warp
    HAS_VTC: tl.constexpr,
    FULL_RANGE: tl.constexpr,
    MODE: tl.constexpr,  # _h2_op's: 2 / 3 bf16 / fp16 by PTX, 4 / 5 emulated (interpreter)
    WEIGHTS: tl.constexpr,  # route (COLS_ROUTE): weights and inverse entries too
):
    """Kernel A of the token-column plan (``COLS``): TP tokens a program, one a thread.
    Each token's chosen experts as a 128-bit mask (``_threshold_masks``, ``_keep_lowest``),
    masked to the expert range and the valid tokens; transposed to per-expert words of token
    bits (the program's columns), whose popcounts place each pair among the program's pairs in
    sorted order (``_store_presorted``)."""
    ASM: tl.constexpr = MODE <= 3
    pid = tl.program_id(0)
    rows = pid * TP + tl.arange(0, TP)
    row_ok = rows < T
    gt0, gt1, gt2, gt3, eq0, eq1, eq2, eq3, n_gt = _threshold_masks(
        x_ptr, rows.to(tl.int64), row_ok, stride_w, K, E_PAD, TP, MODE
    )
    eq0, eq1, eq2, eq3 = _keep_lowest(eq0, eq1, eq2, eq3, K - n_gt, ASM)
    routed = row_ok
    if HAS_VTC:
        vtc = tl.load(vtc_ptr).to(tl.int64)
        routed = routed & (rows < tl.minimum(tl.maximum(vtc, 0), T))
    s0 = tl.where(routed, gt0 | eq0, 0)
    s1 = tl.where(routed, gt1 | eq1, 0)
    s2 = tl.where(routed, gt2 | eq2, 0)
    s3 = tl.where(routed, gt3 | eq3, 0)
    if not FULL_RANGE:
        s0 &= _range_bits(0, start, end)
        s1 &= _range_bits(1, start, end)
        s2 &= _range_bits(2, start, end)
        s3 &= _range_bits(3, start, end)
    c0, c1, c2, c3 = _token_columns(s0, s1, s2, s3, TP, ASM)
    _store_presorted(pack_ptr, scr_w_ptr.to(tl.pointer_type(tl.int32)), hist_ptr, x_ptr, rows,
                     row_ok, routed, stride_t, gt0 | eq0, gt1 | eq1, gt2 | eq2, gt3 | eq3, c0, c1,
                     c2, c3, start, end, n_programs, K, MODE % 2 + 1, TP, E_PAD, ASM,
                     WEIGHTS)  # fmt: skip


@triton.jit
def _topk_rank_kernel(
    x_ptr,  # (T, E) scores; int16 view for 16-bit floats, fp32 otherwise
    stride_t,
    stride_e,
    stride_w,  # unused (the signature is _topk_cols_kernel's)
    vtc_ptr,  # (1,) int32/int64 valid token count (unused when not HAS_VTC)
    pack_ptr,  # (T, K) int32 out: rank in expert (within program) << L_BITS | local expert, or -1
    scr_w_ptr,  # (T, K) fp32 out: weight of each choice (only when WEIGHTS)
    hist_ptr,  # (L, n_programs) int32 out: pairs per local expert and program
    T,
    E,
    start,
    end,
    n_programs,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    L_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # <= 32 (token bitmasks are int32)
    SUB: tl.constexpr,
    KIND: tl.constexpr,  # 0: fp32, 1: bf16, 2: fp16
    HAS_VTC: tl.constexpr,
    WEIGHTS: tl.constexpr,
    RENORM: tl.constexpr,
    EVEN_E: tl.constexpr,  # E == E_PAD: no column masks
    FULL_RANGE: tl.constexpr,  # start == 0 and end == E: no range masks
    SENT: tl.constexpr,  # below every real key: INT64_MIN (fp32) or INT32_MIN (16-bit)
    RANKS: tl.constexpr,  # rank pairs here (bitmasks); else store bare choices for _place_sorted
    HB: tl.constexpr,  # histogram bins when not RANKS: 2 * L_PAD (bin L_PAD counts the unrouted)
    OLD_INTERP: tl.constexpr,  # triton < 3.6 interpreter workarounds (see above)
    INSERT: tl.constexpr,  # top-k by per-thread insertion (K_PAD <= 8, not RANKS)
    W: tl.constexpr,  # INSERT: scores per thread and load (16 bytes)
    FKEY: tl.constexpr,  # INSERT: exact-integer fp32 keys (16-bit scores, E_PAD <= 128)
    MERGE: tl.constexpr,  # INSERT: sort each load's 8 keys and merge (K_PAD == W == 8)
    PACK_W: tl.constexpr,  # sorted, 16-bit weights, no renormalize: weight bits in pack (no scr_w)
):
    pid = tl.program_id(0)
    n_valid = T
    if HAS_VTC:
        vtc = tl.load(vtc_ptr).to(tl.int64)
        n_valid = tl.minimum(tl.maximum(vtc, 0), T).to(tl.int32)
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    in_range = (cols >= start) & (cols < end)
    jj = tl.arange(0, K_PAD)
    k_ok = jj[None, :] < K
    running = tl.zeros([E_PAD], dtype=tl.int32)
    bins = tl.arange(0, HB)
    local_hist = tl.zeros([HB], dtype=tl.int32)
    for s in range(SUB):
        rows = (pid * SUB + s) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        if INSERT:
            mk = _insert_topk(x_ptr, rows64, row_ok, stride_t, stride_e, E, jj,
                              BLOCK_T, K_PAD, E_PAD, W, KIND, EVEN_E, SENT, FKEY, MERGE,
                              OLD_INTERP)  # fmt: skip
            if K < K_PAD:
                mk = tl.where(k_ok, mk, SENT)
        else:
            key = _score_keys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
                              E_PAD, KIND, EVEN_E, SENT)  # fmt: skip
            # top_k rounds: the row maximum is unique; remember it, then knock it out.
            mk = tl.full([BLOCK_T, K_PAD], SENT, dtype=key.dtype)
            for j in range(K):
                m = tl.max(key, axis=1)
                key = tl.where(key == m[:, None], SENT, key)
                mk = tl.where(jj[None, :] == j, m[:, None], mk)
        if KIND == 0:
            choice = E_PAD - 1 - mk.to(tl.int32)  # low 32 bits
        else:
            choice = E_PAD - 1 - (mk & 0xFFFF)

        if HAS_VTC:
            routed_row = row_ok & (rows < n_valid)
        else:
            routed_row = row_ok
        routed = routed_row[:, None] & k_ok
        if not FULL_RANGE:
            routed = routed & (choice >= start) & (choice < end)
        out_offs = rows[:, None] * K + jj[None, :]
        st_mask = row_ok[:, None] & k_ok
        if WEIGHTS:
            # NaN and -0.0 were canonicalised in the key (to -inf and +0.0): where the key says
            # 0 or -inf, reload the original score.
            orig_offs = rows64[:, None] * stride_t + choice.to(tl.int64) * stride_e
            if KIND == 0:
                c = (mk >> 32).to(tl.int32)
                w = (c ^ ((c >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
                fix = st_mask & ((w == 0.0) | (w == float("-inf")))
                w = tl.where(fix, tl.load(x_ptr + orig_offs, mask=fix, other=0.0), w)
            else:
                c = mk >> 16
                wb = c ^ ((c >> 15) & 0x7FFF)  # the score's bits (sign-extended)
                if KIND == 1:
                    fix = ((wb & 0x7FFF) == 0) | (wb == -128)  # bf16 -inf: 0xFF80
                else:
                    fix = ((wb & 0x7FFF) == 0) | (wb == -1024)  # fp16 -inf: 0xFC00
                fix = fix & st_mask
                wb = tl.where(fix, tl.load(x_ptr + orig_offs, mask=fix, other=0).to(tl.int32), wb)
                if not PACK_W:
                    w = _bits16_to_f32(wb, KIND == 1)
            if RENORM:
                wsum = tl.sum(tl.where(jj[None, :] == 0, w, 0.0), axis=1)
                for j in range(1, K):  # in choice order, as the reference adds
                    wsum = wsum + tl.sum(tl.where(jj[None, :] == j, w, 0.0), axis=1)
                w = tl.math.div_rn(w, wsum[:, None])
            if not PACK_W:
                tl.store(scr_w_ptr + out_offs, w, mask=st_mask)
        if RANKS:
            picked = (key == SENT) & routed_row[:, None]
            if not EVEN_E:
                picked = picked & col_ok[None, :]
            if not FULL_RANGE:
                picked = picked & in_range[None, :]
            # Bit r of colmask[e]: token r of the block picked e (BLOCK_T <= 32). A pair's rank in
            # its expert = the program's earlier count + the picks of the block's earlier tokens.
            rr = tl.arange(0, BLOCK_T)
            colmask = tl.sum(picked.to(tl.int32) << rr[:, None], axis=0)  # distinct bits: sum == or
            idx = tl.reshape(tl.where(routed, choice, 0), [BLOCK_T * K_PAD])
            g_mask = tl.reshape(tl.gather(colmask, idx, axis=0), [BLOCK_T, K_PAD])
            g_run = tl.reshape(tl.gather(running, idx, axis=0), [BLOCK_T, K_PAD])
            below = ~(-1 << rr)  # bits of the earlier tokens
            rank = g_run + _popcount(g_mask & below[:, None])
            running += _popcount(colmask)
            packed = tl.where(routed, (rank << L_BITS) | (choice - start), -1)
        else:
            le = tl.where(routed, choice - start, HB // 2)
            le = tl.reshape(le, [BLOCK_T * K_PAD])
            if OLD_INTERP:
                local_hist += tl.sum((le[:, None] == bins[None, :]).to(tl.int32), axis=0)
            else:
                local_hist += tl.histogram(le, HB)
            if PACK_W:  # the score's 16 bits above the local expert (0xFFFF: not routed)
                packed = (wb << 16) | tl.where(routed, choice - start, 0xFFFF)
            else:
                packed = tl.where(routed, choice - start, -1)
        tl.store(pack_ptr + out_offs, packed, mask=st_mask)
    if RANKS:
        tl.store(hist_ptr + (cols - start) * n_programs + pid, running, mask=in_range)
    else:
        tl.store(hist_ptr + bins * n_programs + pid, local_hist, mask=bins < end - start)


@triton.jit
def _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK: tl.constexpr):
    """Programs [c, c + CHUNK) of the hist rows -> their exclusive prefix plus carry; returns
    carry plus the chunk's totals."""
    idx = c + tl.arange(0, CHUNK)
    ok = l_ok[:, None] & (idx[None, :] < n_programs)
    h = tl.load(rows + idx[None, :], mask=ok, other=0)
    incl = tl.cumsum(h, axis=1)
    tl.store(rows + idx[None, :], incl - h + carry[:, None], mask=ok)
    return carry + tl.sum(h, axis=1)


@triton.jit
def _scan_kernel(
    hist_ptr,
    counts_ptr,
    L,
    n_programs,
    BLOCK_L: tl.constexpr,
    CHUNK: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """Rows of hist (pairs per program), BLOCK_L experts per program -> their exclusive prefix
    over programs; counts[l] = the row's total."""
    ls = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = ls < L
    rows = hist_ptr + ls[:, None] * n_programs
    carry = tl.zeros([BLOCK_L], dtype=tl.int32)
    if WHILE_LOOPS:
        c = n_programs * 0
        while c < n_programs:
            carry = _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK)
            c += CHUNK
    else:
        for c in range(0, n_programs, CHUNK):
            carry = _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK)
    tl.store(counts_ptr + ls, carry, mask=l_ok)


@triton.jit
def _tcpe_chunk(tcpe_ptr, counts_ptr, c, ls, E, L, start):
    """tcpe[e] for e in c + ls: the local count of e inside [start, start + L), else 0."""
    e = c + ls
    inside = (e >= start) & (e < start + L)
    v = tl.load(counts_ptr + (e - start), mask=inside, other=0)
    tl.store(tcpe_ptr + e, v, mask=e < E)


@triton.jit
def _place_kernel(
    pack_ptr,  # (T, K) int32 from A: rank << L_BITS | local expert, or -1
    scr_w_ptr,  # (T, K) fp32 weights (only when WEIGHTS)
    inverse_ptr,  # (T, K) int32 out: sorted position or -1 (only when INVERSE)
    hist_ptr,  # (L, n_programs) int32: per-program counts (FUSE_SCAN) or their exclusive prefix
    counts_ptr,  # (L,) int32: totals (written here when FUSE_SCAN, by the scan kernel otherwise)
    expert_ptr,  # (T*K,) int32 out
    token_ptr,  # (T*K,) int32 out
    weight_ptr,  # (T*K,) fp32 out (only when WEIGHTS)
    offsets_ptr,  # (L+1,) int32 out (only when OFFSETS)
    tcpe_ptr,  # (E+2,) int32 out (only when TCPE)
    T,
    E,
    L,
    start,
    n_programs,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    L_PAD: tl.constexpr,
    L_BITS: tl.constexpr,
    NP_PAD: tl.constexpr,  # >= n_programs when FUSE_SCAN
    TOK_PER_PROG: tl.constexpr,
    CHUNK_T: tl.constexpr,
    FUSE_SCAN: tl.constexpr,
    WEIGHTS: tl.constexpr,
    INVERSE: tl.constexpr,
    OFFSETS: tl.constexpr,
    TCPE: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
    SORTED: tl.constexpr,  # A stored bare choices: rank them here by sorting the program's pairs
    IDX_BITS: tl.constexpr,  # log2(TOK_PER_PROG * K_PAD) (SORTED)
    KEY64: tl.constexpr,  # SORTED keys need more than 30 bits
    PACK_W: tl.constexpr,  # SORTED: A packed 16-bit weight bits above each expert (see A)
    IS_BF16: tl.constexpr,  # PACK_W: the weights' bits are bf16 (else fp16)
    COUNT: tl.constexpr,  # SORTED: rank by byte-packed per-expert counts instead of tl.sort
    NW: tl.constexpr,  # COUNT: int32 count words per token (>= L_PAD / 4)
    CUMSUM: tl.constexpr,  # SORTED: rank by prefix sums of one-hot rows instead of tl.sort
    TOK_BITS: tl.constexpr,  # CUMSUM: log2(TOK_PER_PROG)
    COLS: tl.constexpr,  # A placed the pairs in sorted order (_topk_cols_kernel)
    RUNS: tl.constexpr,  # COLS: _expert_runs_kernel writes the sorted pairs, not C
):
    pid = tl.program_id(0)
    ls = tl.arange(0, L_PAD)
    l_ok = ls < L
    if FUSE_SCAN:  # small hist: every program reduces all of it (no scan launch)
        ps = tl.arange(0, NP_PAD)
        h = tl.load(
            hist_ptr + ls[:, None] * n_programs + ps[None, :],
            mask=l_ok[:, None] & (ps[None, :] < n_programs),
            other=0,
        )
        cnt = tl.sum(h, axis=1)
        before = tl.sum(tl.where(ps[None, :] < pid, h, 0), axis=1)
        mine = tl.sum(tl.where(ps[None, :] == pid, h, 0), axis=1)
        if pid == 0:
            tl.store(counts_ptr + ls, cnt, mask=l_ok)
    else:
        cnt = tl.load(counts_ptr + ls, mask=l_ok, other=0)
        before = tl.load(hist_ptr + ls * n_programs + pid, mask=l_ok, other=0)
        if WHILE_LOOPS:  # the interpreter: no mask from a splat runtime scalar (see above)
            has_next = ls * 0 + pid + 1 < n_programs
        else:
            has_next = pid + 1 < n_programs
        after = tl.load(hist_ptr + ls * n_programs + pid + 1, mask=l_ok & has_next, other=0)
        mine = tl.where(has_next, after, cnt) - before
    excl = tl.cumsum(cnt, axis=0) - cnt
    n = tl.sum(cnt, axis=0)
    base = excl + before
    lb = base  # SORTED: where each expert's pairs start among the program's sorted pairs
    if SORTED and not COUNT:  # position = index in the sorted pairs + base - first index of e
        lb = tl.cumsum(mine, axis=0) - mine
        base -= lb
    if pid == 0:  # noqa: SIM102 (a constexpr and a runtime test stay apart)
        if OFFSETS:
            tl.store(offsets_ptr + ls, excl, mask=l_ok)
            tl.store(offsets_ptr + L, n)
    tl.debug_barrier()  # counts (FUSE_SCAN) visible to the whole program
    if TCPE:  # noqa: SIM102
        if pid == 0:
            if WHILE_LOOPS:
                c = E * 0
                while c < E:
                    _tcpe_chunk(tcpe_ptr, counts_ptr, c, ls, E, L, start)
                    c += L_PAD
            else:
                for c in range(0, E, L_PAD):
                    _tcpe_chunk(tcpe_ptr, counts_ptr, c, ls, E, L, start)
            tl.store(tcpe_ptr + E, T)
            tl.store(tcpe_ptr + E + 1, n)

    if COLS:
        _place_presorted(
            pack_ptr, base, mine, expert_ptr, token_ptr, weight_ptr, inverse_ptr, T, K, n, pid,
            K_PAD, TOK_PER_PROG, IS_BF16, WEIGHTS, RUNS,
        )  # fmt: skip
    elif COUNT:
        _place_counted_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, NW, TOK_PER_PROG, WEIGHTS, INVERSE, PACK_W, IS_BF16,
        )  # fmt: skip
    elif SORTED:
        _place_sorted_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, lb, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, L_PAD, TOK_PER_PROG, IDX_BITS, KEY64, WEIGHTS, INVERSE, PACK_W,
            IS_BF16, CUMSUM, TOK_BITS,
        )  # fmt: skip
    else:
        _place_ranked_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, L_BITS, TOK_PER_PROG, CHUNK_T, WEIGHTS, INVERSE,
        )  # fmt: skip


@triton.jit
def _load_choices(pack_ptr, offs, m, PACK_W: tl.constexpr):
    """A's bare choices at ``offs``: (the packed word, the local expert, routed). PACK_W: the
    expert in the low 16 bits (0xFFFF: not routed), the weight's bits above; else the expert or
    -1 (the word is the expert then)."""
    if PACK_W:
        word = tl.load(pack_ptr + offs, mask=m, other=0xFFFF)
        le = word & 0xFFFF
        routed = le != 0xFFFF
    else:
        word = tl.load(pack_ptr + offs, mask=m, other=-1)
        le = word
        routed = le >= 0
    return word, le, routed


@triton.jit
def _store_in_token_order(
    pos, le, wv, rows, offs, m, routed, n, inverse_ptr, expert_ptr, token_ptr, weight_ptr,
    NR: tl.constexpr, K_PAD: tl.constexpr, WEIGHTS: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """(NR tokens, K_PAD choices) in token order: each routed pair's expert, token and weight
    at its sorted position ``pos`` (scattered 4-byte stores), ``inverse`` = pos (-1 unrouted), and
    the -1 / 0 tail at the pairs' own flat indices ``offs`` >= n."""
    if INVERSE:
        tl.store(inverse_ptr + offs, pos, mask=m)
    tl.store(expert_ptr + pos, le, mask=routed)
    tl.store(token_ptr + pos, tl.broadcast_to(rows[:, None], [NR, K_PAD]), mask=routed)
    tail = m & (offs >= n)
    tl.store(expert_ptr + offs, tl.full([NR, K_PAD], -1, tl.int32), mask=tail)
    tl.store(token_ptr + offs, tl.full([NR, K_PAD], -1, tl.int32), mask=tail)
    if WEIGHTS:
        tl.store(weight_ptr + pos, wv, mask=routed)
        tl.store(weight_ptr + offs, tl.zeros([NR, K_PAD], tl.float32), mask=tail)


@triton.jit
def _place_ranked_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, L_BITS: tl.constexpr, TOK_PER_PROG: tl.constexpr, CHUNK_T: tl.constexpr,
    WEIGHTS: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Pairs ranked by A: store each at base[e] + rank, in token order (scattered stores)."""
    jj = tl.arange(0, K_PAD)
    k_ok = jj[None, :] < K
    for c in range(0, TOK_PER_PROG, CHUNK_T):
        rows = pid * TOK_PER_PROG + c + tl.arange(0, CHUNK_T)
        row_ok = rows < T
        offs = rows[:, None] * K + jj[None, :]
        m = row_ok[:, None] & k_ok
        packed = tl.load(pack_ptr + offs, mask=m, other=-1)
        routed = packed >= 0
        le = tl.where(routed, packed & ((1 << L_BITS) - 1), -1)
        r = packed >> L_BITS
        b = tl.gather(base, tl.reshape(tl.where(routed, le, 0), [CHUNK_T * K_PAD]), 0)
        pos = tl.where(routed, tl.reshape(b, [CHUNK_T, K_PAD]) + r, -1)
        if WEIGHTS:
            wv = tl.load(scr_w_ptr + offs, mask=m, other=0.0)
        else:
            wv = tl.zeros([CHUNK_T, K_PAD], tl.float32)
        _store_in_token_order(
            pos, le, wv, rows, offs, m, routed, n, inverse_ptr, expert_ptr, token_ptr, weight_ptr,
            CHUNK_T, K_PAD, WEIGHTS, INVERSE,
        )  # fmt: skip


@triton.jit
def _scatter_in_sorted_order(le, routed, lb, scr_ptr, TP: tl.constexpr, K_PAD: tl.constexpr,
                             L_PAD: tl.constexpr, TOK_BITS: tl.constexpr):  # fmt: skip
    """(TP * K_PAD,) local experts of TP tokens' choices, token-major, and ``lb``, where each
    expert's pairs start in the program's sorted order -> each routed pair's key, local expert
    << TOK_BITS | local token, stored at ``scr_ptr[lb[e] + rank]``, rank = how many earlier tokens
    of the program chose the same expert (a token picks an expert at most once).

    The program's one-hot (token, expert) grid is packed WB experts to an int32 word per token,
    then unpacked with one expert per thread and all TP tokens in its registers, so the prefix
    sum over tokens and the keys' stores need no data from other threads."""
    WB: tl.constexpr = 32 if L_PAD >= 32 else L_PAD
    NW: tl.constexpr = L_PAD // WB
    le2 = tl.reshape(le, [TP, K_PAD])
    bit = tl.where(tl.reshape(routed, [TP, K_PAD]), 1 << (le2 % WB), 0)
    hit = (le2 // WB)[:, :, None] == tl.arange(0, NW)[None, None, :]
    words = tl.sum(tl.where(hit, bit[:, :, None], 0), axis=1)  # distinct bits: sum == or
    onehot = (words[:, :, None] >> tl.arange(0, WB)[None, None, :]) & 1
    onehot = tl.reshape(onehot, [TP, L_PAD])
    before = tl.cumsum(onehot, axis=0) - onehot  # earlier tokens that chose e
    dst = tl.where(onehot != 0, lb[None, :] + before, -1)
    key = (tl.arange(0, L_PAD)[None, :] << TOK_BITS) | tl.arange(0, TP)[:, None]
    tl.store(scr_ptr + dst, key, mask=onehot != 0)


@triton.jit
def _place_sorted_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, lb, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, L_PAD: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    IDX_BITS: tl.constexpr, KEY64: tl.constexpr, WEIGHTS: tl.constexpr, INVERSE: tl.constexpr,
    PACK_W: tl.constexpr, IS_BF16: tl.constexpr, CUMSUM: tl.constexpr, TOK_BITS: tl.constexpr,
):  # fmt: skip
    """Bare choices from A: sort the program's pairs by (expert, token, j) in registers, then
    store them in that order, so each expert's run goes out as contiguous (coalesced) stores.
    PACK_W: A packed each 16-bit weight above its expert; the sort key carries it along as its
    low 16 bits (expert, index, weight: 32 bits, ordered as unsigned), so no gather of weights.
    CUMSUM (no weights, no inverse): the same order from ``_scatter_in_sorted_order`` instead
    of ``tl.sort``."""
    NP: tl.constexpr = TOK_PER_PROG * K_PAD
    idx = tl.arange(0, NP)  # = local token * K_PAD + j: token-major order
    rows = pid * TOK_PER_PROG + idx // K_PAD
    jv = idx % K_PAD
    m = (rows < T) & (jv < K)
    offs = rows * K + jv
    word, le, routed = _load_choices(pack_ptr, offs, m, PACK_W)
    if INVERSE:
        tl.store(inverse_ptr + offs, tl.full([NP], -1, tl.int32), mask=m & ~routed)
    tail = m & (offs >= n)
    tl.store(expert_ptr + offs, tl.full([NP], -1, tl.int32), mask=tail)
    tl.store(token_ptr + offs, tl.full([NP], -1, tl.int32), mask=tail)
    if WEIGHTS:
        tl.store(weight_ptr + offs, tl.zeros([NP], tl.float32), mask=tail)
    if CUMSUM:  # (no weights, no inverse) each pair's key to its index in the sorted order
        # through the program's slice of the choices (every thread has read them by the barrier)
        scr = pack_ptr + pid * TOK_PER_PROG * K
        tl.debug_barrier()
        le0 = tl.where(routed, le, 0)
        _scatter_in_sorted_order(le0, routed, lb, scr, TOK_PER_PROG, K_PAD, L_PAD, TOK_BITS)
        tl.debug_barrier()
        ok = idx < tl.sum(routed.to(tl.int32), axis=0)
        key = tl.load(scr + idx, mask=ok, other=0)
        e_s = key >> TOK_BITS
        i_s = (key & (TOK_PER_PROG - 1)) * K_PAD
    elif PACK_W:
        big = tl.full([NP], 0x7FFFFFFF, tl.int32)
        flip = -2147483648  # xor of the sign bit: signed order == the unsigned order of the bits
        key = ((le << (IDX_BITS + 16)) | (idx << 16) | ((word >> 16) & 0xFFFF)) ^ flip
        key = tl.sort(tl.where(routed, key, big))
        # A real key may equal ``big`` (bits all ones); the routed pairs still come first.
        ok = idx < tl.sum(routed.to(tl.int32), axis=0)
        key = key ^ flip
        e_s = (key >> (IDX_BITS + 16)) & ((1 << (16 - IDX_BITS)) - 1)
        i_s = (key >> 16) & (NP - 1)
    elif KEY64:
        big = tl.full([NP], 0x7FFFFFFFFFFFFFFF, tl.int64)
        key = tl.sort(tl.where(routed, (le.to(tl.int64) << IDX_BITS) | idx.to(tl.int64), big))
        ok = key != big
        e_s = (key >> IDX_BITS).to(tl.int32)
        i_s = (key & (NP - 1)).to(tl.int32)
    else:
        big = tl.full([NP], 0x7FFFFFFF, tl.int32)
        key = tl.sort(tl.where(routed, (le << IDX_BITS) | idx, big))
        ok = key != big
        e_s = key >> IDX_BITS
        i_s = key & (NP - 1)
    src = (pid * TOK_PER_PROG + i_s // K_PAD) * K + i_s % K_PAD  # (token, j) of sorted pair
    pos = idx + tl.gather(base, tl.where(ok, e_s, 0), 0)  # base[e_s], from registers
    tl.store(expert_ptr + pos, e_s, mask=ok)
    tl.store(token_ptr + pos, pid * TOK_PER_PROG + i_s // K_PAD, mask=ok)
    if INVERSE:
        tl.store(inverse_ptr + src, pos, mask=ok)
    if WEIGHTS:
        if PACK_W:
            wv = _bits16_to_f32(key & 0xFFFF, IS_BF16)
        else:
            wv = tl.load(scr_w_ptr + src, mask=ok, other=0.0)
        tl.store(weight_ptr + pos, wv, mask=ok)


@triton.jit
def _place_presorted(
    srt_ptr, base, mine, expert_ptr, token_ptr, weight_ptr, inverse_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, TP: tl.constexpr, IS_BF16: tl.constexpr, WEIGHTS: tl.constexpr,
    RUNS: tl.constexpr,
):  # fmt: skip
    """C after A placed each program's pairs in sorted order (``_store_presorted``): the
    program's pairs are read in order, each goes to its index plus its expert's ``base`` (one
    gather; RUNS: D writes them instead), and route's ``inverse`` entries from A (place | local
    expert << PB, or -1) become positions the same way. Stores of the tail, in token order."""
    NP: tl.constexpr = TP * K_PAD
    idx = tl.arange(0, NP)
    rows = pid * TP + idx // K_PAD
    jv = idx % K_PAD
    offs = rows * K + jv
    tail = (rows < T) & (jv < K) & (offs >= n)
    tl.store(expert_ptr + offs, tl.full([NP], -1, tl.int32), mask=tail)
    tl.store(token_ptr + offs, tl.full([NP], -1, tl.int32), mask=tail)
    if WEIGHTS:
        tl.store(weight_ptr + offs, tl.zeros([NP], tl.float32), mask=tail)
    TB: tl.constexpr = 8 if TP > 128 else 7  # as in _presort_choice
    PB: tl.constexpr = 11 if TP * K > 1024 else 10
    if not RUNS:  # else _expert_runs_kernel writes the sorted pairs
        ok = idx < tl.sum(mine, axis=0)
        v = tl.load(srt_ptr + pid * TP * K + idx, mask=ok, other=0)
        le = (v >> TB) & 0x7F
        pos = idx + tl.gather(base, le, 0)
        tl.store(expert_ptr + pos, le, mask=ok)
        tl.store(token_ptr + pos, pid * TP + (v & (TP - 1)), mask=ok)
        if WEIGHTS:
            tl.store(weight_ptr + pos, _bits16_to_f32(v >> 16, IS_BF16), mask=ok)
    if WEIGHTS:  # route: inverse
        m = (rows < T) & (jv < K)
        u = tl.load(inverse_ptr + offs, mask=m, other=-1)
        at = tl.gather(base, tl.where(u >= 0, u >> PB, 0), 0)
        tl.store(inverse_ptr + offs, tl.where(u >= 0, (u & ((1 << PB) - 1)) + at, -1), mask=m)


@triton.jit
def _expert_runs_chunk(pack_ptr, expert_ptr, token_ptr, weight_ptr, le, first, cum, src0, tok0,
                       q0, S, P: tl.constexpr, TP: tl.constexpr, QB: tl.constexpr,
                       WEIGHTS: tl.constexpr, IS_BF16: tl.constexpr):  # fmt: skip
    """Pairs [q0, q0 + QB) of the group's run of local expert ``le``: pair q comes from the
    last program b with ``cum[b] <= q`` (a binary search), at its slot ``src0[b] + q``."""
    q = q0 + tl.arange(0, QB)
    ok = q < S
    b = tl.zeros([QB], tl.int32)
    for s in tl.static_range(8):  # P <= 256; cum is non-decreasing and cum[0] = 0
        if (P >> (s + 1)) > 0:
            cand = b + (P >> (s + 1))
            b = tl.where(tl.gather(cum, cand, 0) <= q, cand, b)
    v = tl.load(pack_ptr + tl.gather(src0, b, 0) + q, mask=ok, other=0)
    tl.store(expert_ptr + first + q, tl.full([QB], 0, tl.int32) + le, mask=ok)
    tl.store(token_ptr + first + q, tl.gather(tok0, b, 0) + (v & (TP - 1)), mask=ok)
    if WEIGHTS:
        tl.store(weight_ptr + first + q, _bits16_to_f32(v >> 16, IS_BF16), mask=ok)


@triton.jit
def _expert_runs_kernel(
    pack_ptr,  # A's placed pairs: TP * K slots a program, then (programs, E_PAD) run starts
    hist_ptr,  # (L, n_programs) int32: exclusive prefix over programs (the scan's)
    counts_ptr,  # (L,) int32: pairs per local expert
    expert_ptr,  # (T*K,) int32 out
    token_ptr,  # (T*K,) int32 out
    weight_ptr,  # (T*K,) fp32 out (only when WEIGHTS)
    L,
    start,
    n_programs,
    K: tl.constexpr,
    TP: tl.constexpr,  # tokens of an A program
    E_PAD: tl.constexpr,
    L_PAD: tl.constexpr,
    P: tl.constexpr,  # A programs a group
    QB: tl.constexpr,  # pairs a step
    WEIGHTS: tl.constexpr,
    IS_BF16: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """The sorted pairs placed by A', one program per (group of P A-programs, local expert):
    the group's pairs of the expert form one contiguous run of the output, which this program
    writes in order, whole 32-byte sectors but at its two ends (C's stores per A-program were
    runs of ~8 pairs, misaligned: H200, T=2^20, E=128, k=8, C's stores cost ~100 us of 165).
    Each pair is read from its A-program's slots (``_presort_choice``)."""
    pid = tl.program_id(0)
    le = pid % L
    ps = (pid // L) * P + tl.arange(0, P)
    pok = ps < n_programs
    row = hist_ptr + le * n_programs
    bef = tl.load(row + ps, mask=pok, other=0)
    total = tl.load(counts_ptr + le)
    has_next = ps + 1 < n_programs
    nxt = tl.where(has_next, tl.load(row + ps + 1, mask=has_next, other=0), total)
    c = tl.where(pok, nxt - bef, 0)
    cum = tl.cumsum(c, 0) - c
    S = tl.sum(c, 0)
    ls = tl.arange(0, L_PAD)
    cnt = tl.load(counts_ptr + ls, mask=ls < L, other=0)
    first = tl.sum(tl.where(ls < le, cnt, 0), 0) + tl.load(row + (pid // L) * P)
    lbp = tl.load(pack_ptr + n_programs * TP * K + ps * E_PAD + le + start, mask=pok, other=0)
    src0 = ps * (TP * K) + lbp - cum  # pair q of program b sits at slot src0[b] + q
    tok0 = ps * TP
    if WHILE_LOOPS:
        q0 = S * 0
        while q0 < S:
            _expert_runs_chunk(pack_ptr, expert_ptr, token_ptr, weight_ptr, le, first, cum, src0,
                               tok0, q0, S, P, TP, QB, WEIGHTS, IS_BF16)  # fmt: skip
            q0 += QB
    else:
        for q0 in range(0, S, QB):
            _expert_runs_chunk(pack_ptr, expert_ptr, token_ptr, weight_ptr, le, first, cum, src0,
                               tok0, q0, S, P, TP, QB, WEIGHTS, IS_BF16)  # fmt: skip


@triton.jit
def _fused_kernel(
    # pointers first (a bound relaunch computes them in one pass), then the ints
    x_ptr, vtc_ptr,
    bar_ptr,  # this stream's grid_sync words
    pack_ptr, a_w_ptr,  # a_w_ptr: kernel A's scr_w_ptr
    hist_ptr, scr_w_ptr, inverse_ptr, counts_ptr, expert_ptr, token_ptr, weight_ptr, offsets_ptr,
    tcpe_ptr, stride_t, stride_e, stride_w, T, E, L, start, end, n_programs,
    COLS_A: tl.constexpr,  # A is _topk_cols_kernel (else _topk_rank_kernel)
    # _topk_rank_kernel's constexprs, then _topk_cols_kernel's others (dummies for the other A)
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, L_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr, SUB: tl.constexpr, KIND: tl.constexpr, HAS_VTC: tl.constexpr,
    WEIGHTS: tl.constexpr, RENORM: tl.constexpr, EVEN_E: tl.constexpr, FULL_RANGE: tl.constexpr,
    SENT: tl.constexpr, RANKS: tl.constexpr, HB: tl.constexpr, OLD_INTERP: tl.constexpr,
    INSERT: tl.constexpr, W: tl.constexpr, FKEY: tl.constexpr, MERGE: tl.constexpr,
    PACK_W: tl.constexpr, TP: tl.constexpr, MODE: tl.constexpr,
    # _place_kernel's others
    L_PAD: tl.constexpr, NP_PAD: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    CHUNK_T: tl.constexpr, FUSE_SCAN: tl.constexpr, INVERSE: tl.constexpr,
    OFFSETS: tl.constexpr, TCPE: tl.constexpr, WHILE_LOOPS: tl.constexpr, SORTED: tl.constexpr,
    IDX_BITS: tl.constexpr, KEY64: tl.constexpr, IS_BF16: tl.constexpr, COUNT: tl.constexpr,
    NW: tl.constexpr, CUMSUM: tl.constexpr, TOK_BITS: tl.constexpr, COLS: tl.constexpr,
    RUNS: tl.constexpr,
):  # fmt: skip
    """A, then C, in one launch (eager calls of plans with no scan launch whose programs fit on
    the GPU at once): each program runs kernel A's body for its tokens, waits at a grid barrier
    until every program's ``hist`` column and placed pairs are written, then runs kernel C's
    body (FUSE_SCAN: it reduces the whole ``hist`` itself). The same code as the two launches,
    so the same results; launched cooperatively (``grid_sync``)."""
    if COLS_A:
        _topk_cols_kernel(
            x_ptr, stride_t, stride_e, stride_w, vtc_ptr, pack_ptr, a_w_ptr, hist_ptr, T, E,
            start, end, n_programs, K, E_PAD, TP, HAS_VTC, FULL_RANGE, MODE, WEIGHTS,
        )  # fmt: skip
    else:
        _topk_rank_kernel(
            x_ptr, stride_t, stride_e, stride_w, vtc_ptr, pack_ptr, a_w_ptr, hist_ptr, T, E,
            start, end, n_programs, K, K_PAD, E_PAD, L_BITS, BLOCK_T, SUB, KIND, HAS_VTC,
            WEIGHTS, RENORM, EVEN_E, FULL_RANGE, SENT, RANKS, HB, OLD_INTERP, INSERT, W, FKEY,
            MERGE, PACK_W,
        )  # fmt: skip
    grid_sync(bar_ptr, n_programs)
    _place_kernel(
        pack_ptr, scr_w_ptr, inverse_ptr, hist_ptr, counts_ptr, expert_ptr, token_ptr,
        weight_ptr, offsets_ptr, tcpe_ptr, T, E, L, start, n_programs, K, K_PAD, L_PAD, L_BITS,
        NP_PAD, TOK_PER_PROG, CHUNK_T, FUSE_SCAN, WEIGHTS, INVERSE, OFFSETS, TCPE, WHILE_LOOPS,
        SORTED, IDX_BITS, KEY64, PACK_W, IS_BF16, COUNT, NW, CUMSUM, TOK_BITS, COLS, RUNS,
    )  # fmt: skip


@triton.jit
def _place_counted_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, NW: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    WEIGHTS: tl.constexpr, INVERSE: tl.constexpr, PACK_W: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    """Bare choices from A, ranked without sorting: a pair's rank inside its expert's run is the
    number of earlier tokens of the program that chose the same expert (a token picks an expert
    at most once). Per token, the counts of all L experts are packed one byte each (at most
    TOK_PER_PROG <= 255 per program) into NW int32 words; an exclusive prefix sum over
    the program's tokens then gives every (token, expert) its rank in one byte. Stores go out in
    token order (each pair to base[e] + rank), not grouped per expert as after a sort."""
    tok = tl.arange(0, TOK_PER_PROG)
    rows = pid * TOK_PER_PROG + tok
    row_ok = rows < T
    words = tl.arange(0, NW)
    inc = tl.zeros([TOK_PER_PROG, NW], tl.int32)
    for j in tl.static_range(K_PAD):  # this token's one-byte increments, one choice at a time
        _, le_j, ok_j = _load_choices(pack_ptr, rows * K + j, row_ok & (j < K), PACK_W)
        hit = ((le_j >> 2)[:, None] == words[None, :]) & ok_j[:, None]
        inc += tl.where(hit, (1 << ((le_j & 3) * 8))[:, None], 0)
    before = tl.cumsum(inc, axis=0) - inc  # (tokens, words): counts over earlier tokens

    jj = tl.arange(0, K_PAD)
    m = row_ok[:, None] & (jj[None, :] < K)
    offs = rows[:, None] * K + jj[None, :]
    word, le, routed = _load_choices(pack_ptr, offs, m, PACK_W)
    le0 = tl.where(routed, le, 0)
    rank = (tl.gather(before, le0 >> 2, 1) >> ((le0 & 3) * 8)) & 0xFF
    b = tl.gather(base, tl.reshape(le0, [TOK_PER_PROG * K_PAD]), 0)
    pos = tl.where(routed, tl.reshape(b, [TOK_PER_PROG, K_PAD]) + rank, -1)
    if WEIGHTS and PACK_W:
        wv = _bits16_to_f32((word >> 16) & 0xFFFF, IS_BF16)
    elif WEIGHTS:
        wv = tl.load(scr_w_ptr + offs, mask=m, other=0.0)
    else:
        wv = tl.zeros([TOK_PER_PROG, K_PAD], tl.float32)
    _store_in_token_order(
        pos, le, wv, rows, offs, m, routed, n, inverse_ptr, expert_ptr, token_ptr, weight_ptr,
        TOK_PER_PROG, K_PAD, WEIGHTS, INVERSE,
    )  # fmt: skip


_MAX_PROGRAMS = 4096  # programs of kernels A and C (bounds the length of a hist row)
_MIN_PROGRAMS = 128  # spread small problems over about this many programs
_FUSE_SCAN_MAX = 16384  # fold the scan into C when L_PAD * NP_PAD is at most this
# Above _SORT_FROM pairs C ranks the pairs by sorting them (coalesced stores); up to it A ranks
# them with bitmasks (H200, T=4096, E=16, k=8: 6.6 us vs 7.4 us; T=65536, E=128: 66 vs 55 us).
_SORT_FROM = 32768
_SORT_MAX = 512  # pairs per program when sorting
_COUNT_MAX_L = 16  # up to this many (padded) local experts C ranks by counting, not sorting
_CUMSUM_MIN_L, _CUMSUM_MAX_L = 16, 32  # (padded) local experts: C ranks by one-hot prefix sums


def _config(T: int, E: int, K: int, fp32: bool) -> dict[str, int]:
    """Block sizes and warps from the problem size: about 4096 keys per block (2048 for the int64
    keys of fp32 scores; 2048 / 1024 for at most ~16 blocks per SM), at least ~128 programs where
    T allows, at most 4096 programs."""
    e_pad = max(next_pow2(E), 4)
    tile = 2048 if fp32 else 4096
    min_programs = 1 if INTERPRET else _MIN_PROGRAMS  # the interpreter wants few, big blocks
    if not INTERPRET and T <= 65536:
        # Small T (one or two waves): ~2x smaller tiles with 2 warps ran fastest on the H200
        # (T=4096, E=128: 11 us vs 19 us per route at 32 x 128 with 4 warps).
        tile //= 2
    block_t = max(1, min(tile // e_pad, 32, next_pow2(cdiv(T, min_programs))))
    warps = max(2, min(8, block_t * e_pad // 1024))
    if not INTERPRET and block_t * e_pad >= 4096 and 8 * _MAX_PROGRAMS * block_t <= T:
        # Very long inputs: halving the block and the warps ran ~8% faster on the H200
        # (T=2^20, E=128: 710 vs 773 us), and it is the configuration checked bit-exact there.
        block_t, warps = block_t // 2, max(2, warps // 2)
    n_blocks = cdiv(T, block_t)
    return {
        "BLOCK_T": block_t,
        "SUB": next_pow2(cdiv(n_blocks, _MAX_PROGRAMS)),
        "num_warps": 1 if INTERPRET else warps,
    }


_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# triton 3.5's interpreter returns wrong tl.histogram counts for program 0 of a multi-program
# grid when the histogram accumulates in a loop; 3.8's is right, and the GPU never takes this.
_OLD_INTERP = INTERPRET and tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6)
# route on the token-column plan by default (config key COLS_ROUTE overrides it per call)
_COLS_ROUTE = True
_topk_rank = FastKernel(_topk_rank_kernel)
_topk_cols = FastKernel(_topk_cols_kernel)
_scan = FastKernel(_scan_kernel)
_place = FastKernel(_place_kernel)
_expert_runs = FastKernel(_expert_runs_kernel)
_fused = FastKernel(_fused_kernel)


class _Launch(NamedTuple):
    """Everything about a launch that depends only on sizes and flags (cached)."""

    n_prog: int
    sizes: tuple[int, ...]  # int32 elements of the buffer segments, in _SEGMENTS order
    starts: tuple[int, ...]  # where each segment starts in the one buffer (int32 elements)
    a: dict  # constexprs of kernel A
    a_warps: int
    scan: tuple[int, dict, int] | None  # (grid, constexprs, warps) of B; None: fused into C
    c: dict  # constexprs of kernel C
    c_warps: int
    runs: tuple[int, dict, int] | None  # (grid, constexprs, warps) of _expert_runs_kernel


# Outputs first, then scratch; weights and scr_w hold fp32 bits. index_shuffling's counts are
# C's scratch: after tcpe, so its eager split has one piece less (outputs, then the rest).
_SEGMENTS = (
    "expert", "token", "weights", "inverse", "tcpe", "counts", "offsets", "pad",
    "hist", "packed", "scr_w",
)  # fmt: skip
_N_OUT = _SEGMENTS.index("pad")
_SEG = {name: i for i, name in enumerate(_SEGMENTS)}


@functools.lru_cache(maxsize=512)
def _launch_plan(
    T: int,
    E: int,
    K: int,
    start: int,
    end: int,
    kind: int,
    renormalize: bool,
    has_vtc: bool,
    with_weights: bool,
    with_offsets: bool,
    with_tcpe: bool,
    config: tuple | None,
    eager: bool = False,
    words: bool = False,
) -> _Launch:
    L = end - start
    cfg = _config(T, E, K, kind == 0)
    if config:
        cfg.update(config)
    k_pad = next_pow2(K)
    l_pad = max(next_pow2(L), 2)
    sort = T * K > _SORT_FROM
    if eager and not sort and not INTERPRET and k_pad <= 8:
        # Eager calls are bound by host time at these sizes. Where the ranked plan would need the
        # scan as a launch of its own, the sorted plan's 64-token programs fold it into C: one
        # launch fewer (H200, T=4096, E=128, k=8: ~7 us of host time a launch; GPU time 21.6 vs
        # 15.4 us, so calls through the custom op, i.e. compiled code, keep the ranked plan).
        n_ranked = cdiv(T, cfg["BLOCK_T"] * cfg["SUB"])
        fits = l_pad * max(next_pow2(cdiv(T, 64)), 2) <= _FUSE_SCAN_MAX
        sort = fits and l_pad * max(next_pow2(n_ranked), 2) > _FUSE_SCAN_MAX
    sort = cfg.get("SORTED", sort)
    # Per-thread insertion top-k where it applies (H200, T=2^20, E=128, k=8: index_shuffling
    # 552 -> 445 us, route 676 -> 489 us; T=65536 fp32 route 99 -> 70 us).
    insert = bool(cfg.get("INSERT", True)) and sort and k_pad <= 8
    user = dict(config) if config else {}
    # The token-column plan: 16-bit scores read as int32 pairs (``words``: 4-byte aligned rows),
    # 64 or 128 experts, k <= 8, route unless it renormalizes (COLS_ROUTE). A by threshold into
    # per-expert token columns, whose popcounts place each pair among its program's pairs in
    # sorted order (route: and the inverse entries); C (small T) or D (after the scan's launch,
    # ``RUNS``) writes them out. H200, T=2^20, k=8, bf16, gpu/routing_ablation.py: E=128 route
    # 279 us and index_shuffling 183, against 380 / 349 on the sorted plan and 321 / 216 with C
    # placing the pairs from the stored columns (and route's per-token lists; session 10's plan,
    # commit 5035caa); E=64 210 / 124 against 240 / 152.
    cols = insert and words and kind != 0 and E in (64, 128) and k_pad <= 8
    cols = cols and (
        not with_weights or (bool(cfg.get("COLS_ROUTE", _COLS_ROUTE)) and not renormalize)
    )
    cols = cols and "BLOCK_T" not in user and bool(cfg.get("COLS", True))
    # tokens a program, one a thread (H200, T=2^20, k=8: 256 ran route 294 against 279 us at
    # E=128, index_shuffling 140 against 124 at E=64; 64 slower at E=64 too)
    cols_t = int(cfg.get("COLS_T", 128))
    if cols_t not in (64, 128, 256):  # the sizes checked on the GPU
        raise ValueError(f"COLS_T must be 64, 128 or 256: {cols_t}")
    if cols:  # one token a thread
        cfg.update(BLOCK_T=cols_t, SUB=1, num_warps=1 if INTERPRET else cols_t // 32)
    elif insert and "BLOCK_T" not in user:  # one row per thread, ~512 pairs per program
        cfg.update(BLOCK_T=64, SUB=1, num_warps=1 if INTERPRET else 2)
    block_t, sub = cfg["BLOCK_T"], cfg["SUB"]
    if block_t > (256 if insert else 32) or block_t & (block_t - 1) or sub & (sub - 1):
        raise ValueError(
            f"BLOCK_T must be a power of two <= 32 (256 with INSERT), SUB a power of two: {cfg}"
        )
    if sort and not insert and "SUB" not in user:
        # C sorts a program's pairs in registers: about _SORT_MAX of them where T allows
        # ~1024 programs (H200, T=2^20, E=128, k=8: 512 pairs per program with 4 warps in C
        # 550 / 697 us for index_shuffling / route; 2048 pairs 836 / 1000 us).
        n_blocks = cdiv(T, block_t)
        sub = max(1, min(_SORT_MAX // (block_t * k_pad), next_pow2(n_blocks // 1024 + 1) // 2))
    tok_per_prog = block_t * sub
    n_prog = cdiv(T, tok_per_prog)
    e_pad = max(next_pow2(E), 4)
    np_pad = max(next_pow2(n_prog), 2)
    chunk_t = max(1, min(tok_per_prog, 2048 // k_pad))
    fuse_scan = cfg.get("FUSE_SCAN", l_pad * np_pad <= _FUSE_SCAN_MAX)
    Lm = max(L, 1)
    l_bits = max(1, (Lm - 1).bit_length())
    idx_bits = (tok_per_prog * k_pad - 1).bit_length()
    if not sort and (tok_per_prog - 1).bit_length() + l_bits > 31:
        raise ValueError(f"too many experts ({L}) for this block size")
    # Weights of 16-bit scores (not renormalised) ride in the high half of A's packed choices
    # and in C's sort keys: no fp32 weight scratch written by A and gathered by C.
    pack_w = (
        bool(cfg.get("PACK_W", True)) and sort and with_weights and not renormalize
        and kind != 0 and l_bits + idx_bits <= 16
    )  # fmt: skip
    P = T * K
    n_hist = Lm * n_prog
    sizes = [
        P, P, P if with_weights else 0, P if with_weights else 0, E + 2 if with_tcpe else 0,
        Lm, L + 1 if with_offsets else 0, 0, n_hist, P, P if with_weights and not pack_w else 0,
    ]  # fmt: skip
    sizes[_N_OUT] = -sum(sizes[:_N_OUT]) % 4  # scratch starts 16-byte aligned
    a = dict(
        K=K,
        K_PAD=k_pad,
        E_PAD=e_pad,
        L_BITS=l_bits,
        BLOCK_T=block_t,
        SUB=sub,
        KIND=kind,
        HAS_VTC=has_vtc,
        WEIGHTS=with_weights,
        RENORM=renormalize,
        EVEN_E=e_pad == E,
        FULL_RANGE=start == 0 and end == E,
        SENT=-(2**63) if kind == 0 else -(2**31),
        RANKS=not sort,
        HB=2 * l_pad if sort else 2,
        OLD_INTERP=_OLD_INTERP,
        INSERT=insert,
        W=min(e_pad, 4 if kind == 0 else 8),
        # H200, T=2^20, E=128, k=8 (bf16), kernel A: 264 us with int32 keys and insertion, 201
        # with FKEY, 214 with MERGE, 174 with both (gpu/routing_ablation.py).
        FKEY=bool(cfg.get("FKEY", True)) and insert and kind != 0 and e_pad <= 128,
        MERGE=bool(cfg.get("MERGE", True)) and insert and k_pad == 8 and kind != 0 and e_pad >= 8,
        PACK_W=pack_w,
    )
    if cols:
        mode = (2 if kind == 1 else 3) + (2 if INTERPRET else 0)
        a = dict(K=K, E_PAD=e_pad, TP=cols_t, HAS_VTC=has_vtc,
                 FULL_RANGE=start == 0 and end == E, MODE=mode, WEIGHTS=with_weights)  # fmt: skip
        # TP * K slots a program for its sorted pairs, then its E_PAD run starts
        sizes[_SEG["packed"]] = n_prog * (cols_t * K + e_pad)
        sizes[_SEG["scr_w"]] = 0
    scan = None
    if L > 0 and not fuse_scan:
        # Long hist rows in one or two chunks with 8 warps (H200, T=2^20, E=128: 16384 programs;
        # B 12.4 us in 4096-wide chunks with 4 warps, 9.4 at 8192 and 9.2 at 16384 with 8).
        chunk = min(np_pad, cfg.get("SCAN_CHUNK", 16384))
        block_l = max(1, min(l_pad, 4096 // chunk))
        scan = (
            cdiv(L, block_l),
            dict(BLOCK_L=block_l, CHUNK=chunk, WHILE_LOOPS=INTERPRET),
            1 if INTERPRET else cfg.get("SCAN_WARPS", 8 if chunk >= 8192 else 4),
        )
    # C ranks by counting where the per-token count words are few (H200, T=2^20, k=8, bf16,
    # kernel C of index_shuffling: E=16 89 us vs 134 us sorting; E=128 297 vs 164 us).
    count = sort and tok_per_prog <= 255 and l_pad <= 128
    count = count and bool(cfg.get("COUNT", l_pad <= _COUNT_MAX_L))
    key64 = cfg.get("KEY64", l_bits + idx_bits > 30)  # int64 keys always work
    # index_shuffling (no weights, no inverse) with 16-32 local experts: C ranks by prefix sums
    # over the program's one-hot (token, expert) grid (H200, T=2^20, k=8, bf16, C: E=32 110 us
    # vs 143 sorting, E=16 79 vs 89 counting; E=128 376 vs 163 us sorting: a thread stores a
    # predicated key per token and expert, 64 per thread there; with weights slower everywhere).
    cumsum = sort and not key64 and not with_weights
    in_range = _CUMSUM_MIN_L <= l_pad <= _CUMSUM_MAX_L and not cfg.get("COUNT")
    cumsum = bool(cumsum and cfg.get("CUMSUM", in_range))
    count = count and not cumsum and not cols
    cumsum = cumsum and not cols
    c = dict(
        K=K,
        K_PAD=k_pad,
        L_PAD=l_pad,
        L_BITS=l_bits,
        NP_PAD=np_pad if fuse_scan else 1,
        TOK_PER_PROG=tok_per_prog,
        CHUNK_T=chunk_t,
        FUSE_SCAN=fuse_scan,
        WEIGHTS=with_weights,
        INVERSE=with_weights,
        OFFSETS=with_offsets,
        TCPE=with_tcpe,
        WHILE_LOOPS=INTERPRET,
        SORTED=sort,
        IDX_BITS=idx_bits,
        KEY64=key64,
        PACK_W=pack_w,
        IS_BF16=kind == 1,
        COUNT=count,
        # At least 4 words: a (tokens, 1) count tensor trips triton 3.6-3.8's
        # TritonGPUOptimizeThreadLocality pass (unused words stay zero).
        NW=max(4, (l_pad + 3) // 4) if count else 1,
        CUMSUM=cumsum,
        TOK_BITS=(tok_per_prog - 1).bit_length(),
        COLS=cols,
        RUNS=False,
    )
    if INTERPRET:
        c_warps = 1
    elif cols:  # H200, T=2^20, k=8, E=128, C of route writing the pairs: 8 warps 160 us, 4 169
        c_warps = cfg.get("C_WARPS", max(1, min(8, tok_per_prog * k_pad // 128)))
    elif sort:
        c_warps = cfg.get("C_WARPS", max(1, min(4, tok_per_prog * k_pad // 128)))
    else:
        c_warps = cfg.get("C_WARPS", max(1, min(4, chunk_t * k_pad // 256)))
    runs = None
    if cols and scan is not None and bool(cfg.get("RUNS", True)):
        # The sorted pairs by (group of P A-programs, local expert): one contiguous run each
        # (H200, T=2^20, E=128, k=8: C's stores in runs of ~8 pairs a program cost ~100 us).
        c["RUNS"] = True
        p_group = min(int(cfg.get("RUNS_P", 128)), np_pad)
        runs = (
            L * cdiv(n_prog, p_group),
            dict(
                K=K,
                TP=cols_t,
                E_PAD=e_pad,
                L_PAD=l_pad,
                P=p_group,
                QB=int(cfg.get("RUNS_QB", 1024)),
                WEIGHTS=with_weights,
                IS_BF16=kind == 1,
                WHILE_LOOPS=INTERPRET,
            ),  # fmt: skip
            1 if INTERPRET else int(cfg.get("RUNS_WARPS", 4)),
        )
    starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    return _Launch(n_prog, tuple(sizes), starts, a, cfg["num_warps"], scan, c, c_warps, runs)


@functools.lru_cache(maxsize=16)
def _sm_count(dev: int) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _fusable(p: _Launch, dev: torch.device, config: dict | None) -> bool:
    """Whether a one-buffer call runs A and C as one launch (``_fused_kernel``): on the GPU, no
    scan or D launch, at most one program per SM (so a cooperative launch always fits), not
    while a CUDA graph is captured (the barrier words are per stream), unless config FUSED=0."""
    return (
        not INTERPRET
        and p.scan is None
        and p.runs is None
        and p.c["FUSE_SCAN"]
        and bool((config or {}).get("FUSED", True))
        and dev.type == "cuda"
        and p.n_prog <= _sm_count(dev.index if dev.index is not None else 0)
        and not torch.cuda.is_current_stream_capturing()
    )


def _fused_constexprs(p: _Launch) -> dict:
    """``_fused_kernel``'s constexprs: A's and C's (shared names agree), the other A's dummies."""
    cols = p.c["COLS"]
    dummies = dict(
        K_PAD=p.c["K_PAD"], E_PAD=4, L_BITS=p.c["L_BITS"], BLOCK_T=1, SUB=1, KIND=0,
        HAS_VTC=False, RENORM=False, EVEN_E=True, FULL_RANGE=True, SENT=0, RANKS=False, HB=2,
        OLD_INTERP=False, INSERT=False, W=1, FKEY=False, MERGE=False, PACK_W=p.c["PACK_W"],
        TP=32, MODE=0,
    )  # fmt: skip
    shared = set(p.a) & set(p.c)
    if any(p.a[n] != p.c[n] for n in shared):  # pragma: no cover - a plan-building bug
        raise AssertionError(f"A's and C's constexprs disagree: {sorted(shared)}")
    return {"COLS_A": cols, **dummies, **p.a, **p.c}


def _fused_args(a: tuple, c: tuple, bar: object) -> tuple:
    """``_fused_kernel``'s runtime arguments from A's and C's (``_kernel_args``)."""
    x, stride_t, stride_e, stride_w, vtc, packed, a_w, hist, T, E, start, end, n_prog = a
    _, scr_w, inverse, _, counts, expert, token, weights, offsets, tcpe, _, _, L, _, _ = c
    return (x, vtc, bar, packed, a_w, hist, scr_w, inverse, counts, expert, token, weights,
            offsets, tcpe, stride_t, stride_e, stride_w, T, E, L, start, end, n_prog)  # fmt: skip


def _kernel_args(
    p: _Launch,
    seg: list,
    x: object,
    strides: tuple[int, int],
    vtc: object | None,
    T: int,
    E: int,
    start: int,
    end: int,
    with_weights: bool,
    with_offsets: bool,
    with_tcpe: bool,
) -> tuple[tuple, tuple, tuple, tuple]:
    """Runtime arguments of kernels A, B, C and D (``_expert_runs_kernel``) in signature order.
    ``seg`` holds the buffer segments in ``_SEGMENTS`` order, ``x`` the scores and ``vtc`` the
    valid count, either all as tensors (typed views) or all as int addresses. Unused pointers
    alias used ones."""
    expert, token, weights, inverse, tcpe, counts, offsets, _, hist, packed, scr_w = seg
    if not p.sizes[_SEG["scr_w"]]:
        scr_w = packed
    if not with_weights:
        weights, inverse = scr_w, packed
    if not with_offsets:
        offsets = counts
    if not with_tcpe:
        tcpe = counts
    L = end - start
    stride_w = strides[0] // 2 if p.c["COLS"] else 0  # _topk_cols_kernel's
    a_w = inverse if p.c["COLS"] else scr_w  # COLS: A writes route's inverse entries
    a = (x, *strides, stride_w, expert if vtc is None else vtc, packed, a_w, hist, T, E, start,
         end, p.n_prog)  # fmt: skip
    b = (hist, counts, L, p.n_prog)
    c = (packed, scr_w, inverse, hist, counts, expert, token, weights, offsets, tcpe, T, E, L,
         start, p.n_prog)  # fmt: skip
    d = (packed, hist, counts, expert, token, weights, L, start, p.n_prog)
    return a, b, c, d


# routing_triton's outputs, in its order, and which of them a call returns
_OUTPUTS = ("counts", "offsets", "expert", "token", "weights", "inverse", "tcpe")


def _returned(with_weights: bool, with_offsets: bool, with_tcpe: bool) -> tuple[bool, ...]:
    """Per name of ``_OUTPUTS``: whether it is returned (``counts`` only for route, with
    weights or offsets; index_shuffling's ``counts`` is C's scratch)."""
    ww, wo = with_weights, with_offsets
    return (ww or wo, wo, True, True, ww, ww, with_tcpe)


def _out_split(
    p: _Launch, with_weights: bool, with_offsets: bool, with_tcpe: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The one buffer split into pieces (in buffer order): every returned output segment and
    every non-empty one between them, then the rest; and which piece is each of ``_OUTPUTS``,
    -1 where it is not returned."""
    returned = dict(zip(_OUTPUTS, _returned(with_weights, with_offsets, with_tcpe), strict=True))
    names = _SEGMENTS[:_N_OUT]
    last = max(i for i, name in enumerate(names) if returned[name])
    split: list[int] = []
    index: dict[str, int] = {}
    for name in names[: last + 1]:
        size = p.sizes[_SEG[name]]
        if returned[name]:
            index[name] = len(split)
        if size or returned[name]:
            split.append(size)
    split.append(sum(p.sizes) - sum(split))
    return tuple(split), tuple(index.get(name, -1) for name in _OUTPUTS)


def _outputs(seg: list, T: int, top_k: int, L: int, *flags: bool) -> tuple:
    """routing_triton's outputs from the typed launch's segments (``_SEGMENTS`` order)."""
    pieces = tuple(
        _SEG[name] if ret else -1 for name, ret in zip(_OUTPUTS, _returned(*flags), strict=True)
    )
    out = lane.assemble(seg, pieces, T, top_k)
    if L == 0 and out[0] is not None:  # an empty expert range: no counts (the segment holds 1)
        out = (out[0][:0], *out[1:])
    return out


def routing_triton(
    scores_TE: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    start: int,
    end: int,
    renormalize: bool,
    with_weights: bool,
    with_offsets: bool,
    with_tcpe: bool,
    config: dict[str, int] | None = None,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Launch the kernels for T > 0 (arguments already checked). Returns ``(counts, offsets,
    expert, token, weights, inverse, tcpe)``; ``offsets`` is None unless ``with_offsets``,
    ``weights`` and ``inverse`` unless ``with_weights``, ``counts`` unless either, ``tcpe``
    (E+2,) unless ``with_tcpe``.

    ``one_buffer`` allocates outputs and scratch at once and returns views of it (eager calls:
    one allocation instead of eight; not for custom ops, whose outputs must not alias); such
    calls bind their launches for the next call with the same key (``eager_key``, by default
    ``routing_eager.eager_key`` of the arguments; see that module) and may run A and C as one
    launch (``_fusable``). ``config`` overrides the launcher's block sizes (tests, benchmarks)."""
    T, E = scores_TE.shape
    converted = scores_TE.dtype != torch.float32 and E > 2**16
    if converted:  # 16-bit keys hold the expert in 16 bits; fp32 is exact (never bound: a copy)
        scores_TE = scores_TE.float()
    vtc = valid_token_count
    flags = (with_weights, with_offsets, with_tcpe)
    cfg_key = tuple(sorted(config.items())) if config else None
    key = None
    if one_buffer and not converted and fast_path_open():
        key = eager_key
        if key is None:  # (a public call's lane has looked its own key up already)
            key = lane.eager_key(scores_TE, top_k, vtc, start, end, renormalize, *flags, cfg_key)
            out = lane.bound_call(key, scores_TE, vtc)
            if out is not None:
                return out
    kind = _KIND[scores_TE.dtype]
    plan_key = (
        T, E, top_k, start, end, kind, renormalize, vtc is not None, *flags, cfg_key, one_buffer,
    )  # fmt: skip
    words = (
        kind != 0 and scores_TE.stride(1) == 1 and scores_TE.stride(0) % 2 == 0
        and scores_TE.data_ptr() % 4 == 0
    )  # fmt: skip
    p = _launch_plan(*plan_key, words)
    dev = scores_TE.device
    grids = (p.n_prog, p.scan[0] if p.scan else 0, p.n_prog, p.runs[0] if p.runs else 0)
    i32 = torch.int32
    if one_buffer:
        buf = torch.empty(sum(p.sizes), dtype=i32, device=dev)
        seg = list(buf.split_with_sizes(p.sizes))
    else:
        out = [torch.empty(n, dtype=i32, device=dev) for n in p.sizes[:_N_OUT]]
        scratch = p.sizes[_N_OUT + 1 :]  # without the pad: it starts 16-byte aligned as it is
        seg = (
            out
            + [out[0][:0]]
            + list(torch.empty(sum(scratch), dtype=i32, device=dev).split(scratch))
        )
    x = scores_TE if kind == 0 else scores_TE.view(torch.int16)
    strides = scores_TE.stride()
    typed = list(seg)
    for i in (_SEG["weights"], _SEG["scr_w"]):  # fp32 bits
        typed[i] = seg[i].view(torch.float32)
    args = _kernel_args(p, typed, x, strides, vtc, T, E, start, end, *flags)
    # (kernel, grid, constexprs, options, its runtime arguments from _kernel_args' and the
    # barrier words: as tensors now, as Rel markers for the bound relaunch)
    launches: list[tuple[FastKernel, int, dict, dict, Callable[[tuple, object], tuple]]] = []
    if one_buffer and _fusable(p, dev, config):
        bar = barrier_words(dev.index, current_stream(dev.index))
        opts = dict(num_warps=p.a_warps, launch_cooperative_grid=True)
        launches.append((_fused, p.n_prog, _fused_constexprs(p), opts,
                         lambda a, b: _fused_args(a[0], a[2], b)))  # fmt: skip
    else:
        bar = None
        ka = _topk_cols if p.c["COLS"] else _topk_rank
        launches.append((ka, grids[0], p.a, dict(num_warps=p.a_warps), lambda a, b: a[0]))
        if p.scan is not None:
            launches.append((_scan, grids[1], p.scan[1], dict(num_warps=p.scan[2]),
                             lambda a, b: a[1]))  # fmt: skip
        launches.append((_place, grids[2], p.c, dict(num_warps=p.c_warps), lambda a, b: a[2]))
        if p.runs is not None:
            launches.append((_expert_runs, grids[3], p.runs[1], dict(num_warps=p.runs[2]),
                             lambda a, b: a[3]))  # fmt: skip
    handles = [kern.launch((g,), pick(args, bar), consts, **opts)
               for kern, g, consts, opts, pick in launches]  # fmt: skip
    # an empty expert range is not bound: its counts output is a slice of its segment
    if key is not None and end > start and all(handles) and not buf.data_ptr() & 15:
        split, pieces = _out_split(p, *flags)
        marks = _kernel_args(
            p, [Rel(0, 4 * s) for s in p.starts], Rel(1, 0), strides,
            None if vtc is None else Rel(2, 0), T, E, start, end, *flags,
        )  # fmt: skip
        bound = BoundLaunches([
            (h, g, pick(marks, Rel(3, 0)))
            for h, (_, g, _, _, pick) in zip(handles, launches, strict=True)
        ])  # fmt: skip
        lane.bind(key, lane.Eager(
            sum(p.sizes), split, pieces, bound, None if bar is None else barrier_words, dev, T,
            top_k,
        ))  # fmt: skip
    return _outputs(seg, T, top_k, end - start, *flags)
