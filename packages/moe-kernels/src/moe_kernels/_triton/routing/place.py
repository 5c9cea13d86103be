"""Kernel C: the per-expert offsets, ``counts`` / ``offsets`` / ``token_count_per_expert``, and
each program's pairs written to their sorted positions by the plan's placement (``PLACE``):

0 ``ranked``: A ranked each pair inside its expert (``place_rows.place_ranked_pairs``);
1 ``sorted`` and 3 ``prefix``: the program's pairs ordered by (expert, token) in registers
  (``place_rows.place_sorted_pairs``);
2 ``counted``: ranks from byte-packed per-expert counts (``place_rows.place_counted_pairs``);
4 ``columns``: A placed the pairs in sorted order already (``place_presorted`` below); D writes
  them out instead where the plan has it (``RUNS``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import bits16_to_f32
from .place_rows import place_counted_pairs, place_ranked_pairs, place_sorted_pairs

# PLACE, by the plan's placement
PLACE = {"ranked": 0, "sorted": 1, "counted": 2, "prefix": 3, "columns": 4}
RANKED = tl.constexpr(0)
COUNTED = tl.constexpr(2)
PREFIX = tl.constexpr(3)
COLUMNS = tl.constexpr(4)


@triton.jit
def _tcpe_chunk(tcpe_ptr, counts_ptr, c, ls, E, L, start):
    """tcpe[e] for e in c + ls: the local count of e inside [start, start + L), else 0."""
    e = c + ls
    inside = (e >= start) & (e < start + L)
    v = tl.load(counts_ptr + (e - start), mask=inside, other=0)
    tl.store(tcpe_ptr + e, v, mask=e < E)


@triton.jit
def place_kernel(
    pack_ptr,  # (T, K) int32 from A: rank << L_BITS | local expert, or -1
    scr_w_ptr,  # (T, K) fp32 weights (only when WEIGHTS)
    inverse_ptr,  # (T, K) int32 out: sorted position or -1 (only when WEIGHTS)
    hist_ptr,  # (L, n_programs) int32: per-program counts (FUSE_SCAN) or their exclusive prefix
    counts_ptr,  # (L,) int32: totals (written here when FUSE_SCAN, by the scan kernel otherwise)
    expert_ptr,  # (T*K,) int32 out
    token_ptr,  # (T*K,) int32 out
    weight_ptr,  # (T*K,) fp32 out (only when WEIGHTS)
    offsets_ptr,  # (L+1,) int32 out (only when WEIGHTS)
    tcpe_ptr,  # (E+2,) int32 out (only when not WEIGHTS)
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
    CHUNK_T: tl.constexpr,  # ranked: tokens a step
    FUSE_SCAN: tl.constexpr,  # reduce hist here (no scan launch)
    WEIGHTS: tl.constexpr,  # route: weights, inverse, offsets (else index_shuffling's tcpe)
    WHILE_LOOPS: tl.constexpr,
    PLACE: tl.constexpr,  # the placement (module docstring)
    IDX_BITS: tl.constexpr,  # log2(TOK_PER_PROG * K_PAD) (sorted keys)
    PACK_W: tl.constexpr,  # A packed 16-bit weight bits above each expert
    IS_BF16: tl.constexpr,  # PACK_W / columns: the weights' bits are bf16 (else fp16)
    NW: tl.constexpr,  # counted: int32 count words per token (>= L_PAD / 4)
    TOK_BITS: tl.constexpr,  # prefix: log2(TOK_PER_PROG)
    RUNS: tl.constexpr,  # columns: expert_runs_kernel writes the sorted pairs, not C
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
        if WHILE_LOOPS:  # the interpreter: no mask from a splat runtime scalar (``routing.launch``)
            has_next = ls * 0 + pid + 1 < n_programs
        else:
            has_next = pid + 1 < n_programs
        after = tl.load(hist_ptr + ls * n_programs + pid + 1, mask=l_ok & has_next, other=0)
        mine = tl.where(has_next, after, cnt) - before
    excl = tl.cumsum(cnt, axis=0) - cnt
    n = tl.sum(cnt, axis=0)
    base = excl + before
    lb = base  # where each expert's pairs start among the program's sorted pairs
    if PLACE != RANKED and PLACE != COUNTED:  # sorted order: index + base - first index of e
        lb = tl.cumsum(mine, axis=0) - mine
        base -= lb
    if pid == 0:  # noqa: SIM102 (a constexpr and a runtime test stay apart)
        if WEIGHTS:
            tl.store(offsets_ptr + ls, excl, mask=l_ok)
            tl.store(offsets_ptr + L, n)
    tl.debug_barrier()  # counts (FUSE_SCAN) visible to the whole program
    if not WEIGHTS:  # noqa: SIM102
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

    if PLACE == COLUMNS:
        place_presorted(
            pack_ptr, base, mine, expert_ptr, token_ptr, weight_ptr, inverse_ptr, T, K, n, pid,
            K_PAD, TOK_PER_PROG, IS_BF16, WEIGHTS, RUNS,
        )  # fmt: skip
    elif PLACE == COUNTED:
        place_counted_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, NW, TOK_PER_PROG, WEIGHTS, PACK_W, IS_BF16,
        )  # fmt: skip
    elif PLACE == RANKED:
        place_ranked_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, L_BITS, TOK_PER_PROG, CHUNK_T, WEIGHTS,
        )  # fmt: skip
    else:
        place_sorted_pairs(
            pack_ptr, scr_w_ptr, inverse_ptr, base, lb, expert_ptr, token_ptr, weight_ptr, T, K,
            n, pid, K_PAD, L_PAD, TOK_PER_PROG, IDX_BITS, WEIGHTS, PACK_W, IS_BF16,
            PLACE == PREFIX, TOK_BITS,
        )  # fmt: skip


@triton.jit
def place_presorted(
    srt_ptr, base, mine, expert_ptr, token_ptr, weight_ptr, inverse_ptr, T, K, n, pid,
    K_PAD: tl.constexpr, TP: tl.constexpr, IS_BF16: tl.constexpr, WEIGHTS: tl.constexpr,
    RUNS: tl.constexpr,
):  # fmt: skip
    """C after A placed each program's pairs in sorted order (``store_presorted``): the
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
    TB: tl.constexpr = 8 if TP > 128 else 7  # as in topk_columns._presort_choice
    PB: tl.constexpr = 11 if TP * K > 1024 else 10
    if not RUNS:  # else expert_runs_kernel writes the sorted pairs
        ok = idx < tl.sum(mine, axis=0)
        v = tl.load(srt_ptr + pid * TP * K + idx, mask=ok, other=0)
        le = (v >> TB) & 0x7F
        pos = idx + tl.gather(base, le, 0)
        tl.store(expert_ptr + pos, le, mask=ok)
        tl.store(token_ptr + pos, pid * TP + (v & (TP - 1)), mask=ok)
        if WEIGHTS:
            tl.store(weight_ptr + pos, bits16_to_f32(v >> 16, IS_BF16), mask=ok)
    if WEIGHTS:  # route: inverse
        m = (rows < T) & (jv < K)
        u = tl.load(inverse_ptr + offs, mask=m, other=-1)
        at = tl.gather(base, tl.where(u >= 0, u >> PB, 0), 0)
        tl.store(inverse_ptr + offs, tl.where(u >= 0, (u & ((1 << PB) - 1)) + at, -1), mask=m)
