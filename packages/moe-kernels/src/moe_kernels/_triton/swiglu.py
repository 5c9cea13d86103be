"""Triton kernels of ``silu_mul`` and ``silu_mul_quant``, and their launchers.

Both evaluate FBGEMM's expression ``x0 * tl.sigmoid(x0) * x1`` in fp32 (``tl.sigmoid(x)`` is
``1 / (1 + exp(-x))``; on the GPU an ``ex2.approx`` and a ``div.full``), so on the GPU their values
equal FBGEMM's bit for bit. ``silu_mul`` tiles a 2-D grid of (BLOCK_T rows, BLOCK_D columns);
``silu_mul_quant`` gives each program BLOCK_T whole rows, held in registers when BLOCK_D >= D and
otherwise walked twice in chunks (row maxima, then recompute and quantise). Strided inputs are
read through their strides (16-byte vectors where the column stride is 1), row offsets in int64.
Rows >= *valid_token_count are written as zeros (scales too) without reading the inputs.
Nothing here checks arguments: ``moe_kernels.swiglu`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import e4m3_native
from moe_kernels._triton.blocks import cdiv
from moe_kernels._triton.fp8_rowwise import (
    RowConfig,
    check_config,
    col64,
    col_offsets,
    e4m3_bits,
    num_chunks,
    pick_config,
    row_absmax,
    row_scales,
)
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _live_rows(rows, T, vtc_ptr, HAS_VTC: tl.constexpr):
    live = rows < T
    if HAS_VTC:
        live = live & (rows < tl.load(vtc_ptr).to(tl.int64))
    return live


@triton.jit
def _silu_mul_tile(
    x0_ptr, x1_ptr, rows, live, cols, D, stride_0t, stride_0d, stride_1t, stride_1d,
    COL64: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """fp32 (rows, cols) tile of x0 * sigmoid(x0) * x1; zero where not live or cols >= D."""
    mask = live[:, None] & (cols < D)[None, :]
    p0 = x0_ptr + rows[:, None] * stride_0t + col_offsets(cols, stride_0d, COL64)[None, :]
    p1 = x1_ptr + rows[:, None] * stride_1t + col_offsets(cols, stride_1d, COL64)[None, :]
    x0 = tl.load(p0, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    x1 = tl.load(p1, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return x0 * tl.sigmoid(x0) * x1  # masked lanes: 0 * 0.5 * 0 = +0


@triton.jit
def _silu_mul_kernel(
    y_ptr,  # (T, D), contiguous, x0's dtype
    x0_ptr,
    x1_ptr,
    vtc_ptr,  # (1,) int (HAS_VTC only)
    T,
    D,
    stride_0t,
    stride_0d,
    stride_1t,
    stride_1d,
    HAS_VTC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COL64: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = _live_rows(rows, T, vtc_ptr, HAS_VTC)
    y = _silu_mul_tile(x0_ptr, x1_ptr, rows, live, cols, D, stride_0t, stride_0d, stride_1t,
                       stride_1d, COL64, "evict_first")  # fmt: skip
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    q_ptr,  # (T, D) uint8: e4m3fn bits, contiguous
    scale_ptr,  # (T,) fp32
    x0_ptr,
    x1_ptr,
    ub_ptr,  # (1,) fp32 (HAS_UB only)
    vtc_ptr,  # (1,) int (HAS_VTC only)
    T,
    D,
    stride_0t,
    stride_0d,
    stride_1t,
    stride_1d,
    HAS_UB: tl.constexpr,
    HAS_VTC: tl.constexpr,
    IEEE_DIV: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # 1: the whole row in registers
    COL64: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    live = _live_rows(rows, T, vtc_ptr, HAS_VTC)
    cols = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + rows[:, None] * D
    if NUM_CHUNKS == 1:
        v = _silu_mul_tile(x0_ptr, x1_ptr, rows, live, cols, D, stride_0t, stride_0d, stride_1t,
                           stride_1d, COL64, "evict_first")  # fmt: skip
        s, inv = row_scales(row_absmax(v), ub_ptr, HAS_UB, IEEE_DIV)
        bits = e4m3_bits(v, s[:, None], NATIVE_CAST)
        tl.store(q_rows + cols[None, :], bits, mask=row_in[:, None] & (cols < D)[None, :])
    else:
        amax = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for c in range(NUM_CHUNKS):  # pass 1: row maxima (inputs kept in L2 for pass 2)
            v = _silu_mul_tile(x0_ptr, x1_ptr, rows, live, c * BLOCK_D + cols, D, stride_0t,
                               stride_0d, stride_1t, stride_1d, COL64, "evict_last")  # fmt: skip
            amax = tl.maximum(amax, row_absmax(v))
        s, inv = row_scales(amax, ub_ptr, HAS_UB, IEEE_DIV)
        for c in range(NUM_CHUNKS):  # pass 2: the same values again, quantised
            cc = c * BLOCK_D + cols
            v = _silu_mul_tile(x0_ptr, x1_ptr, rows, live, cc, D, stride_0t, stride_0d,
                               stride_1t, stride_1d, COL64, "evict_first")  # fmt: skip
            bits = e4m3_bits(v, s[:, None], NATIVE_CAST)
            tl.store(q_rows + cc[None, :], bits, mask=row_in[:, None] & (cc < D)[None, :])
    tl.store(scale_ptr + rows, tl.where(live, inv, 0.0), mask=row_in)


_silu_mul = FastKernel(_silu_mul_kernel)
_silu_mul_quant = FastKernel(_silu_mul_quant_kernel)


def silu_mul(
    x0_TD: torch.Tensor,
    x1_TD: torch.Tensor,
    valid_token_count: torch.Tensor | None,
    *,
    config: RowConfig | None = None,
) -> torch.Tensor:
    """(T, D) in x0's dtype: x0 * sigmoid(x0) * x1 in fp32, rows >= valid_token_count zero.
    ``config`` overrides the launch shape (``fp8_rowwise.pick_config("elementwise", T, D)``)."""
    num_rows, dim = x0_TD.shape
    out = torch.empty((num_rows, dim), dtype=x0_TD.dtype, device=x0_TD.device)
    if out.numel() == 0:
        return out
    cfg = pick_config("elementwise", num_rows, dim) if config is None else check_config(config)
    grid = (cdiv(num_rows, cfg.block_t), cdiv(dim, cfg.block_d))
    args = (out, x0_TD, x1_TD, x0_TD if valid_token_count is None else valid_token_count,
            num_rows, dim, *x0_TD.stride(), *x1_TD.stride())  # fmt: skip
    consts = dict(
        HAS_VTC=valid_token_count is not None,
        BLOCK_T=cfg.block_t,
        BLOCK_D=cfg.block_d,
        COL64=col64(dim, x0_TD.stride(1), x1_TD.stride(1)),
    )
    _silu_mul.launch(grid, args, consts, num_warps=cfg.num_warps)
    return out


def silu_mul_quant(
    x0_TD: torch.Tensor,
    x1_TD: torch.Tensor,
    scale_ub: torch.Tensor | None,
    valid_token_count: torch.Tensor | None,
    *,
    config: RowConfig | None = None,
    ieee_div: bool = False,
    native_cast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, D) float8_e4m3fn, scale (T,) fp32): the row-wise quantisation of the fp32
    silu_mul value. ``config`` overrides the launch shape (``pick_config("quant", T, D)``);
    ``ieee_div=True`` divides with IEEE division (the reference's; default: FBGEMM's
    ``div.full.f32`` on the GPU); ``native_cast`` (default: on GPUs with the e4m3 type,
    sm_89+) picks the hardware e4m3 cast over the integer rounding."""
    num_rows, dim = x0_TD.shape
    q = torch.empty((num_rows, dim), dtype=torch.uint8, device=x0_TD.device)
    scale = torch.empty((num_rows,), dtype=torch.float32, device=x0_TD.device)
    if num_rows > 0:
        cfg = pick_config("quant", num_rows, dim) if config is None else check_config(config)
        args = (q, scale, x0_TD, x1_TD, x0_TD if scale_ub is None else scale_ub,
                x0_TD if valid_token_count is None else valid_token_count, num_rows, dim,
                *x0_TD.stride(), *x1_TD.stride())  # fmt: skip
        consts = dict(
            HAS_UB=scale_ub is not None,
            HAS_VTC=valid_token_count is not None,
            IEEE_DIV=ieee_div,
            NATIVE_CAST=e4m3_native(x0_TD.device) if native_cast is None else native_cast,
            BLOCK_T=cfg.block_t,
            BLOCK_D=cfg.block_d,
            NUM_CHUNKS=num_chunks(dim, cfg.block_d),
            COL64=col64(dim, x0_TD.stride(1), x1_TD.stride(1)),
        )
        _silu_mul_quant.launch((cdiv(num_rows, cfg.block_t),), args, consts,
                               num_warps=cfg.num_warps)  # fmt: skip
    return q.view(torch.float8_e4m3fn), scale
