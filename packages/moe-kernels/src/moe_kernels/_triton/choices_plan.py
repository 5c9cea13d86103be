"""The plan of given choices in one program (``moe_kernels.choices_plan``): for up to
``MAX_PAIRS`` (token, choice) pairs, one launch replaces the ~15 torch ops of the reference
(sort, searchsorted, scatter, casts), whose host time dominates a decode step.

The P pairs' keys (local expert, or L for a choice outside the local range) are sorted with their
index as ``key * BLOCK + index`` (a stable sort: one expert's pairs stay in token order); the
counts are a histogram of the keys, the offsets its exclusive prefix sum. Nothing here checks
arguments: ``moe_kernels.plan_from_choices`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import next_pow2
from moe_kernels._triton.launch import FastKernel

MAX_PAIRS = 4096  # one program sorts them in registers
# Triton 3.5's interpreter corrupts the heap in tl.histogram (a later free() aborts the
# process): under that interpreter the op runs its reference instead.
RUNS = not (INTERPRET and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 6))


@triton.jit
def _plan_kernel(
    idx_ptr, w_ptr, counts_ptr, offsets_ptr, expert_ptr, token_ptr, weight_ptr, inverse_ptr,
    order_ptr, P, lo, L,
    K: tl.constexpr, BLOCK: tl.constexpr, L_PAD: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, BLOCK)
    live = i < P
    local = tl.load(idx_ptr + i, mask=live, other=0) - lo  # (int64 sentinels stay int64)
    routed = live & (local >= 0) & (local < L)
    key = tl.where(routed, local, L).to(tl.int32)
    key = tl.where(live, key, L + 1)  # padding sorts last and lands in a bin nobody reads
    s = tl.sort(key * BLOCK + i)
    order = s % BLOCK
    skey = s // BLOCK
    kept = skey < L
    out = live  # sorted position i holds pair order[i]; the first P positions are the pairs
    tl.store(expert_ptr + i, tl.where(kept, skey, -1), mask=out)
    tl.store(token_ptr + i, tl.where(kept, order // K, -1), mask=out)
    w = tl.load(w_ptr + order, mask=out & kept, other=0.0).to(tl.float32)
    tl.store(weight_ptr + i, w, mask=out)
    tl.store(order_ptr + i, order, mask=out)
    tl.store(inverse_ptr + order, tl.where(kept, i, -1), mask=out)
    counts = tl.histogram(key, L_PAD)
    e = tl.arange(0, L_PAD)
    starts = tl.cumsum(counts, 0) - counts  # starts[L]: the routed total, offsets[L]
    tl.store(counts_ptr + e, counts, mask=e < L)
    tl.store(offsets_ptr + e, starts, mask=e <= L)


_plan = FastKernel(_plan_kernel)


def plan_from_choices(
    idx_TK: torch.Tensor, w_TK: torch.Tensor, lo: int, L: int
) -> tuple[torch.Tensor, ...]:
    """(counts (L,), offsets (L+1,), expert (P,), token (P,), inverse (T, K) int32, weights (P,)
    fp32, order (P,) int32: the pair each sorted position holds) for P = T * K <= MAX_PAIRS."""
    T, K = idx_TK.shape
    P, dev = T * K, idx_TK.device
    i32 = dict(dtype=torch.int32, device=dev)
    counts, offsets = torch.empty(L, **i32), torch.empty(L + 1, **i32)
    expert, token, order = (torch.empty(P, **i32) for _ in range(3))
    inverse = torch.empty(T, K, **i32)
    weights = torch.empty(P, dtype=torch.float32, device=dev)
    if P == 0:
        return counts.zero_(), offsets.zero_(), expert, token, inverse, weights, order
    block = max(16, next_pow2(P))
    args = (idx_TK.contiguous(), w_TK.contiguous(), counts, offsets, expert, token, weights,
            inverse, order, P, lo, L)  # fmt: skip
    meta = dict(K=K, BLOCK=block, L_PAD=max(16, next_pow2(L + 2)))
    _plan.launch((1,), args, meta, num_warps=4 if block <= 1024 else 8)
    return counts, offsets, expert, token, inverse, weights, order
