"""Triton kernel of the token ops' backward: gathered rows and row dot products in one pass.

``rows[p] = (w[p] *) b[tok[p]]`` (the incoming gradient of ``combine`` sent back to the sorted
rows) and ``dots[p] = a[p] . b[tok[p]]`` (the gradient of a pair's weight), both from one read of
``b[tok[p]]``. One program per BLOCK_P rows walks D in BLOCK_D chunks (unrolled): each row's
dot is the fp32 sum of its chunks' partial sums in chunk order (no split over programs, no
atomics). Rows whose token is outside [0, T) give zero rows and zero dots. Nothing here checks
arguments: the public module ``moe_kernels.tokens`` does that before any launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _gather_dots_kernel(
    a_ptr,  # (P, D) (DOTS only)
    b_ptr,  # (T, D)
    tok_ptr,  # (P,) int32/int64
    w_ptr,  # (P,) float (SCALE only)
    rows_ptr,  # (P, D), contiguous (ROWS only)
    dots_ptr,  # (P,) fp32 (DOTS only)
    P,
    T,
    D,
    stride_ap,
    stride_ad,
    stride_bt,
    stride_bd,
    SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    DOTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_D: tl.constexpr,  # cdiv(D, BLOCK_D): the chunk loop unrolled (no helper: see below)
):
    # One body, no @jit helper taking the pointers: Inductor's mutation analysis would count
    # pointers whose loads feed a helper's stored result as written (and copy them).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    row_in = rows < P
    tok = tl.load(tok_ptr + rows, mask=row_in, other=-1).to(tl.int64)
    live = row_in & (tok >= 0) & (tok < T)
    if SCALE:
        w = tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK_P,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for c in tl.static_range(NUM_D):
        cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
        col_in = cols < D
        m = live[:, None] & col_in[None, :]
        b_src = b_ptr + tok[:, None] * stride_bt + cols[None, :] * stride_bd
        b = tl.load(b_src, mask=m, other=0.0).to(tl.float32)
        if ROWS:
            r = b * w[:, None]
            dst = rows_ptr + rows[:, None] * D + cols[None, :]
            tl.store(dst, r.to(rows_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])
        if DOTS:
            a_src = a_ptr + rows[:, None] * stride_ap + cols[None, :] * stride_ad
            a = tl.load(a_src, mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(a * b, axis=1)
    if DOTS:
        tl.store(dots_ptr + rows, acc, mask=row_in)


_launcher = FastKernel(_gather_dots_kernel)


def gather_dots(
    a_PD: torch.Tensor | None,
    b_TD: torch.Tensor,
    tok_P: torch.Tensor,
    w_P: torch.Tensor | None,
    rows_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows (P, D) in ``rows_dtype`` or None, dots (P,) fp32 or None); see the module."""
    num_rows, dim = tok_P.shape[0], b_TD.shape[1]
    dev = b_TD.device
    rows = (
        None if rows_dtype is None else torch.empty((num_rows, dim), dtype=rows_dtype, device=dev)
    )
    dots = None if a_PD is None else torch.empty(num_rows, dtype=torch.float32, device=dev)
    if num_rows == 0 or (rows is None and dots is None):
        return rows, dots
    block_d = 64 if INTERPRET else min(max(next_pow2(dim), 16), 256)
    block_p = 32 if INTERPRET else max(1, 2048 // block_d)
    dummy = rows if rows is not None else dots
    a = a_PD if a_PD is not None else b_TD
    args = (a, b_TD, tok_P, w_P if w_P is not None else dummy, rows if rows is not None else dummy,
            dots if dots is not None else dummy, num_rows, b_TD.shape[0], dim, a.stride(0),
            a.stride(1), b_TD.stride(0), b_TD.stride(1))  # fmt: skip
    constexprs = dict(SCALE=w_P is not None, ROWS=rows is not None, DOTS=dots is not None,
                      BLOCK_P=block_p, BLOCK_D=block_d, NUM_D=cdiv(dim, block_d))  # fmt: skip
    _launcher.launch((cdiv(num_rows, block_p),), args, constexprs, num_warps=4)
    return rows, dots
