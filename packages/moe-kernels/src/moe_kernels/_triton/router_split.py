"""Triton kernels of the router's ``"split"`` variant (``moe_kernels._router_split``): the
elementwise passes around its bf16 tensor-core GEMMs, one launch each.

* ``split_weight``: w (E, D) fp32 -> W4 (4E, D) bf16 = [hi; hi; mid; lo], the exact pieces
  ``hi = bf16(w)``, ``mid = bf16(w - hi)``, ``lo = bf16(w - hi - mid)`` (residuals exact in fp32):
  rows E:4E are the forward GEMM's operand, rows 0:3E the data gradient's.
* ``split_grad``: from the scores s (T, E) fp32 and their gradient g (T, E), the logits'
  gradient dl (softmax: ``s * (g - sum_e g s)``, the sum over a row's E in one fixed order;
  sigmoid: ``g * s * (1 - s)``) split the same way, written as A (T, 3E) = [mid | hi | hi] (the
  data gradient's operand against W4[:3E]) and B (T, 3E) = [hi | mid | lo] (the weight
  gradient's, B.T @ x).

One program per BLOCK_T rows with all E columns (``router.SPLIT_MAX_E`` bounds E); no atomics,
bitwise reproducible. Oracles: ``_router_split.split3`` and the softmax / sigmoid backward formulas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _pieces(v):
    """(hi, mid, lo) bf16 of fp32 v, summing back to v exactly."""
    hi = v.to(tl.bfloat16)
    r = v - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _split_weight_kernel(w_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out (4, N) = [hi, hi, mid, lo] of w (N,) (both contiguous, N = E * D)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    hi, mid, lo = _pieces(tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32))
    tl.store(out_ptr + i, hi, mask=m)
    tl.store(out_ptr + N + i, hi, mask=m)
    tl.store(out_ptr + 2 * N + i, mid, mask=m)
    tl.store(out_ptr + 3 * N + i, lo, mask=m)


@triton.jit
def _split_grad_kernel(
    g_ptr,  # (T, E) float
    s_ptr,  # (T, E) fp32
    a_ptr,  # (T, 3E) bf16, contiguous
    b_ptr,  # (T, 3E) bf16, contiguous
    T,
    E,
    stride_gt,
    stride_ge,
    stride_st,
    stride_se,
    SOFTMAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    m = (t < T)[:, None] & (e < E)[None, :]
    g = tl.load(g_ptr + t[:, None] * stride_gt + e[None, :] * stride_ge, mask=m, other=0.0)
    s = tl.load(s_ptr + t[:, None] * stride_st + e[None, :] * stride_se, mask=m, other=0.0)
    g = g.to(tl.float32)
    s = s.to(tl.float32)
    if SOFTMAX:
        dl = s * (g - tl.sum(g * s, axis=1)[:, None])
    else:
        dl = g * s * (1.0 - s)
    hi, mid, lo = _pieces(dl)
    row = t[:, None] * (3 * E) + e[None, :]
    tl.store(a_ptr + row, mid, mask=m)
    tl.store(a_ptr + row + E, hi, mask=m)
    tl.store(a_ptr + row + 2 * E, hi, mask=m)
    tl.store(b_ptr + row, hi, mask=m)
    tl.store(b_ptr + row + E, mid, mask=m)
    tl.store(b_ptr + row + 2 * E, lo, mask=m)


_split_weight = FastKernel(_split_weight_kernel)
_split_grad = FastKernel(_split_grad_kernel)


def split_weight(w_ED: torch.Tensor) -> torch.Tensor:
    """W4 (4E, D) bf16 = [hi; hi; mid; lo] of fp32 w_ED (module docstring)."""
    E, D = w_ED.shape
    w = w_ED.float().contiguous()
    out = torch.empty((4 * E, D), dtype=torch.bfloat16, device=w.device)
    n = E * D
    if n == 0:
        return out
    block = 1024
    _split_weight.launch((cdiv(n, block),), (w, out, n), dict(BLOCK=block), num_warps=4)
    return out


def split_grad(
    g_TE: torch.Tensor, s_TE: torch.Tensor, softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B), each (T, 3E) bf16: the logits' gradient's pieces (module docstring)."""
    T, E = s_TE.shape
    a = torch.empty((T, 3 * E), dtype=torch.bfloat16, device=s_TE.device)
    b = torch.empty_like(a)
    if T == 0:
        return a, b
    block_e = next_pow2(E)
    block_t = 4 if INTERPRET else max(1, min(32, 4096 // block_e))
    args = (g_TE, s_TE, a, b, T, E, g_TE.stride(0), g_TE.stride(1), s_TE.stride(0),
            s_TE.stride(1))  # fmt: skip
    constexprs = dict(SOFTMAX=softmax, BLOCK_T=block_t, BLOCK_E=block_e)
    _split_grad.launch((cdiv(T, block_t),), args, constexprs, num_warps=4)
    return a, b
