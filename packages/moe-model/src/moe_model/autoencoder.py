"""A small convolutional video-autoencoder decoder: latent (C, h, w) -> uint8 RGB (8h, 8w, 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LatentDecoder(nn.Module):
    """conv3x3 -> 3 x (nearest 2x upsample, conv3x3, SiLU) -> conv3x3 to RGB -> tanh -> uint8.

    Channels halve at each upsampling stage after the first: ch, ch, ch/2, ch/4.
    """

    def __init__(self, latent_channels: int, channels: int = 256) -> None:
        super().__init__()
        chs = [channels, channels, max(channels // 2, 1), max(channels // 4, 1)]
        self.conv_in = nn.Conv2d(latent_channels, chs[0], 3, padding=1)
        self.ups = nn.ModuleList(nn.Conv2d(chs[i], chs[i + 1], 3, padding=1) for i in range(3))
        self.conv_out = nn.Conv2d(chs[-1], 3, 3, padding=1)

    def forward(self, z_Chw: torch.Tensor) -> torch.Tensor:
        """z (C, h, w) latent -> (8h, 8w, 3) uint8 image on z's device."""
        dtype = self.conv_in.weight.dtype
        x = F.silu(self.conv_in(z_Chw.to(dtype)[None]))
        for conv in self.ups:
            x = F.silu(conv(F.interpolate(x, scale_factor=2, mode="nearest")))
        rgb = torch.tanh(self.conv_out(x)[0].float())
        return ((rgb + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
