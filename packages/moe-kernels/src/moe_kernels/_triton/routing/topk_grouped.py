"""Kernel A of route's selection options: a selection bias, expert groups, scaled weights.

Each block of rows is one (rows, groups, experts of a group) tile of fp32 selection values
``score + bias`` (NaN as -inf, -0.0 as +0.0; expert ``g * EG + i`` at [g, i], padding -inf).
With groups (``TOPK_G < G``), a group's score is the sum of its two largest values (duplicates
count twice; a NaN sum ranks as -inf) and each row keeps the ``TOPK_G`` best groups, ranked by
comparing every pair of groups (ties to the lower group); the others' experts drop to the
sentinel, below every real key. Then ``top_k`` rounds of row maxima (over a group's experts, then
over the groups) of unique int64 keys
(the value's order-preserving code above the padded column, ties to the lower expert) give the
choices in descending selection order. Weights are the unbiased scores reloaded from memory,
renormalised (sequential sum, as the reference adds) and scaled. The rest is kernel A's
contract for the sorted placements (``topk_rows``): bare local choices in ``pack`` (-1 when not
routed), fp32 weights in ``scr_w``, the program's histogram in ``hist``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import bits16_to_f32
from .networks import insert4, split8, stack8, take8


@triton.jit
def _load_scores(x_ptr, offs, mask, KIND: tl.constexpr):
    """fp32 scores at ``offs`` (raw int16 bits for 16-bit kinds), 0 where masked."""
    if KIND == 0:
        return tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        bits = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)  # sign-extended
        return bits16_to_f32(bits, KIND == 1)


@triton.jit
def _best_groups(score, gg, TOPK_G: tl.constexpr):
    """(rows, G_PAD) bool: each row's TOPK_G best groups by ``score`` (NaN ranking as -inf), by
    comparing every pair of groups (ties to the lower group)."""
    score = tl.where(score != score, float("-inf"), score)
    s_h = score[:, None, :]  # [row, g, h]: group h beats group g
    s_g = score[:, :, None]
    beats = (s_h > s_g) | ((s_h == s_g) & (gg[None, None, :] < gg[None, :, None]))
    return tl.sum(beats.to(tl.int32), axis=2) < TOPK_G


@triton.jit
def _allowed_groups(v, gg, EG: tl.constexpr, TOPK_G: tl.constexpr):
    """(rows, G_PAD) bool: each row's TOPK_G best groups of the (rows, G_PAD, EG_PAD) values
    ``v`` (padding -inf; padded groups have the highest indices, so they rank last)."""
    m1 = tl.max(v, axis=2)
    if EG > 1:
        top = v == m1[:, :, None]
        n_top = tl.sum(top.to(tl.int32), axis=2)
        m2 = tl.max(tl.where(top, float("-inf"), v), axis=2)
        s = m1 + tl.where(n_top > 1, m1, m2)
    else:
        s = m1
    return _best_groups(s, gg, TOPK_G)


@triton.jit
def _codes(v):
    """fp32 values (NaN already -inf) -> int32 codes in the same order."""
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _rank_order(v):
    """NaN as -inf, -0.0 as +0.0."""
    v = tl.where(v != v, float("-inf"), v)
    return tl.where(v == 0.0, 0.0, v)


@triton.jit
def _tile_topk(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, jj, K: tl.constexpr,
               K_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr,
               EG_PAD: tl.constexpr, TOPK_G: tl.constexpr, KIND: tl.constexpr,
               HAS_BIAS: tl.constexpr):  # fmt: skip
    """(rows, K_PAD) int32 choices by rounds of row maxima over the rows' whole
    (rows, G_PAD, EG_PAD) tile (any top_k)."""
    gg = tl.arange(0, G_PAD)
    ii = tl.arange(0, EG_PAD)
    e3 = gg[:, None] * EG + ii[None, :]  # (G_PAD, EG_PAD) expert of each tile column
    ok3 = (gg[:, None] < G) & (ii[None, :] < EG)
    # unique low key bits: the padded column, reversed (ties to the lower expert)
    low3 = (G_PAD * EG_PAD - 1 - (gg[:, None] * EG_PAD + ii[None, :])).to(tl.int64)
    offs = rows64[:, None, None] * stride_t + e3[None, :, :].to(tl.int64) * stride_e
    v = _load_scores(x_ptr, offs, row_ok[:, None, None] & ok3[None, :, :], KIND)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + e3, mask=ok3, other=0.0)[None, :, :]
    v = tl.where(ok3[None, :, :], _rank_order(v), float("-inf"))
    key = (_codes(v).to(tl.int64) << 32) | low3[None, :, :]
    live = ok3[None, :, :]
    if TOPK_G < G:
        live = live & _allowed_groups(v, gg, EG, TOPK_G)[:, :, None]
    key = tl.where(live, key, -(2**63))
    # the row maximum (over experts, then groups: a reshape of the tile miscompiled on the
    # H200) is unique; remember it, then knock it out
    mk = tl.full([key.shape[0], K_PAD], -(2**63), dtype=tl.int64)
    for j in range(K):
        m = tl.max(tl.max(key, axis=2), axis=1)
        key = tl.where(key == m[:, None, None], -(2**63), key)
        mk = tl.where(jj[None, :] == j, m[:, None], mk)
    col = G_PAD * EG_PAD - 1 - (mk & 0xFFFFFFFF).to(tl.int32)
    return (col // EG_PAD) * EG + col % EG_PAD


@triton.jit
def _chunk(x_ptr, bias_ptr, rows64, row_ok, cols, ok, stride_t, stride_e, KIND: tl.constexpr,
           HAS_BIAS: tl.constexpr):  # fmt: skip
    """(rows, W) selection values of columns ``cols`` in rank order, -inf where not ``ok``."""
    offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
    v = _load_scores(x_ptr, offs, row_ok[:, None] & ok[None, :], KIND)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=ok, other=0.0)[None, :]
    return tl.where(ok[None, :], _rank_order(v), float("-inf"))


@triton.jit
def _split(v, BLOCK_T: tl.constexpr, W: tl.constexpr):
    """(BLOCK_T, W) -> its W (4 or 8) columns; W == 4 repeats them (the last four unused)."""
    if W == 8:
        return split8(v, BLOCK_T)
    else:
        a, b = tl.split(tl.reshape(v, [BLOCK_T, 2, 2]))
        c0, c2 = tl.split(a)
        c1, c3 = tl.split(b)
        return c0, c1, c2, c3, c0, c1, c2, c3


@triton.jit
def _top2(m1, m2, x):
    """The running two largest (duplicates count) after x."""
    return tl.maximum(m1, x), tl.maximum(m2, tl.minimum(m1, x))


@triton.jit
def _group_bits(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, BLOCK_T: tl.constexpr,
                W: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr,
                TOPK_G: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """(rows,) int32: bit g set for each of the row's TOPK_G best groups (a thread a row: the
    running top two of each group, W scores a load)."""
    gg = tl.arange(0, G_PAD)
    ww = tl.arange(0, W)
    score = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
    for g in range(G):
        m1 = tl.full([BLOCK_T], float("-inf"), tl.float32)
        m2 = m1
        for c in range(0, EG, W):
            v = _chunk(x_ptr, bias_ptr, rows64, row_ok, g * EG + c + ww, c + ww < EG,
                       stride_t, stride_e, KIND, HAS_BIAS)  # fmt: skip
            v0, v1, v2, v3, v4, v5, v6, v7 = _split(v, BLOCK_T, W)
            m1, m2 = _top2(m1, m2, v0)
            m1, m2 = _top2(m1, m2, v1)
            m1, m2 = _top2(m1, m2, v2)
            m1, m2 = _top2(m1, m2, v3)
            if W == 8:
                m1, m2 = _top2(m1, m2, v4)
                m1, m2 = _top2(m1, m2, v5)
                m1, m2 = _top2(m1, m2, v6)
                m1, m2 = _top2(m1, m2, v7)
        if EG > 1:
            s = m1 + m2
        else:
            s = m1
        score = tl.where(gg[None, :] == g, s[:, None], score)
    allowed = _best_groups(score, gg, TOPK_G)
    return tl.sum(tl.where(allowed, 1 << gg[None, :], 0), axis=1)


@triton.jit
def _insert_topk(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, E, jj,
                 BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                 W: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr,
                 TOPK_G: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
                 MERGE: tl.constexpr):  # fmt: skip
    """(rows, K_PAD) int32 choices (K_PAD <= 8) by per-thread insertion of unique int64 keys
    (``networks``), W scores a load; with groups, a first pass ranks them (``_group_bits``)
    and the experts of the others enter as the sentinel."""
    if TOPK_G < G:
        gbits = _group_bits(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, BLOCK_T, W, G,
                            G_PAD, EG, TOPK_G, KIND, HAS_BIAS)  # fmt: skip
    ww = tl.arange(0, W)
    t0 = tl.full([BLOCK_T], -(2**63), tl.int64)
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    t6 = t0
    t7 = t0
    for c0 in range(0, E_PAD, W):
        cols = c0 + ww
        ok = cols < E
        v = _chunk(x_ptr, bias_ptr, rows64, row_ok, cols, ok, stride_t, stride_e, KIND,
                   HAS_BIAS)  # fmt: skip
        key = (_codes(v).to(tl.int64) << 32) | (E_PAD - 1 - cols)[None, :].to(tl.int64)
        live = ok[None, :]
        if TOPK_G < G:
            live = live & (((gbits[:, None] >> (cols // EG)[None, :]) & 1) != 0)
        key = tl.where(live, key, -(2**63))
        k0, k1, k2, k3, k4, k5, k6, k7 = _split(key, BLOCK_T, W)
        if MERGE:
            t0, t1, t2, t3, t4, t5, t6, t7 = take8(
                t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, k4, k5, k6, k7, 0
            )
        else:
            t0, t1, t2, t3, t4, t5, t6, t7 = insert4(
                t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD, 0
            )
            if W == 8:
                t0, t1, t2, t3, t4, t5, t6, t7 = insert4(
                    t0, t1, t2, t3, t4, t5, t6, t7, k4, k5, k6, k7, K_PAD, 0
                )
    mk = stack8(t0, t1, t2, t3, t4, t5, t6, t7, jj, K_PAD, -(2**63))
    return E_PAD - 1 - (mk & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def topk_grouped_kernel(
    x_ptr,  # (T, E) scores; int16 view for 16-bit floats, fp32 otherwise
    stride_t,
    stride_e,
    stride_w,  # unused (the signature is topk_rows_kernel's)
    vtc_ptr,  # (1,) int32/int64 valid token count (unused when not HAS_VTC)
    pack_ptr,  # (T, K) int32 out: local expert of each choice, or -1
    scr_w_ptr,  # (T, K) fp32 out: weight of each choice
    hist_ptr,  # (L, n_programs) int32 out: pairs per local expert and program
    T,
    E,
    start,
    end,
    n_programs,
    bias_ptr,  # (E,) fp32 selection bias (unused when not HAS_BIAS)
    scale,  # fp32 weight scale (unused when not SCALED)
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    G: tl.constexpr,  # expert groups (1: none)
    G_PAD: tl.constexpr,
    EG: tl.constexpr,  # experts a group: E // G
    EG_PAD: tl.constexpr,
    TOPK_G: tl.constexpr,  # groups a token chooses among (G: all)
    BLOCK_T: tl.constexpr,
    SUB: tl.constexpr,
    KIND: tl.constexpr,  # 0: fp32, 1: bf16, 2: fp16
    HAS_VTC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    SCALED: tl.constexpr,
    FULL_RANGE: tl.constexpr,  # start == 0 and end == E: no range masks
    HB: tl.constexpr,  # histogram bins: 2 * L_PAD (bin L_PAD counts the unrouted)
    OLD_INTERP: tl.constexpr,  # triton < 3.6 interpreter: the histogram by one-hot sums
    INSERT: tl.constexpr,  # per-thread insertion (K_PAD <= 8), else rounds over a tile
    W: tl.constexpr,  # INSERT: scores a load (16 bytes)
    MERGE: tl.constexpr,  # INSERT: sort each load's 8 keys and merge (K_PAD == W == 8)
):
    pid = tl.program_id(0)
    n_valid = T
    if HAS_VTC:
        vtc = tl.load(vtc_ptr).to(tl.int64)
        n_valid = tl.minimum(tl.maximum(vtc, 0), T).to(tl.int32)
    jj = tl.arange(0, K_PAD)
    k_ok = jj[None, :] < K
    bins = tl.arange(0, HB)
    local_hist = tl.zeros([HB], dtype=tl.int32)
    for s in range(SUB):
        rows = (pid * SUB + s) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        if INSERT:
            choice = _insert_topk(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, E, jj,
                                  BLOCK_T, K_PAD, E_PAD, W, G, G_PAD, EG, TOPK_G, KIND, HAS_BIAS,
                                  MERGE)  # fmt: skip
        else:
            choice = _tile_topk(x_ptr, bias_ptr, rows64, row_ok, stride_t, stride_e, jj, K, K_PAD,
                                G, G_PAD, EG, EG_PAD, TOPK_G, KIND, HAS_BIAS)  # fmt: skip
        choice = tl.where(k_ok, choice, 0)

        routed_row = row_ok
        if HAS_VTC:
            routed_row = routed_row & (rows < n_valid)
        routed = routed_row[:, None] & k_ok
        if not FULL_RANGE:
            routed = routed & (choice >= start) & (choice < end)
        out_offs = rows[:, None] * K + jj[None, :]
        st_mask = row_ok[:, None] & k_ok
        w_offs = rows64[:, None] * stride_t + choice.to(tl.int64) * stride_e
        w = _load_scores(x_ptr, w_offs, st_mask, KIND)
        if RENORM:
            wsum = tl.sum(tl.where(jj[None, :] == 0, w, 0.0), axis=1)
            for j in range(1, K):  # in choice order, as the reference adds
                wsum = wsum + tl.sum(tl.where(jj[None, :] == j, w, 0.0), axis=1)
            w = tl.math.div_rn(w, wsum[:, None])
        if SCALED:  # fp32 also where Inductor passes the float as fp64
            w = w * tl.cast(scale, tl.float32)
        tl.store(scr_w_ptr + out_offs, w, mask=st_mask)
        le = tl.reshape(tl.where(routed, choice - start, HB // 2), [BLOCK_T * K_PAD])
        if OLD_INTERP:
            local_hist += tl.sum((le[:, None] == bins[None, :]).to(tl.int32), axis=0)
        else:
            local_hist += tl.histogram(le, HB)
        tl.store(pack_ptr + out_offs, tl.where(routed, choice - start, -1), mask=st_mask)
    tl.store(hist_ptr + bins * n_programs + pid, local_hist, mask=bins < end - start)
