"""Triton K-grouped GEMM: the weight gradient of a grouped GEMM, and its launcher.

``out[e] = dy[rows of e].T @ x[src of those rows]`` for the rows p of group e
(``offsets[e] <= p < offsets[e+1]``; src = ``row_indices[p]``, or p without them).

Grid: (n-tiles x d-tiles, E), static. Program (tile, e) loads its group's two boundaries and runs
over the group's rows in BK-row steps, accumulating ``dy_tile.T @ x_tile`` in fp32 (no split over
rows, no atomics: one fixed order, bitwise reproducible); an empty group stores zeros. Rows whose
source is outside [0, T) contribute nothing. Nothing here checks arguments: the public module
``moe_kernels.grouped_mm`` does that before any launch.
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
def _rows_step(
    acc,
    r0,
    end,
    dy_ptr,
    x_ptr,
    ridx_ptr,
    T,
    stride_dyp,
    stride_dyn,
    stride_xt,
    stride_xd,
    ns,
    ds,
    n_in,
    d_in,
    HAS_RIDX: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """acc + dy[r0:r0+BK, ns].T @ x[src[r0:r0+BK], ds], rows at or past ``end`` read as zero."""
    rows = r0 + tl.arange(0, BK)
    row_in = rows < end
    if HAS_RIDX:
        src = tl.load(ridx_ptr + rows, mask=row_in, other=-1).to(tl.int64)
        live = row_in & (src >= 0) & (src < T)
    else:
        src = rows.to(tl.int64)
        live = row_in
    dy = tl.load(
        dy_ptr + rows.to(tl.int64)[:, None] * stride_dyp + ns[None, :] * stride_dyn,
        mask=live[:, None] & n_in[None, :],
        other=0.0,
    )
    x = tl.load(
        x_ptr + src[:, None] * stride_xt + ds[None, :] * stride_xd,
        mask=live[:, None] & d_in[None, :],
        other=0.0,
    )
    if UPCAST:
        dy = dy.to(tl.float32)
        x = x.to(tl.float32)
    if IEEE:
        return tl.dot(tl.trans(dy), x, acc, input_precision="ieee")
    return tl.dot(tl.trans(dy), x, acc)


@triton.jit
def _grouped_weight_grad_kernel(
    dy_ptr,  # (P, N)
    x_ptr,  # (T, D)
    offs_ptr,  # (E+1,) int32/int64
    ridx_ptr,  # (P,) int32/int64 (HAS_RIDX only)
    out_ptr,  # (E, N, D), contiguous
    T,
    P,
    N,
    D,
    stride_dyp,
    stride_dyn,
    stride_xt,
    stride_xd,
    HAS_RIDX: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    WHILE_LOOPS: tl.constexpr,  # interpreter: triton 3.5's cannot range() over a runtime bound
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_d = tl.cdiv(D, BD)
    ns = (pid // num_d) * BN + tl.arange(0, BN)
    ds = (pid % num_d) * BD + tl.arange(0, BD)
    n_in = ns < N
    d_in = ds < D
    # Clamp for memory safety (offsets are trusted to be a non-decreasing prefix sum <= P).
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int32), 0), P)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + e + 1).to(tl.int32), start), P)
    acc = tl.zeros((BN, BD), dtype=tl.float32)
    if WHILE_LOOPS:
        r0 = start
        while r0 < end:
            acc = _rows_step(
                acc, r0, end, dy_ptr, x_ptr, ridx_ptr, T, stride_dyp, stride_dyn, stride_xt,
                stride_xd, ns, ds, n_in, d_in, HAS_RIDX, BK, UPCAST, IEEE,
            )  # fmt: skip
            r0 += BK
    else:
        for r0 in range(start, end, BK):
            acc = _rows_step(
                acc, r0, end, dy_ptr, x_ptr, ridx_ptr, T, stride_dyp, stride_dyn, stride_xt,
                stride_xd, ns, ds, n_in, d_in, HAS_RIDX, BK, UPCAST, IEEE,
            )  # fmt: skip
    out = out_ptr + e.to(tl.int64) * N * D + ns.to(tl.int64)[:, None] * D + ds[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_in[:, None] & d_in[None, :])


class WgradConfig(NamedTuple):
    """Tile shape and launch parameters of one weight-gradient launch."""

    block_n: int = 128
    block_d: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def pick_config(n: int, d: int) -> WgradConfig:
    """128 x 128 output tiles over 64-row steps, 8 warps, 3 stages on the GPU (smaller tiles for
    small N or D): the best of the H200 sweep at 4096-131072 rows (``benchmarks/gpu/
    train_gpu.py --sweep``; 1907 us against CUTLASS's 1449 at 131072 x 1536 x 2048, E=128, where
    ``grouped_weight_grad`` runs CUTLASS); the interpreter: few, large programs."""
    clamp = lambda v, lo, hi: max(lo, min(hi, next_pow2(max(v, 1))))  # noqa: E731
    if INTERPRET:
        return WgradConfig(clamp(n, 16, 64), clamp(d, 16, 64), 16, 4, 1)
    return WgradConfig(clamp(n, 16, 128), clamp(d, 16, 128), 64, 8, 3)


_launcher = FastKernel(_grouped_weight_grad_kernel)


def grouped_weight_grad(
    dy_PN: torch.Tensor,
    x_TD: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: WgradConfig | None = None,
) -> torch.Tensor:
    """(E, N, D) in ``out_dtype``; see ``moe_kernels.grouped_mm.grouped_weight_grad``."""
    num_rows, n = dy_PN.shape
    num_tokens, dim = x_TD.shape
    num_experts = offsets_E1.shape[0] - 1
    out = torch.empty((num_experts, n, dim), dtype=out_dtype, device=dy_PN.device)
    if out.numel() == 0:
        return out
    if num_rows == 0 or num_tokens == 0:
        return out.zero_()
    cfg = config or pick_config(n, dim)
    grid = (cdiv(n, cfg.block_n) * cdiv(dim, cfg.block_d), num_experts)
    args = (
        dy_PN,
        x_TD,
        offsets_E1,
        row_indices_P if row_indices_P is not None else offsets_E1,
        out,
        num_tokens,
        num_rows,
        n,
        dim,
        dy_PN.stride(0),
        dy_PN.stride(1),
        x_TD.stride(0),
        x_TD.stride(1),
    )
    constexprs = dict(
        HAS_RIDX=row_indices_P is not None,
        BN=cfg.block_n,
        BD=cfg.block_d,
        BK=cfg.block_k,
        UPCAST=INTERPRET,
        IEEE=x_TD.dtype == torch.float32,
        WHILE_LOOPS=INTERPRET,
    )
    _launcher.launch(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
