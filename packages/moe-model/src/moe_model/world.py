"""The frame-autoregressive world model: a diffusion transformer over one frame's latent patches,
conditioned on the noise level and the controller, reading (and, in its cache pass, writing) a KV
ring buffer. Its runtime (noise, denoise loop, compile, CUDA graphs, rollout) is ``engine.py``.

Shapes: C latent channels, h x w latent grid, N tokens per frame, P patch dim, D model width,
S = (window + 1) * N attention keys (the ring and the scratch slot).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_model.autoencoder import LatentDecoder
from moe_model.blocks import Block
from moe_model.config import WorldModelConfig
from moe_model.kv_cache import KVRingCache
from moe_model.moe import MoELayer
from moe_model.rope import Rope3D


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding (dim,) fp32 of a 0-d noise level in [0, 1] (scaled by 1000)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
    )
    ang = sigma.float() * 1000.0 * freqs
    return torch.cat([torch.cos(ang), torch.sin(ang)])


class WorldModel(nn.Module):
    """The transformer: patch embedding, conditioning, blocks, final layer, decoder."""

    def __init__(self, cfg: WorldModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, c = cfg.d_model, cfg.cond_dim
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.t_embed = nn.Sequential(nn.Linear(cfg.freq_dim, c), nn.SiLU(), nn.Linear(c, c))
        self.button_embed = nn.Linear(cfg.n_buttons, c, bias=False)
        self.mouse_embed = nn.Linear(2, c)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_mod = nn.Linear(c, 2 * d)
        self.final_proj = nn.Linear(d, cfg.patch_dim)
        self.rope = Rope3D(cfg.head_dim, cfg.grid_h, cfg.grid_w, cfg.rope_theta)
        self.decoder = LatentDecoder(cfg.latent_channels, cfg.decoder_channels)

    def init_weights(self) -> None:
        """Random weights (draws from the global RNG: seed it first)."""
        for name, m in self.named_modules():
            if isinstance(m, MoELayer):
                m.reset_parameters()
            elif isinstance(m, nn.Linear):
                std = 0.02 if ("modulation" in name or "final_mod" in name) else None
                nn.init.normal_(m.weight, std=std or 1.0 / math.sqrt(m.in_features))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                nn.init.normal_(m.weight, std=1.0 / math.sqrt(fan_in))
                nn.init.zeros_(m.bias)
        self.rope.init_buffers()

    def patchify(self, z_Chw: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.cfg.patch_size
        z = z_Chw.view(cfg.latent_channels, cfg.grid_h, p, cfg.grid_w, p)
        return z.permute(1, 3, 0, 2, 4).reshape(cfg.tokens_per_frame, cfg.patch_dim)

    def unpatchify(self, x_NP: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.cfg.patch_size
        z = x_NP.view(cfg.grid_h, cfg.grid_w, cfg.latent_channels, p, p)
        return z.permute(2, 0, 3, 1, 4).reshape(cfg.latent_channels, cfg.latent_h, cfg.latent_w)

    def cond(self, sigma: torch.Tensor, buttons: torch.Tensor, mouse: torch.Tensor) -> torch.Tensor:
        """Conditioning vector (cond_dim,): noise level + pressed buttons + mouse delta, SiLU."""
        dtype = self.patch_embed.weight.dtype
        c = self.t_embed(timestep_embedding(sigma, self.cfg.freq_dim).to(dtype))
        c = c + self.button_embed(buttons.to(dtype)) + self.mouse_embed(mouse.to(dtype))
        return torch.nn.functional.silu(c)

    def forward(
        self,
        z_Chw: torch.Tensor,
        sigma: torch.Tensor,
        buttons: torch.Tensor,
        mouse: torch.Tensor,
        cache: KVRingCache,
        *,
        commit: bool,
        masked: bool = True,
    ) -> torch.Tensor | None:
        """Velocity (C, h, w) fp32 of latent ``z`` at noise level ``sigma`` (denoise pass), or,
        with ``commit``, write the frame's keys/values into the ring and return None.
        ``masked=False`` skips the mask of unfilled ring slots: only valid once the ring is full
        (``cache.frame >= window``)."""
        c_PC = self.cond(sigma, buttons, mouse)[None]
        return self._passes([z_Chw], c_PC, cache, commit=commit, masked=masked)

    def commit_and_denoise(
        self,
        clean_Chw: torch.Tensor,
        clean_buttons: torch.Tensor,
        clean_mouse: torch.Tensor,
        z_Chw: torch.Tensor,
        sigma: torch.Tensor,
        buttons: torch.Tensor,
        mouse: torch.Tensor,
        cache: KVRingCache,
        *,
        masked: bool = True,
    ) -> torch.Tensor:
        """The cache pass of a clean latent (sigma 0, its own controller state) and the denoise
        pass of the next frame as one forward of 2N tokens: every weight is read once for both,
        and the GEMMs see twice the rows. The same as ``forward(clean, 0, clean_buttons,
        clean_mouse, cache, commit=True)``, ``cache.advance()``, ``forward(z, sigma, buttons,
        mouse, cache, commit=False)``, except that the frame counter is left for the caller to
        advance (the denoise pass runs at frame ``cache.frame + 1``). Returns the velocity of
        ``z``. ``masked=False`` is valid once the ring is full before the commit."""
        zero = torch.zeros_like(sigma)
        c_PC = torch.stack(
            [self.cond(zero, clean_buttons, clean_mouse), self.cond(sigma, buttons, mouse)]
        )
        return self._passes([clean_Chw, z_Chw], c_PC, cache, commit=True, masked=masked)

    def _passes(
        self,
        zs: list[torch.Tensor],
        c_PC: torch.Tensor,
        cache: KVRingCache,
        *,
        commit: bool,
        masked: bool,
    ) -> torch.Tensor | None:
        """P = ``len(zs)`` passes, pass p at frame ``cache.frame + p`` (``Block.forward``): the
        last pass's velocity, or None for one committing pass."""
        dtype = self.patch_embed.weight.dtype
        x_ND = self.patch_embed(torch.cat([self.patchify(z) for z in zs]).to(dtype))
        ropes = [self.rope(cache.frame + p) for p in range(len(zs))]
        biases = [cache.attn_bias(dtype, ahead=p) if masked else None for p in range(len(zs))]
        last = len(self.blocks) - 1
        for l, block in enumerate(self.blocks):
            x_ND = block(
                x_ND, c_PC, ropes, cache, l, biases, commit=commit, kv_only=commit and l == last
            )
        if commit and len(zs) == 1:
            return None
        shift, scale = self.final_mod(c_PC[-1]).view(2, -1).float().unbind(0)
        h = self.blocks[0].norm1(x_ND).float() * (1 + scale) + shift
        return self.unpatchify(self.final_proj(h.to(dtype)).float())


def check_config(config: object, name: str = "config") -> None:
    """TypeError unless a WorldModelConfig; validated again (its fields may have changed)."""
    if not isinstance(config, WorldModelConfig):
        raise TypeError(f"{name} must be a WorldModelConfig, got {type(config).__name__}")
    config.validate()


def count_parameters(cfg: WorldModelConfig) -> tuple[int, int]:
    """(total, active) parameter counts of a config, built on the meta device (no memory)."""
    check_config(cfg, "cfg")
    with torch.device("meta"):
        model = WorldModel(cfg)
    return model_parameter_counts(model, cfg)


def model_parameter_counts(model: WorldModel, cfg: WorldModelConfig) -> tuple[int, int]:
    """(total, active) parameter counts of a built model: the routed experts a token skips
    (``n_experts - top_k`` of each MoE block's) are inactive."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    if cfg.mlp == "moe":
        for block in model.blocks:
            per_expert = block.mlp.in_proj[0].numel() + block.mlp.out_proj[0].numel()
            inactive += (cfg.n_experts - cfg.top_k) * per_expert
    return total, total - inactive
