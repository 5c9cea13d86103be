"""Kernel C's placements for the row families: A stored each pair's local expert (ranked: with
its rank inside the expert), C writes every pair to its sorted position, ``inverse`` (route)
and the -1 / 0 tail. WEIGHTS: route (weights and ``inverse``); else index_shuffling."""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import bits16_to_f32


@triton.jit
def load_choices(pack_ptr, offs, m, PACK_W: tl.constexpr):
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
    NR: tl.constexpr, K_PAD: tl.constexpr, WEIGHTS: tl.constexpr,
):  # fmt: skip
    """(NR tokens, K_PAD choices) in token order: each routed pair's expert, token and weight
    at its sorted position ``pos`` (scattered 4-byte stores), ``inverse`` = pos (-1 unrouted), and
    the -1 / 0 tail at the pairs' own flat indices ``offs`` >= n."""
    if WEIGHTS:
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
def place_ranked_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, L_BITS: tl.constexpr, TOK_PER_PROG: tl.constexpr, CHUNK_T: tl.constexpr,
    WEIGHTS: tl.constexpr,
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
            CHUNK_T, K_PAD, WEIGHTS,
        )  # fmt: skip


@triton.jit
def place_counted_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, NW: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    WEIGHTS: tl.constexpr, PACK_W: tl.constexpr, IS_BF16: tl.constexpr,
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
        _, le_j, ok_j = load_choices(pack_ptr, rows * K + j, row_ok & (j < K), PACK_W)
        hit = ((le_j >> 2)[:, None] == words[None, :]) & ok_j[:, None]
        inc += tl.where(hit, (1 << ((le_j & 3) * 8))[:, None], 0)
    before = tl.cumsum(inc, axis=0) - inc  # (tokens, words): counts over earlier tokens

    jj = tl.arange(0, K_PAD)
    m = row_ok[:, None] & (jj[None, :] < K)
    offs = rows[:, None] * K + jj[None, :]
    word, le, routed = load_choices(pack_ptr, offs, m, PACK_W)
    le0 = tl.where(routed, le, 0)
    rank = (tl.gather(before, le0 >> 2, 1) >> ((le0 & 3) * 8)) & 0xFF
    b = tl.gather(base, tl.reshape(le0, [TOK_PER_PROG * K_PAD]), 0)
    pos = tl.where(routed, tl.reshape(b, [TOK_PER_PROG, K_PAD]) + rank, -1)
    if WEIGHTS and PACK_W:
        wv = bits16_to_f32((word >> 16) & 0xFFFF, IS_BF16)
    elif WEIGHTS:
        wv = tl.load(scr_w_ptr + offs, mask=m, other=0.0)
    else:
        wv = tl.zeros([TOK_PER_PROG, K_PAD], tl.float32)
    _store_in_token_order(
        pos, le, wv, rows, offs, m, routed, n, inverse_ptr, expert_ptr, token_ptr, weight_ptr,
        TOK_PER_PROG, K_PAD, WEIGHTS,
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
def place_sorted_pairs(
    pack_ptr, scr_w_ptr, inverse_ptr, base, lb, expert_ptr, token_ptr, weight_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, L_PAD: tl.constexpr, TOK_PER_PROG: tl.constexpr,
    IDX_BITS: tl.constexpr, WEIGHTS: tl.constexpr, PACK_W: tl.constexpr,
    IS_BF16: tl.constexpr, CUMSUM: tl.constexpr, TOK_BITS: tl.constexpr,
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
    word, le, routed = load_choices(pack_ptr, offs, m, PACK_W)
    if WEIGHTS:
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
    if WEIGHTS:
        tl.store(inverse_ptr + src, pos, mask=ok)
    if WEIGHTS:
        if PACK_W:
            wv = bits16_to_f32(key & 0xFFFF, IS_BF16)
        else:
            wv = tl.load(scr_w_ptr + src, mask=ok, other=0.0)
        tl.store(weight_ptr + pos, wv, mask=ok)
