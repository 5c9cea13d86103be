"""Triton kernel for the expert-parallel reshuffles (``combine_shuffling`` / ``split_shuffling``)
and its launcher.

One kernel for both directions, one launch, no host sync: a program owns BLOCK_T output rows and
a range of D_ITERS * BLOCK_D columns. It first finds each of its rows' source from the counts
(read on the device; the row map is ``moe_kernels.reference.shuffling``'s, rule for rule):

1. one pass over the whole (EP, E) count matrix: each rank's rows over all experts and over the
   experts before ``start`` (the rank-first offsets);
2. a pass over the local chunks (EP ranks x BLOCK_G experts at a time) that builds both offsets
   of every chunk in registers and tests every row against every chunk: chunks are disjoint, so
   a masked sum of ``source + 1`` gives the source (0: no chunk holds the row, it is zero).

Then it copies the rows (or, with ZERO, writes zeros to rows no chunk holds): plain loads and
stores, a bit copy (dtypes Triton does not know go through an integer view), 16-byte vectors along
D where D and the strides allow. Without ZERO (FBGEMM's contract: such rows are left unwritten) a
program whose rows all lie past the last owned row (combine: the local total; split, unpadded:
every rank's rows) stops after the counts pass. Row offsets are int64; counts are clamped into
[0, T] and summed in int64. Nothing here checks arguments: ``moe_kernels.shuffling`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _shuffle_kernel(
    in_ptr,  # (T, D) integer view of the tokens
    out_ptr,  # (T, D) contiguous, same dtype
    counts_ptr,  # (EP, E) int32/int64
    counts_out_ptr,  # (EG + 1,) counts' dtype (COMBINE only)
    T,
    D,
    EP,
    E,
    EG,
    start,
    B_T,  # rows of a rank's padded block (PADDED only)
    stride_it,
    stride_id,
    stride_cr,
    stride_ce,
    COMBINE: tl.constexpr,
    PADDED: tl.constexpr,
    ZERO: tl.constexpr,
    BLOCK_EP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    N_EBLK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    N_GBLK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_ITERS: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    r = tl.arange(0, BLOCK_EP)
    r_ok = r < EP
    r64 = r.to(tl.int64)

    # 1. per rank: rows over all experts, rows of the experts before `start`; every count is
    # clamped into [0, T] (negatives as 0; the sums cannot overflow, so chunks stay disjoint)
    rank_rows = tl.zeros((BLOCK_EP,), tl.int64)
    pre_start = tl.zeros((BLOCK_EP,), tl.int64)
    local_rows = tl.zeros((BLOCK_EP,), tl.int64)
    for i in range(N_EBLK):
        e = i * BLOCK_E + tl.arange(0, BLOCK_E)
        m = r_ok[:, None] & (e < E)[None, :]
        c = tl.load(counts_ptr + r[:, None] * stride_cr + e[None, :] * stride_ce, mask=m, other=0)
        k = tl.minimum(tl.maximum(c.to(tl.int64), 0), T)
        rank_rows += tl.sum(k, axis=1)
        pre_start += tl.sum(tl.where(e[None, :] < start, k, 0), axis=1)
        local_rows += tl.sum(tl.where((e[None, :] >= start) & (e[None, :] < start + EG), k, 0), 1)
    rank_first = tl.cumsum(rank_rows, 0) - rank_rows  # unpadded rank-first base of each rank
    # the rows past which no chunk writes (T: every row is written, or no bound is known)
    if ZERO:
        owned_end = tl.sum(local_rows * 0, axis=0) + T
    elif COMBINE:
        owned_end = tl.sum(local_rows, axis=0)
    elif PADDED:
        owned_end = tl.sum(local_rows * 0, axis=0) + T
    else:
        owned_end = tl.sum(rank_rows, axis=0)
    first = (pid_t + pid_d) == 0  # the program that writes counts_out
    if first | (pid_t.to(tl.int64) * BLOCK_T < owned_end):
        _chunks_and_copy(in_ptr, out_ptr, counts_ptr, counts_out_ptr, T, D, EG, start, B_T,
                         stride_it, stride_id, stride_cr, stride_ce, rows, row_in, r, r_ok, r64,
                         rank_rows, pre_start, rank_first, first, pid_t, pid_d, COMBINE, PADDED,
                         ZERO, BLOCK_G, N_GBLK, BLOCK_T, BLOCK_D, D_ITERS)  # fmt: skip


@triton.jit
def _chunks_and_copy(
    in_ptr, out_ptr, counts_ptr, counts_out_ptr, T, D, EG, start, B_T, stride_it, stride_id,
    stride_cr, stride_ce, rows, row_in, r, r_ok, r64, rank_rows, pre_start, rank_first, first,
    pid_t, pid_d, COMBINE: tl.constexpr, PADDED: tl.constexpr, ZERO: tl.constexpr,
    BLOCK_G: tl.constexpr, N_GBLK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    D_ITERS: tl.constexpr,
):  # fmt: skip

    # 2. the local chunks, BLOCK_G experts at a time; carries: rows of the earlier local experts
    # (all ranks: expert-first base) and per rank (rank-first prefix)
    src1 = tl.zeros((BLOCK_T,), tl.int64)  # source row + 1 of each row, 0: none
    carry_e = tl.sum(rank_rows * 0, axis=0)
    carry_raw = carry_e
    carry_r = rank_rows * 0
    for j in range(N_GBLK):
        g = j * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = g < EG
        m = r_ok[:, None] & g_ok[None, :]
        ptrs = counts_ptr + r[:, None] * stride_cr + (start + g)[None, :] * stride_ce
        raw = tl.load(ptrs, mask=m, other=0).to(tl.int64)
        k = tl.minimum(tl.maximum(raw, 0), T)
        col = tl.sum(k, axis=0)
        if COMBINE:
            raw_col = tl.sum(raw, axis=0)
            out_ty = counts_out_ptr.dtype.element_ty
            # a tensor predicate: Triton 3.9's interpreter makes `tensor & scalar bool` int32,
            # which its store refuses as a mask
            first_g = (g * 0 + pid_t + pid_d) == 0
            tl.store(counts_out_ptr + g, raw_col.to(out_ty), mask=g_ok & first_g)
            carry_raw += tl.sum(raw_col, axis=0)
        # expert-first: earlier local experts, then earlier ranks of this expert
        a = carry_e + (tl.cumsum(col, 0) - col)[None, :] + (tl.cumsum(k, 0) - k)
        # rank-first: the rank's rows before this expert (all columns)
        pre = (pre_start + carry_r)[:, None] + (tl.cumsum(k, 1) - k)
        if PADDED:  # clipped to the rank's block: chunks stay disjoint
            b = r64[:, None] * B_T + tl.minimum(pre, B_T)
            n = tl.minimum(k, tl.maximum(B_T - pre, 0))
        else:
            b = rank_first[:, None] + pre
            n = k
        if COMBINE:
            out_start = a
            src_start = b
        else:
            out_start = b
            src_start = a
        rel = rows[:, None, None] - out_start[None, :, :]
        hit = (rel >= 0) & (rel < n[None, :, :])
        src1 += tl.sum(tl.sum(tl.where(hit, src_start[None, :, :] + rel + 1, 0), axis=2), axis=1)
        carry_e += tl.sum(col, axis=0)
        carry_r += tl.sum(k, axis=1)
    if COMBINE:
        tl.store(counts_out_ptr + EG, carry_raw.to(counts_out_ptr.dtype.element_ty), mask=first)

    src = src1 - 1
    live = row_in & (src1 >= 1) & (src < T)
    for it in range(D_ITERS):
        cols = (pid_d * D_ITERS + it) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_in = cols < D
        v = tl.load(
            in_ptr + src[:, None] * stride_it + cols[None, :] * stride_id,
            mask=live[:, None] & col_in[None, :],
            other=0,
        )
        written = row_in if ZERO else live  # (rows no chunk holds: zeros, or left as they are)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], v,
                 mask=written[:, None] & col_in[None, :])  # fmt: skip


_shuffle = FastKernel(_shuffle_kernel)


class ShuffleConfig(NamedTuple):
    """A launch of the reshuffle kernel: BLOCK_T rows x D_ITERS * BLOCK_D columns per program,
    local experts BLOCK_G at a time in the row lookup, ``num_warps``."""

    block_t: int
    block_d: int
    d_iters: int
    block_g: int
    num_warps: int


# Tokens of these dtypes go to the kernel as they are (a load and a store copy the bits; a dtype
# view would cost a copy under torch.compile); any other 1/2/4/8-byte dtype as an integer view.
_NATIVE = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool}  # fmt: skip
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# GPU: 2 KiB of a row per column step, up to ~16 KiB a step; rows per program halved until there
# are ~1024 programs (8 per SM of an H200: small problems), and only where the row tiles alone
# fill them does a program take several column steps; the row lookup's tile (rows x ranks x
# experts) at most 2048 entries. Interpreter: few, large programs (numpy is slow per program).
_ROW_BYTES, _TILE_BYTES, _PROGRAMS, _LOOKUP = 2048, 16384, 1024, 2048
_INTERPRET_ROW_BYTES, _INTERPRET_TILE_BYTES = 16384, 65536


def pick_config(
    num_rows: int, dim: int, elem_bytes: int, num_ranks: int, num_local: int
) -> ShuffleConfig:
    """The default launch for T rows of D elements of ``elem_bytes`` bytes, EP ranks and EG local
    experts (the one place the heuristic lives)."""
    row_bytes, tile_bytes = (
        (_INTERPRET_ROW_BYTES, _INTERPRET_TILE_BYTES) if INTERPRET else (_ROW_BYTES, _TILE_BYTES)
    )
    block_d = max(16, min(next_pow2(max(dim, 1)), max(row_bytes // elem_bytes, 16)))
    chunks = cdiv(max(dim, 1), block_d)
    block_t = max(1, min(tile_bytes // (block_d * elem_bytes), 32, next_pow2(max(num_rows, 1))))
    d_iters = chunks
    if not INTERPRET:
        while block_t > 1 and cdiv(num_rows, block_t) * chunks < _PROGRAMS:
            block_t //= 2
        tiles = cdiv(max(num_rows, 1), block_t)
        d_iters = cdiv(chunks, min(chunks, max(1, cdiv(_PROGRAMS, tiles))))
    block_ep = next_pow2(max(num_ranks, 1))
    block_g = max(1, min(next_pow2(max(num_local, 1)), _LOOKUP // (block_t * block_ep)))
    num_warps = 8 if block_t * block_d * elem_bytes >= 16384 else 4
    return ShuffleConfig(block_t, block_d, d_iters, block_g, num_warps)


def launch_constants(
    num_rows: int,
    dim: int,
    num_ranks: int,
    num_experts: int,
    num_local: int,
    padded: bool,
    combine: bool,
    cfg: ShuffleConfig,
    zero: bool = True,
) -> dict:
    """The kernel's constexprs for a launch of ``cfg``."""
    block_e = max(1, min(next_pow2(max(num_experts, 1)), _LOOKUP // next_pow2(num_ranks)))
    # The kernel's prefix sums run along the ranks and the local experts. Triton 3.6's compiler
    # fails (ScanOpToLLVM assertion) on a scan axis of one element, and on a local-expert axis of
    # two beside 4+ ranks (swept: BLOCK_EP 2-64 x BLOCK_G 2-1024 x BLOCK_T 1-32, 4 and 8 warps;
    # docs/kernel-ops.md). So the rank tile holds at least two lanes, the expert tile four.
    block_g = max(4, cfg.block_g)
    return dict(
        COMBINE=combine,
        PADDED=padded,
        ZERO=zero,
        BLOCK_EP=max(2, next_pow2(num_ranks)),
        BLOCK_E=block_e,
        N_EBLK=cdiv(num_experts, block_e),
        BLOCK_G=block_g,
        N_GBLK=cdiv(num_local, block_g),
        BLOCK_T=cfg.block_t,
        BLOCK_D=cfg.block_d,
        D_ITERS=cfg.d_iters if dim > 0 else 0,
    )


def shuffle(
    tokens_TD: torch.Tensor,
    counts_RE: torch.Tensor,
    start: int,
    end: int,
    padded: bool,
    combine: bool,
    config: ShuffleConfig | None = None,
    zero: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (T, D) in tokens' dtype, counts_out (EG + 1,) or None when not ``combine``): the
    reshuffle of ``moe_kernels.reference.shuffling`` in one launch; without ``zero`` the rows no
    chunk holds are left unwritten (``torch.empty``'s contents)."""
    num_rows, dim = tokens_TD.shape
    num_ranks, num_experts = counts_RE.shape
    num_local = end - start
    out_TD = torch.empty((num_rows, dim), dtype=tokens_TD.dtype, device=tokens_TD.device)
    counts_out = None
    if combine:
        counts_out = torch.empty(num_local + 1, dtype=counts_RE.dtype, device=counts_RE.device)
    elif num_rows == 0 or dim == 0:
        return out_TD, None
    bits = tokens_TD.dtype if tokens_TD.dtype in _NATIVE else _BITS[tokens_TD.element_size()]
    cfg = config or pick_config(num_rows, dim, tokens_TD.element_size(), num_ranks, num_local)
    consts = launch_constants(num_rows, dim, num_ranks, num_experts, num_local, padded, combine,
                              cfg, zero)  # fmt: skip
    # at least one program: combine writes counts_out even when there are no rows
    grid = (max(1, cdiv(num_rows, cfg.block_t)), max(1, cdiv(cdiv(dim, cfg.block_d), cfg.d_iters)))
    _shuffle.launch(
        grid,
        (
            tokens_TD.view(bits),
            out_TD.view(bits),
            counts_RE,
            counts_out if counts_out is not None else counts_RE,
            num_rows,
            dim,
            num_ranks,
            num_experts,
            num_local,
            start,
            num_rows // num_ranks if padded else 0,
            tokens_TD.stride(0),
            tokens_TD.stride(1),
            counts_RE.stride(0),
            counts_RE.stride(1),
        ),
        consts,
        num_warps=cfg.num_warps,
    )
    return out_TD, counts_out
