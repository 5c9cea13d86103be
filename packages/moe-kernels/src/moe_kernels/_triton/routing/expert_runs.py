"""Kernel D (``columns`` after a scan launch): each expert's sorted pairs as contiguous runs."""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import bits16_to_f32


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
        tl.store(weight_ptr + first + q, bits16_to_f32(v >> 16, IS_BF16), mask=ok)


@triton.jit
def expert_runs_kernel(
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
