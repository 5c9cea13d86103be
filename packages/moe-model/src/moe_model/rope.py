"""Rotary position embeddings over (time, y, x): the head dim is split in three groups of pairs.

Time positions are absolute frame indices held in a device tensor (no recompiles, one CUDA graph
for every frame); keys are rotated with their frame index when written to the KV cache, queries with
the current frame index, so attention sees relative time offsets.
"""

from __future__ import annotations

import torch
from torch import nn


def axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs given to (time, y, x): a quarter to time, the rest split between y and x."""
    pairs = head_dim // 2
    t_pairs = max(1, pairs // 4)
    y_pairs = (pairs - t_pairs) // 2
    return t_pairs, y_pairs, pairs - t_pairs - y_pairs


class Rope3D(nn.Module):
    """cos/sin tables for a frame of ``grid_h x grid_w`` tokens (row-major) at a frame index."""

    def __init__(self, head_dim: int, grid_h: int, grid_w: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.grid_h, self.grid_w, self.theta = head_dim, grid_h, grid_w, theta
        self.register_buffer("inv_freq_t", torch.empty(axis_pairs(head_dim)[0]), persistent=False)
        self.register_buffer(
            "angles_yx",
            torch.empty(grid_h * grid_w, sum(axis_pairs(head_dim)[1:])),
            persistent=False,
        )
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the fp32 tables in place (after ``to_empty`` or a dtype cast)."""
        t_pairs, y_pairs, x_pairs = axis_pairs(self.head_dim)
        dev = self.inv_freq_t.device
        if dev.type == "meta":
            return

        def inv_freq(n: int) -> torch.Tensor:
            return self.theta ** (-torch.arange(n, dtype=torch.float64, device=dev) / n)

        y_N = torch.arange(self.grid_h, device=dev).repeat_interleave(self.grid_w).double()
        x_N = torch.arange(self.grid_w, device=dev).repeat(self.grid_h).double()
        ang_NP = torch.cat([y_N[:, None] * inv_freq(y_pairs), x_N[:, None] * inv_freq(x_pairs)], 1)
        self.inv_freq_t = inv_freq(t_pairs).float()
        self.angles_yx = ang_NP.float()

    def forward(self, frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``frame``: 0-d integer tensor. Returns ``(cos_NP, sin_NP)`` fp32, P = head_dim // 2."""
        ang_t_P = frame.float() * self.inv_freq_t
        n = self.angles_yx.shape[0]
        ang_NP = torch.cat([ang_t_P.expand(n, -1), self.angles_yx], dim=1)
        return torch.cos(ang_NP), torch.sin(ang_NP)


def apply_rope(x_NHD: torch.Tensor, cos_NP: torch.Tensor, sin_NP: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of each head by the token's angles; fp32 math.

    ``Attention`` runs this formula fused with the QK-norm and the KV write
    (``moe_kernels.qk_norm_rope``); kept as the torch formula the tests compare against."""
    N, H, D = x_NHD.shape
    x_NHP2 = x_NHD.float().view(N, H, D // 2, 2)
    x0, x1 = x_NHP2[..., 0], x_NHP2[..., 1]
    c, s = cos_NP[:, None, :], sin_NP[:, None, :]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return out.view(N, H, D).to(x_NHD.dtype)
