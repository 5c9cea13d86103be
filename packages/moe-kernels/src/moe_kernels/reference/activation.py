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


def activation_backward_weighted(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, w_M: torch.Tensor, tok_M: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, aw, dw): with w' = w where tok >= 0 else 0, dh = the activation's backward of
    w' grad, aw = w' act(h) in h's dtype, dw = sum over H of grad * act(h) (fp32; 0 where
    tok < 0). fp32 math."""
    live = tok_M >= 0
    w = torch.where(live, w_M.float(), 0.0)[:, None]
    h = h_MX.float()
    g, u = h.chunk(2, dim=-1) if gated else (h, None)
    a = _silu(g) if u is None else _silu(g) * u
    go = grad_MH.float()
    dw = torch.where(live, (go * a).sum(dim=-1), 0.0)
    return activation_backward(go * w, h_MX, gated), (a * w).to(h_MX.dtype), dw
