"""Kernel A of the row families: each token's top-k experts, one block of rows at a time.

Top-k by per-thread insertion (``INSERT``: a row a thread, 16-byte loads, compare-exchange
chains or sort-and-merge, ``networks``) or by ``top_k`` rounds of row maxima over a (rows,
experts) tile of keys (``keys.score_keys``). Then, by the placement C will use, either ranks
inside each expert from per-expert bitmasks of the block's tokens (``RANKS``: ranked) or the bare
local expert of each choice and a histogram (the sorted placements). The program's per-expert
count goes to ``hist[l, program]``; route's weights to fp32 scratch or (``PACK_W``) into the high
16 bits of the choice words.

``OLD_INTERP`` (only under triton < 3.6's interpreter): the histogram by one-hot sums (that
``tl.histogram`` miscounts program 0 there) and NaN replaced by a ``where`` (its ``maxnumf``
keeps NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import bits16_to_f32, fkeys_to_keys, popcount_swar, score_fkeys, score_keys
from .networks import insert4, split8, stack8, take8


@triton.jit
def _insert_topk(x_ptr, rows64, row_ok, stride_t, stride_e, E, jj,
                 BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, W: tl.constexpr,
                 KIND: tl.constexpr, EVEN_E: tl.constexpr, SENT: tl.constexpr,
                 FKEY: tl.constexpr, MERGE: tl.constexpr, OLD_INTERP: tl.constexpr):  # fmt: skip
    """The K_PAD (<= 8) largest keys of each row, descending, with no cross-lane work: W
    adjacent scores per thread and load (one 16-byte vector). Each load's keys go in by
    compare-exchange chains (insertion), or (MERGE, K_PAD == W == 8) are sorted by a network
    and merged into the running 8 (~4.5 instead of ~7.5 exchanges per score). FKEY: fp32 keys
    (``score_fkeys``). -> (BLOCK_T, K_PAD) int32/int64 keys of ``score_keys``."""
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
            key = score_fkeys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
                               E_PAD, KIND, EVEN_E, OLD_INTERP)  # fmt: skip
        else:
            key = score_keys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
                              E_PAD, KIND, EVEN_E, SENT)  # fmt: skip
        if W == 8:
            k0, k1, k2, k3, k4, k5, k6, k7 = split8(key, BLOCK_T)
            if MERGE:
                t0, t1, t2, t3, t4, t5, t6, t7 = take8(
                    t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, k4, k5, k6, k7, FKEY
                )
            else:
                t0, t1, t2, t3, t4, t5, t6, t7 = insert4(
                    t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD, FKEY
                )
                t0, t1, t2, t3, t4, t5, t6, t7 = insert4(
                    t0, t1, t2, t3, t4, t5, t6, t7, k4, k5, k6, k7, K_PAD, FKEY
                )
        else:  # W == 4
            a, b = tl.split(tl.reshape(key, [BLOCK_T, 2, 2]))
            k0, k2 = tl.split(a)
            k1, k3 = tl.split(b)
            t0, t1, t2, t3, t4, t5, t6, t7 = insert4(
                t0, t1, t2, t3, t4, t5, t6, t7, k0, k1, k2, k3, K_PAD, FKEY
            )
    S = 0.0 if FKEY else SENT
    mk = stack8(t0, t1, t2, t3, t4, t5, t6, t7, jj, K_PAD, S)
    if FKEY:
        mk = fkeys_to_keys(mk)
    return mk


@triton.jit
def topk_rows_kernel(
    x_ptr,  # (T, E) scores; int16 view for 16-bit floats, fp32 otherwise
    stride_t,
    stride_e,
    stride_w,  # unused (the signature is topk_columns_kernel's)
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
            key = score_keys(x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
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
                    w = bits16_to_f32(wb, KIND == 1)
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
            rank = g_run + popcount_swar(g_mask & below[:, None])
            running += popcount_swar(colmask)
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
