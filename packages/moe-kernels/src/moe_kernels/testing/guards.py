"""Helpers for testing the kernels (and code built on them) against hostile inputs.

``guarded(t)`` places a copy of ``t`` in the middle of a larger buffer whose head and tail hold
a known byte pattern: a kernel that stores outside ``t``'s extent changes those bytes, which
``Guarded.intact()`` reports, instead of corrupting unrelated memory silently (Triton's
interpreter checks no bounds, and neither does the GPU). Loads outside the extent read the
pattern, whose bytes (0xA5) are large finite values in every float dtype, so a stray read shows
up in the results too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GUARD_BYTE", "Guarded", "guarded"]

GUARD_BYTE = 0xA5  # bf16 0xA5A5 = -2.9e-16, fp32 -2.9e-16, fp16 -0.0226, int32 -1515870811


class Guarded(NamedTuple):
    """``tensor``: a contiguous copy of the guarded tensor, a view into ``buffer`` (1-D, the
    same dtype) with ``pad`` elements of ``GUARD_BYTE`` before and after it."""

    tensor: torch.Tensor
    buffer: torch.Tensor
    pad: int

    def intact(self) -> bool:
        """Whether the head and tail of ``buffer`` still hold ``GUARD_BYTE`` in every byte."""
        n = self.tensor.numel()
        head = self.buffer[: self.pad].view(torch.uint8)
        tail = self.buffer[self.pad + n :].view(torch.uint8)
        return bool((head == GUARD_BYTE).all()) and bool((tail == GUARD_BYTE).all())


def guarded(t: torch.Tensor, pad: int = 1024) -> Guarded:
    """A contiguous copy of ``t`` with ``pad`` guard elements on each side (see the module)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
        raise ValueError(f"pad must be an int >= 1, got {pad!r}")
    n = t.numel()
    buffer = torch.empty(n + 2 * pad, dtype=t.dtype, device=t.device)
    buffer.view(torch.uint8).fill_(GUARD_BYTE)
    view = buffer[pad : pad + n].view(t.shape)
    view.copy_(t)
    return Guarded(view, buffer, pad)
