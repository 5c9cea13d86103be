"""A static KV ring buffer over the last ``window`` frames, plus one scratch slot.

Buffers ``k``/``v`` have shape (layers, kv_heads, window + 1, tokens_per_frame, head_dim): slots
0..window-1 form the ring, slot ``window`` holds the keys/values of the frame being computed. The
frame counter is a device tensor, so the write slot (``frame % window``) and the mask of filled
slots are computed on the device: shapes never change, memory stays constant over an endless
rollout, and one captured CUDA graph serves every frame.

The slots are written by ``moe_kernels.qk_norm_rope`` (``Attention``), which takes the slot as a
device tensor (``scratch_slot``, ``ring_slot()``) and declares its mutation, so ``torch.compile``
writes the slots in place (slice assignments in a compiled graph made functionalization copy the
whole buffer for every write: about 0.13 ms per write on the H200).
"""

from __future__ import annotations

import torch
from torch import nn


class KVRingCache(nn.Module):
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        window: int,
        tokens: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.window, self.tokens = window, tokens
        shape = (n_layers, n_kv_heads, window + 1, tokens, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        # Frames committed so far (absolute index of the next frame), int64 on the device.
        self.register_buffer(
            "frame", torch.zeros((), device=device, dtype=torch.int64), persistent=False
        )
        self.register_buffer(
            "scratch_slot",
            torch.full((1,), window, device=device, dtype=torch.int64),
            persistent=False,
        )

    def reset(self) -> None:
        """Empty the cache in place (buffer addresses unchanged: captured graphs stay valid)."""
        self.k.zero_()
        self.v.zero_()
        self.frame.zero_()

    def attn_bias(self, dtype: torch.dtype, ahead: int = 0) -> torch.Tensor:
        """Additive mask (S,) over S = (window + 1) * tokens keys: 0 for the filled ring slots and
        the scratch slot, -inf for ring slots not written yet. Slots fill in order 0, 1, ..., so
        slot s is filled once ``frame > s``; ``ahead`` frames more count as committed (a pass
        that follows a commit in the same forward)."""
        slots = torch.arange(self.window + 1, device=self.frame.device)
        valid = (slots < self.frame + ahead) | (slots == self.window)
        bias = torch.where(valid, 0.0, float("-inf")).to(dtype)
        return bias.repeat_interleave(self.tokens)

    def ring_slot(self) -> torch.Tensor:
        """(1,) int64 device tensor: the ring slot ``frame % window`` a frame commits to
        (computed on the device, no host read)."""
        return torch.remainder(self.frame, self.window).view(1)

    def advance(self) -> None:
        self.frame.add_(1)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every slot of one layer: (kv_heads, S, head_dim) views."""
        k = self.k[layer]
        return k.view(k.shape[0], -1, k.shape[-1]), self.v[layer].view(k.shape[0], -1, k.shape[-1])
