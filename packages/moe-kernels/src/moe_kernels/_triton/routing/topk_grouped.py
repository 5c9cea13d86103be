"""Kernel A of route's selection options: a selection bias, expert groups, scaled weights.

Each block of rows is one (rows, groups, experts of a group) tile of fp32 selection values
``score + bias`` (NaN as -inf, -0.0 as +0.0; expert ``g * EG + i`` at [g, i], padding -inf).
With groups (``TOPK_G < G``), a group's score is the sum of its two largest values (duplicates
count twice; a NaN sum ranks as -inf) and each row keeps the ``TOPK_G`` best groups, ranked by
comparing every pair of groups (ties to the lower group); the others' experts drop to the
sentinel, below every real key. Then ``top_k`` rounds of row maxima over unique int64 keys
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


@triton.jit
def _load_scores(x_ptr, offs, mask, KIND: tl.constexpr):
    """fp32 scores at ``offs`` (raw int16 bits for 16-bit kinds), 0 where masked."""
    if KIND == 0:
        return tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        bits = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)  # sign-extended
        return bits16_to_f32(bits, KIND == 1)


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
    s = tl.where(s != s, float("-inf"), s)
    s_h = s[:, None, :]  # [row, g, h]: group h beats group g
    s_g = s[:, :, None]
    beats = (s_h > s_g) | ((s_h == s_g) & (gg[None, None, :] < gg[None, :, None]))
    return tl.sum(beats.to(tl.int32), axis=2) < TOPK_G


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
):
    pid = tl.program_id(0)
    n_valid = T
    if HAS_VTC:
        vtc = tl.load(vtc_ptr).to(tl.int64)
        n_valid = tl.minimum(tl.maximum(vtc, 0), T).to(tl.int32)
    gg = tl.arange(0, G_PAD)
    ii = tl.arange(0, EG_PAD)
    e3 = gg[:, None] * EG + ii[None, :]  # (G_PAD, EG_PAD) expert of each tile column
    ok3 = (gg[:, None] < G) & (ii[None, :] < EG)
    # unique low key bits: the padded column, reversed (ties to the lower expert)
    low3 = (G_PAD * EG_PAD - 1 - (gg[:, None] * EG_PAD + ii[None, :])).to(tl.int64)
    if HAS_BIAS:
        bias3 = tl.load(bias_ptr + e3, mask=ok3, other=0.0)
    jj = tl.arange(0, K_PAD)
    k_ok = jj[None, :] < K
    bins = tl.arange(0, HB)
    local_hist = tl.zeros([HB], dtype=tl.int32)
    for s in range(SUB):
        rows = (pid * SUB + s) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None, None] * stride_t + e3[None, :, :].to(tl.int64) * stride_e
        v = _load_scores(x_ptr, offs, row_ok[:, None, None] & ok3[None, :, :], KIND)
        if HAS_BIAS:
            v = v + bias3[None, :, :]
        v = tl.where(v != v, float("-inf"), v)
        v = tl.where(v == 0.0, 0.0, v)
        v = tl.where(ok3[None, :, :], v, float("-inf"))
        bits = v.to(tl.int32, bitcast=True)
        code = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (code.to(tl.int64) << 32) | low3[None, :, :]
        live = ok3[None, :, :]
        if TOPK_G < G:
            live = live & _allowed_groups(v, gg, EG, TOPK_G)[:, :, None]
        key = tl.reshape(tl.where(live, key, -(2**63)), [BLOCK_T, G_PAD * EG_PAD])
        # top_k rounds: the row maximum is unique; remember it, then knock it out
        mk = tl.full([BLOCK_T, K_PAD], -(2**63), dtype=tl.int64)
        for j in range(K):
            m = tl.max(key, axis=1)
            key = tl.where(key == m[:, None], -(2**63), key)
            mk = tl.where(jj[None, :] == j, m[:, None], mk)
        col = G_PAD * EG_PAD - 1 - (mk & 0xFFFFFFFF).to(tl.int32)
        choice = (col // EG_PAD) * EG + col % EG_PAD
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
        if SCALED:
            w = w * scale
        tl.store(scr_w_ptr + out_offs, w, mask=st_mask)
        le = tl.reshape(tl.where(routed, choice - start, HB // 2), [BLOCK_T * K_PAD])
        if OLD_INTERP:
            local_hist += tl.sum((le[:, None] == bins[None, :]).to(tl.int32), axis=0)
        else:
            local_hist += tl.histogram(le, HB)
        tl.store(pack_ptr + out_offs, tl.where(routed, choice - start, -1), mask=st_mask)
    tl.store(hist_ptr + bins * n_programs + pid, local_hist, mask=bins < end - start)
