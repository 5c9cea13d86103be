"""SwiGLU's gate-times-up step, plain and fused with a row-wise FP8 quantisation:
``silu_mul(x0, x1)`` and ``silu_mul_quant(x0, x1, scale_ub)``, with the names, argument order and
results of ``fbgemm_gpu.experimental.gen_ai.moe``.

Both are ``torch.library`` custom ops (``moe_kernels::silu_mul``, ``moe_kernels::silu_mul_quant``)
with fake implementations: Triton kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``), the
torch reference on CPU; no host syncs (``scale_ub`` and ``valid_token_count`` are read on the
device), safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, deterministic.

Differences from FBGEMM, all deliberate:

* any strides (FBGEMM asserts a unit column stride), any T (0 included) and any D (FBGEMM needs
  D % 1024 == 0, or % 512 for T < #SMs), int64 offsets;
* rows >= ``valid_token_count`` are zero (q and scale too) where FBGEMM leaves them unwritten
  (its ``silu_mul_quant`` even writes some of them: it checks the count per block of rows);
* none in the quantisation's arithmetic: on the GPU it divides like FBGEMM (``div.full.f32``, up
  to 2 ulp from the IEEE quotient), so its scales and data are FBGEMM's bit for bit; the CPU
  reference (and the interpreter) divides with IEEE division, see ``reference/fp8_rowwise.py``;
* NaN products quantise to the NaN byte 0x7F (FBGEMM's clamp turns them into +-448) and NaN
  elements are left out of the row maximum (as the GPU's max does in FBGEMM).

Not differentiable: the ops register no autograd formula, so a backward through them raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import swiglu as _ref
from moe_kernels.reference.fp8_rowwise import FP8_DTYPE

__all__ = ["Fp8Rows", "silu_mul", "silu_mul_quant"]


class Fp8Rows(NamedTuple):
    """Row-wise FP8 data and its per-row dequantisation scales (``data[i] * scale[i]``); a tuple,
    like FBGEMM's results."""

    data: torch.Tensor  # (rows, D) float8_e4m3fn
    scale: torch.Tensor  # (rows,) float32


def _triton():
    return triton_kernels("swiglu")  # imported on first use: triton only when a kernel runs


def _check_pair(x0: object, x1: object) -> tuple[torch.Tensor, torch.Tensor]:
    x0, x1 = V.float_2d("x0", x0), V.float_2d("x1", x1)
    if x1.dtype != x0.dtype:
        raise TypeError(f"x1 must have x0's dtype {x0.dtype}, got {x1.dtype}")
    if x1.shape != x0.shape:
        raise ValueError(f"x1 must have x0's shape {tuple(x0.shape)}, got {tuple(x1.shape)}")
    V.same_device("x0", x0, x1=x1)
    return x0, x1


# --------------------------------------------------------------------------------------------
# silu_mul


def _silu_mul_impl(
    x0: torch.Tensor, x1: torch.Tensor, valid_token_count: torch.Tensor | None
) -> torch.Tensor:
    if not use_triton(x0.device):
        return _ref.silu_mul(x0, x1, valid_token_count)
    return _triton().silu_mul(x0, x1, valid_token_count)


def _silu_mul_fake(x0, x1, valid_token_count):
    return x0.new_empty(x0.shape)


silu_mul_op = register_op("silu_mul", _silu_mul_impl, _silu_mul_fake)


def silu_mul(
    x0: torch.Tensor, x1: torch.Tensor, valid_token_count: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x0 * sigmoid(x0) * x1``, FBGEMM's fused SiLU-and-multiply.

    x0, x1: (T, D) float32/bf16/fp16, same shape and dtype, any strides (e.g. the two column
    halves of a (T, 2D) tensor); valid_token_count: optional one-element int32/int64 tensor on
    the same device. Returns a new contiguous (T, D) tensor in x0's dtype: ``(x0 * s) * x1`` with
    ``s = 1 / (1 + exp(-x0))``, all in fp32 and rounded once; rows t >= valid_token_count are 0.

    Specials follow IEEE fp32: x0 = +inf gives inf * x1, x0 = -inf or NaN gives NaN, x0 below
    about -88 gives a signed zero (exp overflows, s = 0).

    Numerics: on the GPU the kernel runs FBGEMM's expression as Triton compiles it
    (``tl.sigmoid``: an ``ex2.approx`` of ``-x0 * log2(e)``, then a ``div.full``), so its bits
    equal FBGEMM's. The CPU reference uses torch's exp and IEEE division: the two differ by a few
    fp32 ulps (more for large negative x0, where the rounding of exp's argument grows with
    |x0|), which moves a bf16/fp16 result by at most one ulp. Not differentiable.
    """
    x0, x1 = _check_pair(x0, x1)
    V.valid_token_count(valid_token_count, "x0", x0)
    return silu_mul_op.call(x0, x1, valid_token_count)


# --------------------------------------------------------------------------------------------
# silu_mul_quant


def _silu_mul_quant_impl(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: torch.Tensor | None,
    valid_token_count: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x0.device):
        return _ref.silu_mul_quant(x0, x1, scale_ub, valid_token_count)
    return _triton().silu_mul_quant(x0, x1, scale_ub, valid_token_count)


def _silu_mul_quant_fake(x0, x1, scale_ub, valid_token_count):
    return x0.new_empty(x0.shape, dtype=FP8_DTYPE), x0.new_empty(x0.shape[:1], dtype=torch.float32)


silu_mul_quant_op = register_op("silu_mul_quant", _silu_mul_quant_impl, _silu_mul_quant_fake)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> Fp8Rows:
    """``silu_mul`` fused with FBGEMM's row-wise FP8 quantisation: ``(q, scale)``.

    x0, x1, valid_token_count: as in ``silu_mul``; scale_ub: optional one-element float32 tensor
    on the same device (an upper bound on the row maximum). Returns ``Fp8Rows(data, scale)``, a
    tuple: data (T, D) float8_e4m3fn, scale (T,) float32, with ``data[t] * scale[t] ~= v[t]``
    where v is the fp32 ``silu_mul`` value (not rounded to x0's dtype). Per row:
    ``m = max(max_j |v_j|, 1e-12)``, bounded by scale_ub; ``s = 448 / m``, ``scale = 1 / s``
    (FBGEMM's division on the GPU); ``data = e4m3fn(clamp(v * s, -448, 448))``, rounded to
    nearest even.
    Rows t >= valid_token_count: data 0 and scale 0.

    Specials: NaN elements are left out of the row maximum and quantise to NaN (0x7F); an infinite
    element without scale_ub makes m = inf, s = 0 and scale = inf (its finite neighbours give
    +-0, itself NaN); with scale_ub it saturates to +-448. scale_ub is meant to be positive (not
    checked: no sync): a NaN bound bounds nothing, and a bound below 1e-12 (zero, negative, -inf)
    acts as 1e-12, so scales stay positive (never sign-flipped data).

    Numerics: on the GPU v is ``silu_mul``'s (FBGEMM's bits) and the divisions FBGEMM's
    ``div.full.f32``: the results equal FBGEMM's bit for bit (but for a scale_ub below 1e-12,
    which FBGEMM takes as it is). The CPU reference divides with IEEE
    division: scales within 2 ulp of the GPU's, data within one e4m3 step where a scale differs.
    """
    x0, x1 = _check_pair(x0, x1)
    V.scale_ub(scale_ub, "x0", x0)
    V.valid_token_count(valid_token_count, "x0", x0)
    return Fp8Rows(*silu_mul_quant_op.call(x0, x1, scale_ub, valid_token_count))
