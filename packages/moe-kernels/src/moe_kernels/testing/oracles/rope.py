"""Attention-prologue oracles (``qk_norm_rope``): the RMS norm and the rotation in float64 (each
pair as a complex product), and the world model's former formula written out in torch ops."""

from __future__ import annotations

import torch

__all__ = ["oracle_norm_rope", "oracle_rope_model_formula"]


def oracle_norm_rope(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
):
    """(N, h, D) float64 of x (N, h * D) with norm weight w (D,) and cos, sin (N, D/2): the RMS
    norm in float64 rounded to x's dtype (where the contract rounds), each pair (y0, y1)
    multiplied as the complex number y0 + i y1 by cos + i sin."""
    D = w.shape[0]
    x64 = x.double().cpu().reshape(x.shape[0], -1, D)
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()
    y = y.to(x.dtype).double()
    turn = torch.complex(cos.double().cpu(), sin.double().cpu())[:, None, :]
    return torch.view_as_real(torch.complex(y[..., 0::2], y[..., 1::2]) * turn).flatten(-2)


def oracle_rope_model_formula(q, k, v, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, layer,
                              slot, eps):  # fmt: skip
    """The world model's attention prologue before ``qk_norm_rope`` (moe_model.attention / rope /
    kv_cache), written out: RMSNorm, apply_rope, kv_write's index_copy_ (into the caches
    (L, K, S, N, D) at ``layer``, ``slot``), q folded for SDPA: returns (K, G * N, D)."""

    def rms_norm(x, w):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        y = y * w.float()
        return y.to(x.dtype)

    def apply_rope(x_NHD):
        N, H, D = x_NHD.shape
        x_NHP2 = x_NHD.float().view(N, H, D // 2, 2)
        x0, x1 = x_NHP2[..., 0], x_NHP2[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
        return out.view(N, H, D).to(x_NHD.dtype)

    N, Dh = k.shape[0], k_cache.shape[-1]
    Hkv, H = k.shape[1] // Dh, q.shape[1] // Dh
    k_HND = apply_rope(rms_norm(k.reshape(N, Hkv, Dh), k_norm_w)).transpose(0, 1)
    v_HND = v.reshape(N, Hkv, Dh).transpose(0, 1)
    k_cache[layer].index_copy_(1, slot, k_HND.unsqueeze(1))
    v_cache[layer].index_copy_(1, slot, v_HND.unsqueeze(1))
    q_NHD = apply_rope(rms_norm(q.reshape(N, H, Dh), q_norm_w))
    G = H // Hkv
    return q_NHD.view(N, Hkv, G, Dh).permute(1, 2, 0, 3).reshape(Hkv, G * N, Dh)
