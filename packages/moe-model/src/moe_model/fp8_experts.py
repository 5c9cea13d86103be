"""A ``MoELayer``'s experts quantised to FP8 (e4m3), for the ``"fp8"`` impl.

``QuantisedExperts`` holds ``in_proj`` and ``out_proj`` as two ``moe_kernels.Fp8Weights`` (per
output channel or per 128 x 128 block scales). Rules:

* They are derived state: quantised from the layer's weights (``MoELayer.quantize_experts``), or
  loaded from a checkpoint's FP8 weights (``MoELayer.load_fp8_experts``, which also sets the
  layer's weights to their dequantised values). Not in the state dict.
* Stored as integer bit views (uint8 data, int32 scales), so ``Module.to(dtype)`` leaves them
  as they are (float8 counts as floating point there and would be cast).
* They remember which weights they came from (storage and version counter): a forward after
  the weights changed in place or were replaced raises instead of using stale experts.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import Fp8Weights, quantize_fp8_weights
from moe_model.impls import IMPLS

FP8 = torch.float8_e4m3fn


def _stamp(w: torch.Tensor) -> tuple[int, int]:
    return w.data_ptr(), w._version


def check_fp8_weights(name: str, w: object, shape: tuple[int, int, int]) -> Fp8Weights:
    """``w`` as ``Fp8Weights`` of expert weights ``shape`` (E, N, D) (``Fp8Weights.checked``:
    dtypes, shapes, one device, finite and positive scales); TypeError / ValueError naming
    ``name``."""
    if not isinstance(w, tuple) or len(w) != 2:
        raise TypeError(f"{name} must be a moe_kernels.Fp8Weights (weight, scale), got {w!r}")
    return Fp8Weights(*w).checked(name, shape)


class QuantisedExperts(nn.Module):
    """The FP8 experts of one layer: ``get()`` -> (in_proj, out_proj) as ``Fp8Weights``."""

    def __init__(self, in_proj: Fp8Weights, out_proj: Fp8Weights, block: bool) -> None:
        super().__init__()
        self.block = block
        for name, w in (("in", in_proj), ("out", out_proj)):
            self.register_buffer(f"{name}_data", w.weight.view(torch.uint8), persistent=False)
            self.register_buffer(f"{name}_scale", w.scale.view(torch.int32), persistent=False)
        self.sources: tuple = ()

    @classmethod
    @torch.no_grad()
    def quantise(cls, in_proj: torch.Tensor, out_proj: torch.Tensor, block: bool):
        """FP8 copies of the expert weights as they are now (``quantize_fp8_weights``)."""
        if not isinstance(block, bool):
            raise TypeError(f"block must be a bool or None, got {type(block).__name__}")
        q_in = quantize_fp8_weights(in_proj, block=block)
        q_out = quantize_fp8_weights(out_proj, block=block)
        experts = cls(q_in, q_out, block)
        experts.remember(in_proj, out_proj)
        return experts

    @classmethod
    @torch.no_grad()
    def load(cls, in_proj: torch.Tensor, out_proj: torch.Tensor, q_in: object, q_out: object):
        """A checkpoint's FP8 experts (checked: ``check_fp8_weights``); the weights ``in_proj``
        / ``out_proj`` are set to their dequantised values."""
        q_in = check_fp8_weights("in_proj", q_in, tuple(in_proj.shape))
        q_out = check_fp8_weights("out_proj", q_out, tuple(out_proj.shape))
        for name, q in (("in_proj", q_in), ("out_proj", q_out)):
            if q.weight.device != in_proj.device:
                raise ValueError(f"{name} is on {q.weight.device}, the layer on {in_proj.device}")
        in_proj.copy_(q_in.dequantize(in_proj.dtype))
        out_proj.copy_(q_out.dequantize(out_proj.dtype))
        experts = cls(q_in, q_out, q_in.scale.dim() == 3)
        experts.remember(in_proj, out_proj)
        return experts

    def get(self) -> tuple[Fp8Weights, Fp8Weights]:
        return (
            Fp8Weights(self.in_data.view(FP8), self.in_scale.view(torch.float32)),
            Fp8Weights(self.out_data.view(FP8), self.out_scale.view(torch.float32)),
        )

    def remember(self, in_proj: torch.Tensor, out_proj: torch.Tensor) -> None:
        """Record the weights these experts stand for (their storage and version)."""
        self.sources = (_stamp(in_proj), _stamp(out_proj))

    def current(self, in_proj: torch.Tensor, out_proj: torch.Tensor) -> bool:
        """Whether the weights are those of ``remember`` (host-side facts, no sync)."""
        return self.sources == (_stamp(in_proj), _stamp(out_proj))

    def check_current(self, in_proj: torch.Tensor, out_proj: torch.Tensor) -> None:
        """RuntimeError unless ``current``."""
        if not self.current(in_proj, out_proj):
            raise RuntimeError(
                "the layer's in_proj / out_proj changed since their FP8 copies were made: call "
                "quantize_experts() (or load_fp8_experts()) again before the fp8 impl runs"
            )

    def extra_repr(self) -> str:
        return f"scales={'128x128 blocks' if self.block else 'per channel'}"


def requantise_after_load(layer: nn.Module, incompatible_keys: object) -> None:
    """``MoELayer``'s ``load_state_dict`` post-hook: the FP8 experts (held, or the impl's) are
    made again from the loaded weights (the state dict holds no FP8 copies)."""
    held = layer.fp8 is not None or IMPLS[layer.impl].fp8_experts
    if held and layer.experts_owner is None:
        layer.quantize_experts()
