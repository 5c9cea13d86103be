"""The router's fp32 logits on bf16 tensor cores: ``x @ w.T`` for bf16 x and fp32 w as one bf16
GEMM against w split into three bf16 pieces, and the backward the same way.

An fp32 value w is exactly ``hi + mid + lo`` with ``hi = bf16(w)``, ``mid = bf16(w - hi)``,
``lo = bf16(w - hi - mid)`` (each residual is exact in fp32 and the last has at most 8
significant bits). A bf16 x times a bf16 piece is exact in fp32, so
``x @ hi.T + x @ mid.T + x @ lo.T``, each accumulated in fp32 by the tensor cores and the three
summed in fp32, is the fp32 product up to fp32 accumulation rounding: fp32 GEMM accuracy at bf16
GEMM speed, and no fp32 copy of x (the fp32 formula writes and keeps one).

Backward, from dlogits (T, E) fp32: ``dw = dl.T @ x`` from the three exact pieces of dl (fp32
out, summed as above); ``dx = dl @ w`` to bf16 from ``dl_hi w_hi + dl_hi w_mid + dl_mid w_hi``
(one GEMM with K = 3E; the dropped terms are below 2^-15 of the result, far under bf16's
rounding). Torch ops (cuBLAS) on CUDA; elsewhere the same sums as fp32 matmuls of the pieces.
"""

from __future__ import annotations

import torch


def split3(t: torch.Tensor) -> torch.Tensor:
    """(3, *t.shape) bf16: hi, mid, lo, whose fp32 sum is exactly the fp32 tensor t (values
    below bf16's normal range in lo aside)."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices with an fp32 result: cuBLAS's fp32 output on CUDA, else fp32 math
    of the (exact) bf16 values."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _sum3(t_T3E: torch.Tensor, n: int) -> torch.Tensor:
    return (t_T3E[:, :n] + t_T3E[:, n : 2 * n]) + t_T3E[:, 2 * n :]


def logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 ``x @ w.T`` for bf16 x_TD and fp32 weight_ED."""
    E = weight_ED.shape[0]
    w3_ED = split3(weight_ED.float()).reshape(3 * E, -1)
    return _sum3(_mm_f32(x_TD, w3_ED.T), E)


def logits_backward(
    dl_TE: torch.Tensor, x_TD: torch.Tensor, weight_ED: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (T, D) bf16, dw (E, D) fp32) of ``logits`` from dl_TE (T, E) fp32."""
    E = weight_ED.shape[0]
    w_hi, w_mid, _ = split3(weight_ED.float())
    d_hi, d_mid, d_lo = split3(dl_TE.float())
    a_TK = torch.cat([d_hi, d_hi, d_mid], dim=1)
    b_KD = torch.cat([w_hi, w_mid, w_hi], dim=0)
    dx = torch.mm(a_TK, b_KD) if a_TK.is_cuda else torch.mm(a_TK.float(), b_KD.float())
    d3_KT = torch.cat([d_hi.T, d_mid.T, d_lo.T], dim=0)
    dw = _mm_f32(d3_KT, x_TD)
    return dx.to(x_TD.dtype), (dw[:E] + dw[E : 2 * E]) + dw[2 * E :]
