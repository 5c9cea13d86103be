"""Transformer blocks of the world model: adaptive-RMSNorm modulation, attention, MoE/dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_model.attention import Attention, RMSNorm
from moe_model.config import WorldModelConfig
from moe_model.kv_cache import KVRingCache
from moe_model.moe import MoELayer


class DenseMLP(nn.Module):
    """SiLU (or SwiGLU when gated) MLP without biases."""

    def __init__(self, d_model: int, hidden: int, gated: bool = False) -> None:
        super().__init__()
        self.gated = gated
        self.in_proj = nn.Linear(d_model, hidden * (2 if gated else 1), bias=False)
        self.out_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)
        if self.gated:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.silu(h)
        return self.out_proj(h)


class Block(nn.Module):
    """``x + gate1 * attn(mod(norm(x)))`` then ``x + gate2 * mlp(mod(norm(x)))``.

    The six modulation vectors (shift, scale, gate for each half) come from the conditioning
    vector (noise level + controller) through one linear layer per block.
    """

    def __init__(self, cfg: WorldModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.norm1 = RMSNorm(d, cfg.norm_eps, affine=False)
        self.norm2 = RMSNorm(d, cfg.norm_eps, affine=False)
        self.attn = Attention(d, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
        self.modulation = nn.Linear(cfg.cond_dim, 6 * d)
        if cfg.mlp == "moe":
            self.mlp: nn.Module = MoELayer(
                d,
                cfg.n_experts,
                cfg.top_k,
                cfg.moe_hidden,
                gated=cfg.gated,
                score_fn=cfg.score_fn,
                renormalize=cfg.renormalize,
                impl=cfg.moe_impl,
            )
        else:
            self.mlp = DenseMLP(d, cfg.dense_hidden, cfg.gated)

    def forward(
        self,
        x_ND: torch.Tensor,
        c_C: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVRingCache,
        layer: int,
        bias_S: torch.Tensor | None,
        *,
        commit: bool,
        kv_only: bool = False,
    ) -> torch.Tensor:
        mod_6D = self.modulation(c_C).view(6, -1).float()
        shift1, scale1, gate1, shift2, scale2, gate2 = mod_6D.unbind(0)
        h = (self.norm1(x_ND).float() * (1 + scale1) + shift1).to(x_ND.dtype)
        a = self.attn(h, *rope, cache, layer, bias_S, commit=commit, kv_only=kv_only)
        if a is None:
            return x_ND
        x_ND = (x_ND.float() + gate1 * a.float()).to(x_ND.dtype)
        h = (self.norm2(x_ND).float() * (1 + scale2) + shift2).to(x_ND.dtype)
        return (x_ND.float() + gate2 * self.mlp(h).float()).to(x_ND.dtype)
