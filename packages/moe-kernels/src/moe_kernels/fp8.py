"""FP8 (e4m3) grouped GEMM for MoE inference on Hopper: ``fp8_grouped_mm`` over expert-sorted
(optionally gathered) rows with per-row activation scales and per-output-channel or 128 x 128
block weight scales, and ``quantize_fp8_weights``, the one-time weight quantisation.

The activations' row-wise quantisation is FBGEMM's (``gather_scale_quant_dense_tokens``,
``silu_mul_quant``, or ``reference.fp8_rowwise.quantize_rows``): q = e4m3(x * s) and the stored
scale 1 / s, which this GEMM multiplies back. One custom op (``moe_kernels::fp8_grouped_mm``):
the Triton kernel (``_triton/fp8_grouped_mm.py``) on CUDA and in the interpreter, the torch
reference on CPU; which one runs is the GEMM plan's ("fp8" problems). Inference only (no
autograd), deterministic (K accumulated in order in fp32, no split-K), no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels
from moe_kernels._gemm_plan import plan_fp8
from moe_kernels.reference import fp8_grouped_mm as _ref
from moe_kernels.reference.fp8_rowwise import FP8_DTYPE

__all__ = ["Fp8Weights", "fp8_grouped_mm", "quantize_fp8_weights"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_BLOCK = _ref.SCALE_BLOCK


class Fp8Weights(NamedTuple):
    """Expert weights in FP8: ``weight`` (E, N, D) float8_e4m3fn and ``scale`` fp32, (E, N) per
    output channel or (E, ceil(N/128), ceil(D/128)) per 128 x 128 block; ``weight * scale``
    (broadcast per channel or block) is the dequantised weight."""

    weight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(E, N, D) ``weight * scale`` in fp32 (broadcast per channel or block), cast once to
        ``dtype``."""
        _, N, D = self.weight.shape
        return (self.weight.float() * _ref.broadcast_scale(self.scale, N, D)).to(dtype)

    def checked(self, name: str, shape: tuple[int, int, int]) -> Fp8Weights:
        """These weights if they are expert weights of ``shape`` (E, N, D) as ``fp8_grouped_mm``
        takes them (float8_e4m3fn weight, float32 scale per channel or 128 x 128 block, one
        device) with finite, positive scales (read on the host: a load-time check, not for a
        hot path); else TypeError / ValueError naming ``name``."""
        weight = V.tensor(f"{name}.weight", self.weight)
        scale = V.tensor(f"{name}.scale", self.scale)
        V.dtype(f"{name}.weight", weight, (FP8_DTYPE,))
        V.dtype(f"{name}.scale", scale, (torch.float32,))
        if tuple(weight.shape) != tuple(shape):
            raise ValueError(f"{name}.weight must have shape {tuple(shape)}, got "
                             f"{tuple(weight.shape)}")  # fmt: skip
        _check_scale(f"{name}.scale", scale, *shape)
        V.same_device(f"{name}.weight", weight, **{f"{name}.scale": scale})
        if not bool(((scale > 0) & torch.isfinite(scale)).all()):
            raise ValueError(f"{name}.scale must be finite and positive")
        return self


def _check_scale(name: str, scale: torch.Tensor, E: int, N: int, D: int) -> None:
    """ValueError unless ``scale`` is (E, N) per channel or (E, ceil(N/128), ceil(D/128))."""
    blocks = (E, -(-N // SCALE_BLOCK), -(-D // SCALE_BLOCK))
    if tuple(scale.shape) not in ((E, N), blocks):
        raise ValueError(
            f"{name} must be (E, N) = {(E, N)} per channel or (E, ceil(N/128), ceil(D/128)) = "
            f"{blocks} per block, got {tuple(scale.shape)}"
        )


def quantize_fp8_weights(w_END: torch.Tensor, *, block: bool = False) -> Fp8Weights:
    """Quantise expert weights w_END (E, N, D) (float32/bf16/fp16, ``nn.Linear``'s out x in per
    expert) once: per output channel ``scale = amax over D / 448`` (1 for an all-zero row), or
    with ``block`` per 128 x 128 block (DeepSeek-V3's checkpoint format); ``weight = e4m3(w /
    scale)`` rounded to nearest even. Plain torch on w's device."""
    w_END = V.tensor("w_END", w_END)
    V.dtype("w_END", w_END, V.FLOAT_DTYPES)
    V.rank("w_END", w_END, 3)
    if not isinstance(block, bool):
        raise TypeError(f"block must be a bool, got {type(block).__name__}")
    return Fp8Weights(*_ref.quantize_fp8_weights(w_END, block))


def _impl(
    x_TD: torch.Tensor,
    x_scale_T: torch.Tensor,
    w_END: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    kernel = plan_fp8(x_TD, w_END, row_indices).kernel
    if kernel == "reference":
        return _ref.fp8_grouped_mm(x_TD, x_scale_T, w_END, w_scale, offsets, row_indices,
                                   out_dtype)  # fmt: skip
    x_TD = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
    w_END = w_END if w_END.stride(2) == 1 else w_END.contiguous()
    decode = kernel == "triton_fp8_decoded"  # (no e4m3 tensor cores: bytes decoded to bf16)
    launch = triton_kernels("fp8_grouped_mm").fp8_grouped_mm
    x_scale_T = x_scale_T.contiguous()  # (the kernels index it with unit stride)
    args = (x_TD, x_scale_T, w_END, w_scale, offsets, row_indices, out_dtype)
    return launch(*args, decode=decode)


def _fake(x_TD, x_scale_T, w_END, w_scale, offsets, row_indices, out_dtype):
    rows = x_TD.shape[0] if row_indices is None else row_indices.shape[0]
    return x_TD.new_empty((rows, w_END.shape[1]), dtype=out_dtype)


fp8_grouped_mm_op = register_op("fp8_grouped_mm", _impl, _fake)


def fp8_grouped_mm(
    x_TD: torch.Tensor,
    x_scale: torch.Tensor,
    w_END: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped ``(x[rows] @ w[e].T) * x_scale[rows] * w_scale[e]`` over expert-sorted rows.

    x_TD: (T, D) float8_e4m3fn; x_scale: (T,) float32, each row's dequantisation scale. w_END:
    (E, N, D) float8_e4m3fn; w_scale: (E, N) float32 per output channel, or (E, ceil(N/128),
    ceil(D/128)) per 128 x 128 block (``quantize_fp8_weights``). offsets: (E+1,) int32/int64,
    the groups' bounds (``RoutingPlan.offsets``; clamped on the device as
    ``gather_grouped_mm``'s, not checked: that would sync); row_indices: (P,) int32/int64 source
    rows (``RoutingPlan.token_indices``, -1 in the tail) or None (x already sorted, P = T).

    Returns y_PN (P, N) in ``out_dtype`` (bfloat16, float16 or float32): the sum of the fp8
    products, each 128-deep K block summed by the tensor cores (on sm_90 with their reduced
    accumulator precision; exactly in fp32 on the reference path and in the interpreter) and
    added in fp32 (with block scales, times its block's scale), times the row's and (per
    channel) the column's scale, cast once (before sm_89, without e4m3 tensor cores, the e4m3
    values are decoded to bf16 in the kernel, exactly, and their exact products summed in fp32
    by the bf16 tensor cores); rows past offsets[E] and rows whose index
    is outside [0, T) are zero. Not differentiable (inference).
    """
    x_TD = V.tensor("x_TD", x_TD)
    V.dtype("x_TD", x_TD, (FP8_DTYPE,))
    V.rank("x_TD", x_TD, 2)
    x_scale = V.tensor("x_scale", x_scale)
    V.dtype("x_scale", x_scale, (torch.float32,))
    V.rank("x_scale", x_scale, 1)
    V.dim_size("x_scale", x_scale, 0, x_TD.shape[0], "T, x_TD's rows")
    w_END = V.tensor("w_END", w_END)
    V.dtype("w_END", w_END, (FP8_DTYPE,))
    V.rank("w_END", w_END, 3)
    V.dim_size("w_END", w_END, 2, x_TD.shape[1], "D, the columns of x_TD")
    E, N, D = w_END.shape
    w_scale = V.tensor("w_scale", w_scale)
    V.dtype("w_scale", w_scale, (torch.float32,))
    _check_scale("w_scale", w_scale, E, N, D)
    offsets = V.tensor("offsets", offsets)
    V.dtype("offsets", offsets, V.INDEX_DTYPES)
    V.rank("offsets", offsets, 1)
    V.dim_size("offsets", offsets, 0, E + 1, "E+1, one more than w_END's experts")
    if row_indices is not None:
        row_indices = V.tensor("row_indices", row_indices)
        V.dtype("row_indices", row_indices, V.INDEX_DTYPES)
        V.rank("row_indices", row_indices, 1)
    V.same_device("x_TD", x_TD, x_scale=x_scale, w_END=w_END, w_scale=w_scale, offsets=offsets,
                  row_indices=row_indices)  # fmt: skip
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    return fp8_grouped_mm_op.call(x_TD, x_scale, w_END, w_scale, offsets, row_indices, out_dtype)
