"""Triton path of ``scatter_add_padded_tokens``: two plans, one result.

* ``scan`` (small problems, one launch): a program owns BLOCK_T destination rows and BLOCK_D
  columns, reads the counts (rank boundaries) and scans every live position's index in blocks of
  BLOCK_P; inside a block it takes each row's matching positions in ascending order (a running
  minimum) and adds ``in[rank(p), p]``. The index scan is repeated by every program, so its cost
  grows with T x T_K: the launcher keeps it to small problems.
* ``sorted`` (everything else): positions mapped to rows of in_tokens seen as (EP * T_K, D)
  (``moe_kernels.reference.padded_tokens.position_rows``), grouped by destination with the dense
  scatter-add's stable device sort (``moe_kernels.reference.tokens.scatter_order``), then added
  by its kernel (``moe_kernels._triton.tokens.scatter_add_sorted``): no new kernel.

Both add each row's contributions in ascending position, in fp32 rounded to out's dtype after
every add (exact in out's dtype for integer tokens), with no atomics: the same bits as the
reference, run to run. Nothing here checks arguments: ``moe_kernels.padded_tokens`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton import tokens as _tokens_tri
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel
from moe_kernels.reference import padded_tokens as _ref
from moe_kernels.reference import tokens as _tokens_ref


@triton.jit
def _scatter_scan_kernel(
    out_ptr,  # (T, D), updated in place
    in_ptr,  # (EP, T_K, D)
    counts_ptr,  # (E,) int32/int64
    idx_ptr,  # (T_K,) int32/int64
    T,
    P,  # T_K
    D,
    E,
    EPR,  # experts per rank, E // EP
    stride_ot,
    stride_od,
    stride_ir,
    stride_ip,
    stride_id,
    stride_c,
    stride_x,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_EP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    N_EBLK: tl.constexpr,
    INT_ADD: tl.constexpr,  # out (and in) are integers: exact adds in out's dtype
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < D
    out_ty = out_ptr.dtype.element_ty

    # rank_end[r]: positions of the ranks <= r, each count clamped into [0, T_K] (no sum can
    # overflow, so rank_end never decreases and every rank found is < EP); past EP: the total
    r = tl.arange(0, BLOCK_EP)
    rank_end = tl.zeros((BLOCK_EP,), tl.int64)
    for i in range(N_EBLK):
        e = i * BLOCK_E + tl.arange(0, BLOCK_E)
        k = tl.load(counts_ptr + e * stride_c, mask=e < E, other=0).to(tl.int64)
        k = tl.minimum(tl.maximum(k, 0), P)
        mine = e[None, :] < (r[:, None] + 1) * EPR
        rank_end += tl.sum(tl.where(mine, k[None, :], 0), axis=1)
    limit = tl.minimum(tl.max(rank_end, axis=0), P)  # live positions: p < min(total, T_K)

    dst = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_od
    tile_in = row_in[:, None] & col_in[None, :]
    if INT_ADD:
        acc = tl.load(dst, mask=tile_in, other=0)
    else:
        acc = tl.load(dst, mask=tile_in, other=0.0).to(tl.float32)
    # which elements got a contribution: a tile of acc's shape (a per-row vector carried through
    # the two loops crashes triton 3.5's TritonGPURemoveLayoutConversions)
    touched = tl.zeros((BLOCK_T, BLOCK_D), tl.int1)
    p0 = limit * 0
    while p0 < limit:
        p = p0 + tl.arange(0, BLOCK_P)
        tok = tl.load(idx_ptr + p * stride_x, mask=p < limit, other=-1).to(tl.int64)
        match = (tok[None, :] == rows[:, None]) & row_in[:, None]
        nxt = tl.min(tl.where(match, p[None, :], limit), axis=1)  # each row's first match
        while tl.min(nxt, axis=0) < limit:
            has = nxt < limit
            rank = tl.sum((rank_end[None, :] <= nxt[:, None]).to(tl.int64), axis=1)
            src = in_ptr + rank[:, None] * stride_ir + nxt[:, None] * stride_ip
            m = has[:, None] & col_in[None, :]
            if INT_ADD:  # masked lanes add 0
                acc = acc + tl.load(src + cols[None, :] * stride_id, mask=m, other=0).to(out_ty)
            else:
                v = tl.load(src + cols[None, :] * stride_id, mask=m, other=0.0).to(tl.float32)
                # round to out's dtype after every add: the sequential in-order sum
                acc = tl.where(has[:, None], (acc + v).to(out_ty).to(tl.float32), acc)
            touched = touched | has[:, None]
            later = match & (p[None, :] > nxt[:, None])
            nxt = tl.min(tl.where(later, p[None, :], limit), axis=1)
        p0 += BLOCK_P
    tl.store(dst, acc.to(out_ty), mask=touched & col_in[None, :])


_scatter_scan = FastKernel(_scatter_scan_kernel)


class ScatterConfig(NamedTuple):
    """A plan of ``scatter_add_padded_tokens``: ``path`` "scan" or "sorted"; BLOCK_T rows x
    BLOCK_D columns per program (for "sorted": the dense scatter kernel's BLOCK_N, BLOCK_D),
    BLOCK_P indices a scan step (scan only), ``num_warps``."""

    path: str
    block_t: int
    block_d: int
    block_p: int
    num_warps: int


# The scan reads all T_K indices once per program: kept to T * T_K <= _SCAN_WORK (FBGEMM's test
# shapes, T = T_K <= 256, are far below). Scan tile: BLOCK_T x BLOCK_D <= 4096 elements, rows per
# program halved until there are ~1024 programs (small problems: 8 per SM of an H200), the match
# matrix BLOCK_T x BLOCK_P <= 1024. Interpreter: large blocks, few programs.
_SCAN_WORK = 1 << 22
_SCAN_BLOCK_D, _SCAN_TILE, _MATCH, _PROGRAMS = 1024, 4096, 1024, 1024
_INTERPRET_BLOCK_D, _INTERPRET_TILE = 4096, 16384


def pick_config(num_rows: int, num_positions: int, dim: int) -> ScatterConfig:
    """The default plan for T destination rows, T_K positions, D columns (the one heuristic)."""
    if num_rows * num_positions > _SCAN_WORK:
        block_n, block_d, num_warps = _tokens_tri.pick_config("scatter", num_rows, dim)
        return ScatterConfig("sorted", block_n, block_d, 0, num_warps)
    cap_d, tile = (
        (_INTERPRET_BLOCK_D, _INTERPRET_TILE) if INTERPRET else (_SCAN_BLOCK_D, _SCAN_TILE)
    )
    block_d = max(16, min(next_pow2(max(dim, 1)), cap_d))
    block_t = max(1, min(tile // block_d, next_pow2(max(num_rows, 1)), 16))
    chunks = cdiv(max(dim, 1), block_d)
    while not INTERPRET and block_t > 1 and cdiv(num_rows, block_t) * chunks < _PROGRAMS:
        block_t //= 2
    block_p = max(16, min(next_pow2(max(num_positions, 1)), _MATCH // block_t))
    num_warps = 4 if block_t * block_d >= 1024 else 2
    return ScatterConfig("scan", block_t, block_d, block_p, num_warps)


def scatter_add_padded(
    out_TD: torch.Tensor,
    in_RPD: torch.Tensor,
    counts_E: torch.Tensor,
    token_indices_P: torch.Tensor,
    config: ScatterConfig | None = None,
) -> None:
    """In place: ``out[idx[p]] += in[rank(p), p]`` for live positions p, ascending p per row."""
    num_rows, dim = out_TD.shape
    num_ranks, num_positions, _ = in_RPD.shape
    num_experts = counts_E.shape[0]
    if num_rows == 0 or dim == 0 or num_positions == 0 or num_experts == 0:
        return
    cfg = config or pick_config(num_rows, num_positions, dim)
    int_add = not out_TD.dtype.is_floating_point
    if cfg.path == "sorted":
        in_flat = in_RPD.reshape(num_ranks * num_positions, dim)  # a view unless strided by rank
        rows_P, total = _ref.position_rows(counts_E, num_ranks, num_positions, num_positions)
        src_N, bounds_T1 = _tokens_ref.scatter_order(token_indices_P, num_rows, total)
        cfg3 = (cfg.block_t, cfg.block_d, cfg.num_warps)
        _tokens_tri.scatter_add_sorted(out_TD, in_flat, rows_P[src_N], bounds_T1, config=cfg3)
        return
    if cfg.path != "scan":
        raise ValueError(f"ScatterConfig.path must be 'scan' or 'sorted', got {cfg.path!r}")
    block_ep = next_pow2(num_ranks)
    block_e = max(1, min(next_pow2(num_experts), 1024 // block_ep))
    grid = (cdiv(num_rows, cfg.block_t), cdiv(dim, cfg.block_d))
    _scatter_scan.launch(
        grid,
        (
            out_TD,
            in_RPD,
            counts_E,
            token_indices_P,
            num_rows,
            num_positions,
            dim,
            num_experts,
            num_experts // num_ranks,
            *out_TD.stride(),
            *in_RPD.stride(),
            counts_E.stride(0),
            token_indices_P.stride(0),
        ),
        dict(
            BLOCK_T=cfg.block_t,
            BLOCK_P=cfg.block_p,
            BLOCK_D=cfg.block_d,
            BLOCK_EP=block_ep,
            BLOCK_E=block_e,
            N_EBLK=cdiv(num_experts, block_e),
            INT_ADD=int_add,
        ),
        num_warps=cfg.num_warps,
    )
