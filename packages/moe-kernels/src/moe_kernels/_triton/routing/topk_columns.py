"""Kernel A of the ``columns`` plan: top-k by threshold, token columns, pairs placed in A.

One token a thread, TP tokens a program. Each token's chosen experts as a 128-bit mask
(``threshold``), masked to the expert range and the valid tokens, transposed warp by warp into
per-expert words of token bits (the program's columns; inline PTX butterflies, a tensor
reduction in the interpreter). Their popcounts are the program's histogram and place each pair
among the program's pairs sorted by (expert, token): the expert's run start for the token's warp
plus the popcount of the expert's column word below the token's bit, read from the expert's lane
by shuffles. Route also gets each token's choices by descending score as ``inverse`` entries
(place | local expert << PB), which C turns into positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import popc
from .threshold import keep_lowest, threshold_masks


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
    # One line: Inductor embeds this constant in the source it writes for a compiled call, and
    # torch 2.11 writes a newline in it as a raw one (an unterminated string literal there).
    return " ".join([*lines, "}"])


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
    e = w * 32 + popc(bit - 1, ASM)
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
    (for ``expert_runs_kernel``)."""
    n = tl.reshape(popc(c, ASM), [TP // 32, 32])
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
    place = pre + popc(word & ~(-1 << u), ASM)
    le = e - start
    pid = tl.program_id(0)
    TB: tl.constexpr = 8 if TP > 128 else 7  # bits of the token in the program
    PB: tl.constexpr = 11 if TP * K > 1024 else 10  # bits of the place
    tl.store(srt_ptr + pid * TP * K + place, (rows - pid * TP) | (le << TB) | hi,
             mask=routed & row_ok)  # fmt: skip
    return tl.where(routed, place | (le << PB), -1), key, s0, s1, s2, s3


@triton.jit
def store_presorted(
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
def topk_columns_kernel(
    x_ptr,  # (T, E) 16-bit scores as int16; rows of 4-byte aligned pairs (stride_w words)
    stride_t,
    stride_e,
    stride_w,
    vtc_ptr,
    pack_ptr,  # int32 out: TP * K slots a program for its placed pairs, then (programs, E_PAD)
    # run starts (store_presorted)
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
    MODE: tl.constexpr,  # h2_op's: 2 / 3 bf16 / fp16 by PTX, 4 / 5 emulated (interpreter)
    WEIGHTS: tl.constexpr,  # route (COLS_ROUTE): weights and inverse entries too
):
    """Kernel A of the token-column plan (``COLS``): TP tokens a program, one a thread.
    Each token's chosen experts as a 128-bit mask (``threshold_masks``, ``keep_lowest``),
    masked to the expert range and the valid tokens; transposed to per-expert words of token
    bits (the program's columns), whose popcounts place each pair among the program's pairs in
    sorted order (``store_presorted``)."""
    ASM: tl.constexpr = MODE <= 3
    pid = tl.program_id(0)
    rows = pid * TP + tl.arange(0, TP)
    row_ok = rows < T
    gt0, gt1, gt2, gt3, eq0, eq1, eq2, eq3, n_gt = threshold_masks(
        x_ptr, rows.to(tl.int64), row_ok, stride_w, K, E_PAD, TP, MODE
    )
    eq0, eq1, eq2, eq3 = keep_lowest(eq0, eq1, eq2, eq3, K - n_gt, ASM)
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
    store_presorted(pack_ptr, scr_w_ptr.to(tl.pointer_type(tl.int32)), hist_ptr, x_ptr, rows,
                     row_ok, routed, stride_t, gt0 | eq0, gt1 | eq1, gt2 | eq2, gt3 | eq3, c0, c1,
                     c2, c3, start, end, n_programs, K, MODE % 2 + 1, TP, E_PAD, ASM,
                     WEIGHTS)  # fmt: skip
