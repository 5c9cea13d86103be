"""A static KV ring buffer over the last ``window`` frames, plus one scratch slot.

Buffers ``k``/``v`` have shape (layers, kv_heads, window + 1, tokens_per_frame, head_dim): slots
0..window-1 form the ring, slot ``window`` holds the keys/values of the frame being computed. The
frame counter is a device tensor, so the write slot (``frame % window``) and the mask of filled
slots are computed on the device: shapes never change, memory stays constant over an endless
rollout, and one captured CUDA graph serves every frame.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("moe_model::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slot: torch.Tensor,
    k_HND: torch.Tensor,
    v_HND: torch.Tensor,
) -> None:
    """In place: ``k_cache[layer, :, slot] = k_HND`` (and v), ``slot`` a (1,) int64 device tensor.

    A custom op that declares its mutation, so ``torch.compile`` writes the one slot in place.
    Written as plain slice assignments inside the compiled graph, functionalization copied the
    whole cache buffer for every write (measured on the H200: about 0.13 ms per write, a third of
    a frame's time)."""
    k_cache[layer].index_copy_(1, slot, k_HND.unsqueeze(1))
    v_cache[layer].index_copy_(1, slot, v_HND.unsqueeze(1))


@kv_write.register_fake
def _(k_cache, v_cache, layer, slot, k_HND, v_HND) -> None:
    return None


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

    def attn_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (S,) over S = (window + 1) * tokens keys: 0 for the filled ring slots and
        the scratch slot, -inf for ring slots not written yet. Slots fill in order 0, 1, ..., so
        slot s is filled once ``frame > s``."""
        slots = torch.arange(self.window + 1, device=self.frame.device)
        valid = (slots < self.frame) | (slots == self.window)
        bias = torch.where(valid, 0.0, float("-inf")).to(dtype)
        return bias.repeat_interleave(self.tokens)

    def write_scratch(self, layer: int, k_HND: torch.Tensor, v_HND: torch.Tensor) -> None:
        kv_write(self.k, self.v, layer, self.scratch_slot, k_HND, v_HND)

    def commit(self, layer: int, k_HND: torch.Tensor, v_HND: torch.Tensor) -> None:
        """Write a frame's keys/values into ring slot ``frame % window`` (computed on device)."""
        slot = torch.remainder(self.frame, self.window).view(1)
        kv_write(self.k, self.v, layer, slot, k_HND, v_HND)

    def advance(self) -> None:
        self.frame.add_(1)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every slot of one layer: (kv_heads, S, head_dim) views."""
        k = self.k[layer]
        return k.view(k.shape[0], -1, k.shape[-1]), self.v[layer].view(k.shape[0], -1, k.shape[-1])
