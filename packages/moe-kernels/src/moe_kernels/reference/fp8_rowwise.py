"""Pure-torch reference of the row-wise FP8 (e4m3fn) quantisation shared by ``silu_mul_quant``
and ``gather_scale_quant_dense_tokens`` (the CPU path and the tests' oracle).

FBGEMM's formula (``fbgemm_gpu.experimental.gen_ai.moe``), per row of fp32 values ``v``, with
one difference, the bound's floor (FBGEMM takes a bound below 1e-12 as it is: a negative one
gives negative scales and sign-flipped data):

* ``m = max_j |v_j|``, NaN elements ignored (an all-NaN row has m = 0);
* ``m = max(m, 1e-12)``, then ``m = max(scale_ub, 1e-12)`` where ``scale_ub < m`` (a NaN bound
  is ignored; a zero, negative or -inf bound gives m = 1e-12, so ``s`` is never negative);
* ``s = 448 / m`` and the stored scale ``1 / s``, both IEEE divisions rounded to nearest;
* ``q = e4m3fn(clamp(v * s, -448, 448))`` rounded to nearest even; NaN products (a NaN element,
  or an infinite one times ``s = 0``) give the NaN byte 0x7F.

Dead rows (``live`` False) are all zero, scale included. Every step is exact IEEE fp32 math: the
Triton kernels (``moe_kernels._triton.fp8_rowwise``) reproduce it bit for bit in the interpreter
and, with ``ieee_div=True``, on the GPU; their GPU default divides like FBGEMM (``div.full.f32``,
within 2 ulp of these quotients).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12  # FBGEMM's floor on the row maximum (NVIDIA)
NAN_BYTE = 0x7F  # the e4m3fn NaN written for NaN products


def row_scales(
    amax_N: torch.Tensor, scale_ub: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1 / s) per row, fp32, from the NaN-free row maxima ``amax_N`` (fp32, >= 0)."""
    eps = torch.tensor(EPS, dtype=torch.float32, device=amax_N.device)
    m_N = torch.maximum(amax_N, eps)
    if scale_ub is not None:
        ub = scale_ub.reshape(()).float()
        m_N = torch.where(ub < m_N, torch.maximum(ub, eps), m_N)  # the bound floored at 1e-12
    # tensor / tensor: a true division (a Python scalar over a tensor is reciprocal * scalar)
    s_N = torch.full_like(m_N, FP8_MAX) / m_N
    return s_N, torch.ones_like(s_N) / s_N


def quantize_rows(
    v_ND: torch.Tensor, live_N: torch.Tensor | None, scale_ub: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, D) float8_e4m3fn, contiguous; scale (N,) float32): the row-wise quantisation of fp32
    ``v_ND``; rows where ``live_N`` is False are zero (q and scale)."""
    num_rows, dim = v_ND.shape
    if dim > 0:
        amax_N = torch.where(v_ND.isnan(), 0.0, v_ND.abs()).amax(dim=1)
    else:
        amax_N = v_ND.new_zeros(num_rows)
    s_N, inv_N = row_scales(amax_N, scale_ub)
    y_ND = v_ND * s_N[:, None]
    bits_ND = y_ND.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    bits_ND = torch.where(y_ND.isnan(), NAN_BYTE, bits_ND)
    if live_N is not None:
        bits_ND = torch.where(live_N[:, None], bits_ND, 0)
        inv_N = torch.where(live_N, inv_N, 0.0)
    return bits_ND.to(torch.uint8).contiguous().view(FP8_DTYPE), inv_N


def live_rows(num_rows: int, valid_token_count: torch.Tensor | None, device) -> torch.Tensor | None:
    """(N,) bool: i < valid_token_count (read on the device), or None when there is no count."""
    if valid_token_count is None:
        return None
    rows_N = torch.arange(num_rows, device=device)
    return rows_N < valid_token_count.reshape(()).long()
