"""Pure-torch reference of the expert activation and its backward (the CPU path and the tests'
oracle): fp32 math, one cast, the formulas of ``moe_kernels._triton.activation``."""

from __future__ import annotations

import torch


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def activation(h_MX: torch.Tensor, gated: bool) -> torch.Tensor:
    """silu(h), or silu(h[:, :H]) * h[:, H:] for ``gated``; fp32 math, h's dtype."""
    h = h_MX.float()
    if not gated:
        return _silu(h).to(h_MX.dtype)
    g, u = h.chunk(2, dim=-1)
    return (_silu(g) * u).to(h_MX.dtype)


def activation_backward(grad_MH: torch.Tensor, h_MX: torch.Tensor, gated: bool) -> torch.Tensor:
    """d h: go * silu'(g) (times u), and go * silu(g) for the up half; fp32 math, h's dtype."""
    go = grad_MH.float()
    h = h_MX.float()
    g, u = h.chunk(2, dim=-1) if gated else (h, None)
    s = 1.0 / (1.0 + torch.exp(-g))
    dsilu = s * (1.0 + g * (1.0 - s))
    if not gated:
        return (go * dsilu).to(h_MX.dtype)
    return torch.cat([go * u * dsilu, go * _silu(g)], dim=-1).to(h_MX.dtype)
