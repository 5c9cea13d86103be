"""Transformer blocks of the world model: adaptive-RMSNorm modulation, attention, MoE/dense MLP."""

from __future__ import annotations

from collections.abc import Sequence

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
        c_PC: torch.Tensor,
        ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cache: KVRingCache,
        layer: int,
        biases: Sequence[torch.Tensor | None],
        *,
        commit: bool,
        kv_only: bool = False,
    ) -> torch.Tensor:
        """``x_ND``: P = ``c_PC.shape[0]`` passes of N tokens, each with its conditioning row of
        ``c_PC`` (``Attention.forward`` says how the passes attend). Returns the passes' new rows;
        with ``kv_only`` pass 0 only commits, and the rows of the other passes come back
        (``x_ND`` itself for P = 1)."""
        P, D = c_PC.shape[0], x_ND.shape[1]
        mod = self.modulation(c_PC).view(P, 6, 1, D).float()
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)  # (P, 1, D) each
        x_PND = x_ND.view(P, -1, D)
        h = (self.norm1(x_PND).float() * (1 + scale1) + shift1).to(x_ND.dtype)
        a = self.attn(h.view(-1, D), ropes, cache, layer, biases, commit=commit, kv_only=kv_only)
        if a is None:
            return x_ND
        if kv_only:  # pass 0 is done: the other passes go on
            x_PND, mod = x_PND[1:], mod[1:]
            shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)
        x_PND = (x_PND.float() + gate1 * a.view(x_PND.shape).float()).to(x_ND.dtype)
        h = (self.norm2(x_PND).float() * (1 + scale2) + shift2).to(x_ND.dtype)
        y = self.mlp(h.view(-1, D)).view(x_PND.shape)
        return (x_PND.float() + gate2 * y.float()).to(x_ND.dtype).view(-1, D)
