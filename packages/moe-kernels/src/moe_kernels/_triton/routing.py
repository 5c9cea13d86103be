"""Triton routing kernels and their launchers (top-k, per-expert bucket sort, routing plan).

Three launches, no atomics, no host sync; the result is a pure function of the inputs:

A. ``_topk_rank_kernel``: one program per run of ``SUB`` blocks of ``BLOCK_T`` tokens. Per block it
   loads the (BLOCK_T, E) scores, turns each into a unique integer key (order-preserving code of the
   score in the high bits, ``E_PAD - 1 - e`` in the low bits, so ties go to the lower expert, NaN is
   -inf and -0.0 is +0.0) and takes ``top_k`` rounds of row maxima. An exclusive cumsum of the
   chosen-pair matrix down the tokens (plus the program's running count) ranks every pair inside
   its expert; the rank goes to ``inverse`` (overwritten by C), the local expert (or -1) and the
   weight to scratch, and the program's per-expert count to ``hist[l, program]``.
B. ``_scan_kernel``: one program per local expert, exclusive scan of its ``hist`` row over programs.
C. ``_place_kernel``: one program per A-program. It turns the per-expert totals into expert offsets,
   writes the sorted pairs (``expert_indices``, ``token_indices``, ``weights``) at
   ``offset[e] + hist[e, program] + rank``, writes ``inverse`` and fills its own slice of the tail.
   Program 0 also writes ``offsets`` and ``token_count_per_expert``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import INTERPRET


@triton.jit
def _bits16_to_f32(bits, IS_BF16: tl.constexpr):
    """Raw bf16/fp16 bits (int32 holding the 16-bit pattern, sign-extended) -> fp32 value."""
    if IS_BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _topk_rank_kernel(
    x_ptr,  # (T, E) scores; int16 view for 16-bit floats, fp32 otherwise
    stride_t,
    stride_e,
    vtc_ptr,  # (1,) int32/int64 valid token count (unused when not HAS_VTC)
    scr_e_ptr,  # (T, K) int32 out: local expert of each choice, -1 when not routed
    scr_w_ptr,  # (T, K) fp32 out: weight of each choice (only when WEIGHTS)
    rank_ptr,  # (T, K) int32 out: rank of the pair inside its expert, within this program
    hist_ptr,  # (L, n_programs) int32 out: pairs per local expert and program
    T,
    E,
    start,
    end,
    n_programs,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SUB: tl.constexpr,
    KIND: tl.constexpr,  # 0: fp32, 1: bf16, 2: fp16
    HAS_VTC: tl.constexpr,
    WEIGHTS: tl.constexpr,
    RENORM: tl.constexpr,
    SENT: tl.constexpr,  # below every real key: INT64_MIN (fp32) or INT32_MIN (16-bit)
):
    pid = tl.program_id(0)
    n_valid = T
    if HAS_VTC:
        v = tl.load(vtc_ptr).to(tl.int64)
        n_valid = tl.minimum(tl.maximum(v, 0), T).to(tl.int32)
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    in_range = (cols >= start) & (cols < end)
    jj = tl.arange(0, K_PAD)
    low = E_PAD - 1 - cols  # tie-break: a lower expert gets a larger key
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(SUB):
        rows = (pid * SUB + s) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
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
                is_nan = mag > 0x7F80
                neg_inf = -128  # 0xFF80 as int16
            else:
                is_nan = mag > 0x7C00
                neg_inf = -1024  # 0xFC00 as int16
            bits = tl.where(is_nan, neg_inf, bits)
            bits = tl.where(mag == 0, 0, bits)
            code = bits ^ ((bits >> 15) & 0x7FFF)
            key = (code << 16) | low[None, :]
        key = tl.where(col_ok[None, :], key, SENT)

        choice = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        wsum = tl.zeros([BLOCK_T], dtype=tl.float32)
        for j in range(K):
            m = tl.max(key, axis=1)
            key = tl.where(key == m[:, None], SENT, key)
            if KIND == 0:
                e_j = E_PAD - 1 - m.to(tl.int32)  # low 32 bits
            else:
                e_j = E_PAD - 1 - (m & 0xFFFF)
            choice = tl.where(jj[None, :] == j, e_j[:, None], choice)
            if WEIGHTS:
                if KIND == 0:
                    c = (m >> 32).to(tl.int32)
                    v = (c ^ ((c >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
                else:
                    c = m >> 16
                    v = _bits16_to_f32(c ^ ((c >> 15) & 0x7FFF), KIND == 1)
                # NaN and -0.0 were canonicalised in the key: reload those few originals.
                fix = row_ok & ((v == 0.0) | (v == float("-inf")))
                orig_offs = rows64 * stride_t + e_j.to(tl.int64) * stride_e
                if KIND == 0:
                    orig = tl.load(x_ptr + orig_offs, mask=fix, other=0.0)
                else:
                    orig = _bits16_to_f32(
                        tl.load(x_ptr + orig_offs, mask=fix, other=0).to(tl.int32), KIND == 1
                    )
                v = tl.where(fix, orig, v)
                w = tl.where(jj[None, :] == j, v[:, None], w)
                wsum = wsum + v

        routed_row = row_ok & (rows < n_valid)
        picked = (key == SENT) & col_ok[None, :] & in_range[None, :] & routed_row[:, None]
        picked_i = picked.to(tl.int32)
        incl = tl.cumsum(picked_i, axis=0)
        rank_te = incl - picked_i + running[None, :]
        running += tl.sum(picked_i, axis=0)

        k_ok = jj[None, :] < K
        routed = (choice >= start) & (choice < end) & routed_row[:, None] & k_ok
        rank = tl.gather(rank_te, tl.where(routed, choice, 0), axis=1)
        out_offs = rows[:, None] * K + jj[None, :]
        st_mask = row_ok[:, None] & k_ok
        tl.store(scr_e_ptr + out_offs, tl.where(routed, choice - start, -1), mask=st_mask)
        tl.store(rank_ptr + out_offs, rank, mask=st_mask)
        if WEIGHTS:
            if RENORM:
                w = tl.math.div_rn(w, wsum[:, None])
            tl.store(scr_w_ptr + out_offs, w, mask=st_mask)
    tl.store(hist_ptr + (cols - start) * n_programs + pid, running, mask=in_range)


@triton.jit
def _scan_kernel(hist_ptr, counts_ptr, n_programs, CHUNK: tl.constexpr):
    """Row ``l`` of hist (pairs per program) -> its exclusive prefix; counts[l] = the total."""
    l = tl.program_id(0)
    row = hist_ptr + l * n_programs
    carry = tl.zeros([], dtype=tl.int32)
    for c in range(0, n_programs, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        ok = idx < n_programs
        h = tl.load(row + idx, mask=ok, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(row + idx, incl - h + carry, mask=ok)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + l, carry)


@triton.jit
def _place_kernel(
    scr_e_ptr,  # (T, K) int32: local expert or -1
    scr_w_ptr,  # (T, K) fp32 weights (only when WEIGHTS)
    rank_ptr,  # (T, K) int32: in = rank inside the A-program, out = inverse (position or -1)
    hist_ptr,  # (L, n_programs) int32: per-program counts (FUSE_SCAN) or their exclusive prefix
    base_ptr,  # (n_programs, L) int32 scratch: this program's first position in each expert
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
    NP_PAD: tl.constexpr,  # >= n_programs when FUSE_SCAN
    TOK_PER_PROG: tl.constexpr,
    CHUNK_T: tl.constexpr,
    FUSE_SCAN: tl.constexpr,
    WEIGHTS: tl.constexpr,
    OFFSETS: tl.constexpr,
    TCPE: tl.constexpr,
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
        if pid == 0:
            tl.store(counts_ptr + ls, cnt, mask=l_ok)
    else:
        cnt = tl.load(counts_ptr + ls, mask=l_ok, other=0)
        before = tl.load(hist_ptr + ls * n_programs + pid, mask=l_ok, other=0)
    excl = tl.cumsum(cnt, axis=0) - cnt
    n = tl.sum(cnt, axis=0)
    tl.store(base_ptr + pid * L + ls, excl + before, mask=l_ok)  # read back (gathered) below
    if pid == 0:  # noqa: SIM102 (a constexpr and a runtime test stay apart)
        if OFFSETS:
            tl.store(offsets_ptr + ls, excl, mask=l_ok)
            tl.store(offsets_ptr + L, n)
    tl.debug_barrier()  # base (and counts, when FUSE_SCAN) visible to the whole program
    if TCPE:  # noqa: SIM102
        if pid == 0:
            for c in range(0, E, L_PAD):
                e = c + ls
                inside = (e >= start) & (e < start + L)
                v = tl.load(counts_ptr + (e - start), mask=inside, other=0)
                tl.store(tcpe_ptr + e, v, mask=e < E)
            tl.store(tcpe_ptr + E, T)
            tl.store(tcpe_ptr + E + 1, n)

    jj = tl.arange(0, K_PAD)
    k_ok = jj[None, :] < K
    for c in range(0, TOK_PER_PROG, CHUNK_T):
        rows = pid * TOK_PER_PROG + c + tl.arange(0, CHUNK_T)
        row_ok = rows < T
        offs = rows[:, None] * K + jj[None, :]
        m = row_ok[:, None] & k_ok
        le = tl.load(scr_e_ptr + offs, mask=m, other=-1)
        routed = le >= 0
        r = tl.load(rank_ptr + offs, mask=m, other=0)
        b = tl.load(base_ptr + pid * L + le, mask=routed, other=0)
        pos = tl.where(routed, b + r, -1)
        tl.store(rank_ptr + offs, pos, mask=m)
        tl.store(expert_ptr + pos, le, mask=routed)
        tl.store(token_ptr + pos, tl.broadcast_to(rows[:, None], [CHUNK_T, K_PAD]), mask=routed)
        tail = m & (offs >= n)
        tl.store(expert_ptr + offs, tl.full([CHUNK_T, K_PAD], -1, tl.int32), mask=tail)
        tl.store(token_ptr + offs, tl.full([CHUNK_T, K_PAD], -1, tl.int32), mask=tail)
        if WEIGHTS:
            wv = tl.load(scr_w_ptr + offs, mask=m, other=0.0)
            tl.store(weight_ptr + pos, wv, mask=routed)
            tl.store(weight_ptr + offs, tl.zeros([CHUNK_T, K_PAD], tl.float32), mask=tail)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_MAX_PROGRAMS = 4096  # programs of kernels A and C (bounds the length of a hist row)
_FUSE_SCAN_MAX = 16384  # fold the scan into C when L_PAD * NP_PAD is at most this


def _config(T: int, E: int, K: int, fp32: bool) -> dict[str, int]:
    """Block sizes and warps from the problem size."""
    e_pad = max(_next_pow2(E), 4)
    tile = 2048 if fp32 else 4096  # int64 keys for fp32 scores, int32 keys for 16-bit scores
    block_t = max(1, min(tile // e_pad, 256, _next_pow2(T)))
    n_blocks = triton.cdiv(T, block_t)
    return {
        "BLOCK_T": block_t,
        "SUB": _next_pow2(triton.cdiv(n_blocks, _MAX_PROGRAMS)),
        "num_warps": 1 if INTERPRET else (4 if block_t * e_pad <= 4096 else 8),
    }


_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def routing_triton(
    scores_TE: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    start: int,
    end: int,
    renormalize: bool,
    with_weights: bool,
    with_offsets: bool,
    tcpe: torch.Tensor | None,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Launch the kernels for T > 0 (arguments already checked). Returns ``(counts, offsets,
    expert, token, weights, inverse)``; ``offsets``/``weights`` are None when not asked for.
    Fills ``tcpe`` (E+2,) when given. ``config`` overrides the launcher's choices (benchmarks)."""
    T, E = scores_TE.shape
    K = top_k
    L = end - start
    dev = scores_TE.device
    i32 = torch.int32
    cfg = _config(T, E, K, scores_TE.dtype == torch.float32)
    if config:
        cfg.update(config)
    block_t, sub = cfg["BLOCK_T"], cfg["SUB"]
    tok_per_prog = block_t * sub
    n_prog = triton.cdiv(T, tok_per_prog)
    e_pad = max(_next_pow2(E), 4)
    k_pad = _next_pow2(K)
    l_pad = max(_next_pow2(L), 2)
    np_pad = max(_next_pow2(n_prog), 2)
    fuse_scan = cfg.get("FUSE_SCAN", l_pad * np_pad <= _FUSE_SCAN_MAX)
    kind = _KIND[scores_TE.dtype]
    x = scores_TE if kind == 0 else scores_TE.view(torch.int16)

    # Outputs, then one scratch buffer: hist (L, n_prog), base (n_prog, L), experts (T*K),
    # weights (T*K, fp32 bits).
    Lm = max(L, 1)
    counts = torch.empty(Lm, dtype=i32, device=dev)
    inverse = torch.empty(T, K, dtype=i32, device=dev)
    expert = torch.empty(T * K, dtype=i32, device=dev)
    token = torch.empty(T * K, dtype=i32, device=dev)
    weights = torch.empty(T * K, dtype=torch.float32, device=dev) if with_weights else None
    offsets = torch.empty(L + 1, dtype=i32, device=dev) if with_offsets else None
    n_hist = Lm * n_prog
    scratch = torch.empty(2 * n_hist + T * K * (2 if with_weights else 1), dtype=i32, device=dev)
    hist = scratch[:n_hist]
    base = scratch[n_hist : 2 * n_hist]
    scr_e = scratch[2 * n_hist : 2 * n_hist + T * K]
    scr_w = scratch[2 * n_hist + T * K :].view(torch.float32) if with_weights else scr_e
    vtc = valid_token_count

    _topk_rank_kernel[(n_prog,)](
        x,
        x.stride(0),
        x.stride(1),
        vtc if vtc is not None else expert,
        scr_e,
        scr_w,
        inverse,
        hist,
        T,
        E,
        start,
        end,
        n_prog,
        K=K,
        K_PAD=k_pad,
        E_PAD=e_pad,
        BLOCK_T=block_t,
        SUB=sub,
        KIND=kind,
        HAS_VTC=vtc is not None,
        WEIGHTS=with_weights,
        RENORM=renormalize,
        SENT=-(2**63) if kind == 0 else -(2**31),
        num_warps=cfg["num_warps"],
    )
    if L > 0 and not fuse_scan:
        chunk = min(np_pad, 4096)
        _scan_kernel[(L,)](hist, counts, n_prog, CHUNK=chunk, num_warps=4)
    _place_kernel[(n_prog,)](
        scr_e,
        scr_w,
        inverse,
        hist,
        base,
        counts,
        expert,
        token,
        weights if with_weights else scr_w,
        offsets if with_offsets else counts,
        tcpe if tcpe is not None else counts,
        T,
        E,
        L,
        start,
        n_prog,
        K=K,
        K_PAD=k_pad,
        L_PAD=l_pad,
        NP_PAD=np_pad if fuse_scan else 1,
        TOK_PER_PROG=tok_per_prog,
        CHUNK_T=max(1, min(tok_per_prog, 2048 // k_pad)),
        FUSE_SCAN=fuse_scan,
        WEIGHTS=with_weights,
        OFFSETS=with_offsets,
        TCPE=tcpe is not None,
        num_warps=4 if not INTERPRET else 1,
    )
    return counts[:L], offsets, expert, token, weights, inverse
