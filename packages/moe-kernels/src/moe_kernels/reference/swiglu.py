"""Pure-torch references of ``silu_mul`` and ``silu_mul_quant`` (the CPU path and the tests'
oracle): the expression of ``moe_kernels._triton.swiglu`` in fp32, rounding step for rounding
step, with torch's exp and IEEE division (the GPU's exp and division are approximate: see
``moe_kernels.swiglu``)."""

from __future__ import annotations

import torch

from moe_kernels.reference.fp8_rowwise import live_rows, quantize_rows


def silu_mul_fp32(
    x0_TD: torch.Tensor, x1_TD: torch.Tensor, valid_token_count: torch.Tensor | None
) -> torch.Tensor:
    """(T, D) fp32: ``(x0 * (1 / (1 + exp(-x0)))) * x1`` in fp32; rows >= valid_token_count 0."""
    a = x0_TD.float()
    sig = torch.reciprocal(1.0 + torch.exp(-a))  # 1 / d: IEEE (no scalar-times-reciprocal)
    y = (a * sig) * x1_TD.float()
    live_T = live_rows(y.shape[0], valid_token_count, y.device)
    if live_T is not None:
        y = torch.where(live_T[:, None], y, 0.0)
    return y


def silu_mul(
    x0_TD: torch.Tensor, x1_TD: torch.Tensor, valid_token_count: torch.Tensor | None = None
) -> torch.Tensor:
    """(T, D) in x0's dtype, contiguous: the fp32 value, rounded once."""
    return silu_mul_fp32(x0_TD, x1_TD, valid_token_count).to(x0_TD.dtype).contiguous()


def silu_mul_quant(
    x0_TD: torch.Tensor,
    x1_TD: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, D) float8_e4m3fn, scale (T,) fp32): the row-wise quantisation of the fp32 value."""
    v = silu_mul_fp32(x0_TD, x1_TD, None)
    return quantize_rows(v, live_rows(v.shape[0], valid_token_count, v.device), scale_ub)
