"""Triton kernels of the expert activation (SiLU, or SwiGLU ``silu(gate) * up``), forward and
backward, and their launchers.

Elementwise over (BLOCK_M, BLOCK_H) tiles of a 2-D grid; every value computed in fp32 and cast
once to the output dtype. ``silu(g) = g / (1 + exp(-g))``, ``silu'(g) = s (1 + g (1 - s))`` with
``s = 1 / (1 + exp(-g))``. Nothing here checks arguments: ``moe_kernels.activation`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _activation_kernel(
    h_ptr, out_ptr, M, H, stride_hm, stride_hh,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    g_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :] * stride_hh
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g))
    if GATED:
        u = tl.load(g_ptrs + H * stride_hh, mask=mask, other=0.0).to(tl.float32)
        y = y * u
    out = out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activation_backward_kernel(
    go_ptr, h_ptr, dh_ptr, out_ptr, M, H, stride_gm, stride_gh, stride_hm, stride_hh,
    GATED: tl.constexpr, STORE_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    go = tl.load(go_ptr + r64 * stride_gm + cols[None, :] * stride_gh, mask=mask, other=0.0)
    go = go.to(tl.float32)
    g_ptrs = h_ptr + r64 * stride_hm + cols[None, :] * stride_hh
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    denom = 1.0 + tl.exp(-g)
    s = 1.0 / denom
    dsilu = s * (1.0 + g * (1.0 - s))
    silu = g / denom  # the forward's formula, bit for bit
    width = 2 * H if GATED else H
    dg_ptrs = dh_ptr + r64 * width + cols[None, :]
    out_ptrs = out_ptr + r64 * H + cols[None, :]
    if GATED:
        u = tl.load(g_ptrs + H * stride_hh, mask=mask, other=0.0).to(tl.float32)
        tl.store(dg_ptrs, (go * u * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptrs + H, (go * silu).to(dh_ptr.dtype.element_ty), mask=mask)
        if STORE_OUT:
            tl.store(out_ptrs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dg_ptrs, (go * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
        if STORE_OUT:
            tl.store(out_ptrs, silu.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_backward_kernel(
    go_ptr, h_ptr, w_ptr, tok_ptr, dh_ptr, aw_ptr, dw_ptr, M, H, stride_gm, stride_hm,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, N_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Whole rows per program (the dot over H in BLOCK_H chunks, in order): with go = d(act)
    unweighted, dw = sum(go * act(h)), dh = act'(h) (w go), aw = w act(h); rows whose token is
    -1 count with weight 0 and dw 0."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = rows < M
    tok = tl.load(tok_ptr + rows, mask=in_m, other=-1)
    live = in_m & (tok >= 0)
    w = tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    width = 2 * H if GATED else H
    dot = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(N_CHUNKS):  # (a constexpr count: Triton 3.5's interpreter cannot range over H)
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = in_m[:, None] & (cols < H)[None, :]
        go = tl.load(go_ptr + r64 * stride_gm + cols[None, :], mask=mask, other=0.0)
        go = go.to(tl.float32)
        g_ptrs = h_ptr + r64 * stride_hm + cols[None, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        denom = 1.0 + tl.exp(-g)
        s = 1.0 / denom
        dsilu = s * (1.0 + g * (1.0 - s))
        silu = g / denom
        dg_ptrs = dh_ptr + r64 * width + cols[None, :]
        gw = go * w
        if GATED:
            u = tl.load(g_ptrs + H, mask=mask, other=0.0).to(tl.float32)
            a = silu * u
            tl.store(dg_ptrs, (gw * u * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dg_ptrs + H, (gw * silu).to(dh_ptr.dtype.element_ty), mask=mask)
        else:
            a = silu
            tl.store(dg_ptrs, (gw * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(aw_ptr + r64 * H + cols[None, :], (a * w).to(aw_ptr.dtype.element_ty), mask=mask)
        dot += tl.sum(go * a, axis=1)
    tl.store(dw_ptr + rows, tl.where(live, dot, 0.0), mask=in_m)


_forward = FastKernel(_activation_kernel)
_backward = FastKernel(_activation_backward_kernel)
_weighted_backward = FastKernel(_weighted_backward_kernel)


def _blocks(m: int, h: int) -> tuple[int, int]:
    if INTERPRET:  # few, large programs
        return max(1, min(64, next_pow2(m))), max(1, min(256, next_pow2(h)))
    return 8, max(16, min(256, next_pow2(h)))


def activation(h_MX: torch.Tensor, gated: bool) -> torch.Tensor:
    """(M, H) in h's dtype; see ``moe_kernels.activation.expert_activation``."""
    m, width = h_MX.shape
    hidden = width // 2 if gated else width
    out = torch.empty((m, hidden), dtype=h_MX.dtype, device=h_MX.device)
    if out.numel() == 0:
        return out
    bm, bh = _blocks(m, hidden)
    args = (h_MX, out, m, hidden, h_MX.stride(0), h_MX.stride(1))
    _forward.launch((cdiv(m, bm), cdiv(hidden, bh)), args,
                    dict(GATED=gated, BLOCK_M=bm, BLOCK_H=bh), num_warps=4)  # fmt: skip
    return out


def activation_backward(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, gated: bool, out_MH: torch.Tensor | None = None
) -> torch.Tensor:
    """(M, H or 2H) in h's dtype: the gradient of the activation's input; with ``out_MH`` (M, H)
    contiguous, the same pass also writes the activation itself there (the forward's bits)."""
    m, width = h_MX.shape
    hidden = width // 2 if gated else width
    dh = torch.empty((m, width), dtype=h_MX.dtype, device=h_MX.device)
    if dh.numel() == 0:
        return dh
    bm, bh = _blocks(m, hidden)
    args = (grad_MH, h_MX, dh, dh if out_MH is None else out_MH, m, hidden, grad_MH.stride(0),
            grad_MH.stride(1), h_MX.stride(0), h_MX.stride(1))  # fmt: skip
    meta = dict(GATED=gated, STORE_OUT=out_MH is not None, BLOCK_M=bm, BLOCK_H=bh)
    _backward.launch((cdiv(m, bm), cdiv(hidden, bh)), args, meta, num_warps=4)
    return dh


def activation_backward_weighted(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, w_M: torch.Tensor, tok_M: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh (M, X), aw (M, H) in h's dtype, dw (M,) fp32); see
    ``moe_kernels.activation.activation_grad_weighted``. grad and h contiguous in their last dim."""
    m, width = h_MX.shape
    hidden = width // 2 if gated else width
    dh = torch.empty((m, width), dtype=h_MX.dtype, device=h_MX.device)
    aw = torch.empty((m, hidden), dtype=h_MX.dtype, device=h_MX.device)
    dw = torch.empty((m,), dtype=torch.float32, device=h_MX.device)
    if m == 0:
        return dh, aw, dw
    bm, bh = _blocks(m, hidden)
    if not INTERPRET:
        bm = 4
    args = (grad_MH, h_MX, w_M, tok_M, dh, aw, dw, m, hidden, grad_MH.stride(0), h_MX.stride(0))
    meta = dict(GATED=gated, BLOCK_M=bm, BLOCK_H=bh, N_CHUNKS=cdiv(hidden, bh))
    _weighted_backward.launch((cdiv(m, bm),), args, meta, num_warps=4)
    return dh, aw, dw
