"""Grouped-query self-attention with QK-norm and 3-axis RoPE over the KV ring buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_model.kv_cache import KVRingCache
from moe_model.rope import apply_rope


class RMSNorm(nn.Module):
    """RMS normalisation in fp32 over the last dim, optional learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class Attention(nn.Module):
    """One frame's N tokens attend to the filled ring slots and to themselves.

    Query head h uses kv head h // G (G = n_heads // n_kv_heads). The G query heads sharing a kv
    head are folded into the query length, so a plain SDPA call (no GQA support needed) runs
    (kv_heads, G * N, head_dim) queries against (kv_heads, (window + 1) * N, head_dim) keys.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self,
        x_ND: torch.Tensor,
        cos_NP: torch.Tensor,
        sin_NP: torch.Tensor,
        cache: KVRingCache,
        layer: int,
        bias_S: torch.Tensor | None,
        *,
        commit: bool,
        kv_only: bool = False,
    ) -> torch.Tensor | None:
        """``bias_S``: additive mask over the (window + 1) * N keys, or None when every slot is
        filled (then SDPA can take its flash kernel). ``commit``: also write this frame's
        keys/values into the ring slot (after attending, so the frame sees the same history as
        in the denoise pass). ``kv_only``: commit only."""
        N = x_ND.shape[0]
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        k_NHD = apply_rope(self.k_norm(self.k_proj(x_ND).view(N, Hkv, Dh)), cos_NP, sin_NP)
        k_HND = k_NHD.transpose(0, 1)
        v_HND = self.v_proj(x_ND).view(N, Hkv, Dh).transpose(0, 1)
        if kv_only:
            cache.commit(layer, k_HND, v_HND)
            return None
        q_NHD = apply_rope(self.q_norm(self.q_proj(x_ND).view(N, H, Dh)), cos_NP, sin_NP)
        cache.write_scratch(layer, k_HND, v_HND)
        k_HSD, v_HSD = cache.layer_kv(layer)
        G = H // Hkv
        q_HMD = q_NHD.view(N, Hkv, G, Dh).permute(1, 2, 0, 3).reshape(Hkv, G * N, Dh)
        o_HMD = F.scaled_dot_product_attention(
            q_HMD[None],
            k_HSD[None],
            v_HSD[None],
            attn_mask=None if bias_S is None else bias_S.view(1, 1, 1, -1),
        )[0]
        o_ND = o_HMD.view(Hkv, G, N, Dh).permute(2, 0, 1, 3).reshape(N, H * Dh)
        if commit:
            cache.commit(layer, k_HND, v_HND)
        return self.o_proj(o_ND)
