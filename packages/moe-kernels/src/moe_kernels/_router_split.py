"""The router's fp32 logits on bf16 tensor cores: ``x @ w.T`` for bf16 x and fp32 w as one bf16
GEMM against w split into three bf16 pieces, and the backward the same way.

An fp32 value w is exactly ``hi + mid + lo`` with ``hi = bf16(w)``, ``mid = bf16(w - hi)``,
``lo = bf16(w - hi - mid)`` (each residual is exact in fp32 and the last has at most 8
significant bits). A bf16 x times a bf16 piece is exact in fp32, so
``x @ hi.T + x @ mid.T + x @ lo.T``, each accumulated in fp32 by the tensor cores and the three
summed in fp32, is the fp32 product up to fp32 accumulation rounding: fp32 GEMM accuracy at bf16
GEMM speed, and no fp32 copy of x (the fp32 formula writes and keeps one).

Backward, from dlogits (T, E) fp32: ``dw = dl.T @ x`` from the three exact pieces of dl (fp32
out, summed as above); ``dx = dl @ w`` to bf16 from ``dl_mid w_hi + dl_hi w_hi + dl_hi w_mid``
(one GEMM with K = 3E; the dropped terms are below 2^-15 of the result, far under bf16's
rounding). The pieces come from Triton kernels (``_triton/router_split.py``: one launch for the
weight's, one for dlogits and its) and the GEMMs from cuBLAS on CUDA; elsewhere the same sums
as torch ops (the kernels' oracle), the GEMMs as fp32 matmuls of the exact pieces.
"""

from __future__ import annotations

import torch

from moe_kernels._dispatch import triton_kernels, use_triton


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


def _kernels():
    return triton_kernels("router_split")  # imported on first use: triton only when a kernel runs


def logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 ``x @ w.T`` for bf16 x_TD and fp32 weight_ED."""
    E = weight_ED.shape[0]
    if use_triton(x_TD.device):
        w3_ED = _kernels().split_weight(weight_ED)[E:]  # [hi; mid; lo]
    else:
        w3_ED = split3(weight_ED.float()).reshape(3 * E, -1)
    return _sum3(_mm_f32(x_TD, w3_ED.T), E)


def logits_grad(g_TE: torch.Tensor, s_TE: torch.Tensor, score_fn: str) -> torch.Tensor:
    """dlogits (T, E) fp32 of the scores s = score_fn(logits) from their gradient g."""
    g_TE = g_TE.float()
    if score_fn == "softmax":
        return s_TE * (g_TE - (g_TE * s_TE).sum(dim=-1, keepdim=True))
    return g_TE * s_TE * (1.0 - s_TE)


def scores_backward(
    g_TE: torch.Tensor, s_TE: torch.Tensor, score_fn: str, x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx (T, D) in x's dtype, dw (E, D) fp32) of ``score_fn(logits(x, w))`` from the scores'
    gradient g_TE and the saved scores s_TE (T, E) fp32. Where the kernels run: one launch for
    the weight's pieces, one for dlogits and its pieces, then the two GEMMs; else the same sums
    in torch (``logits_grad``, ``split3``)."""
    E = weight_ED.shape[0]
    if use_triton(x_TD.device):
        k = _kernels()
        w4_ED = k.split_weight(weight_ED)  # [hi; hi; mid; lo]
        a_TK, b_TK = k.split_grad(g_TE, s_TE, score_fn == "softmax")  # [mid|hi|hi], [hi|mid|lo]
        b_KD = w4_ED[: 3 * E]
    else:
        w_hi, w_mid, _ = split3(weight_ED.float())
        d_hi, d_mid, d_lo = split3(logits_grad(g_TE, s_TE, score_fn))
        a_TK = torch.cat([d_mid, d_hi, d_hi], dim=1)
        b_KD = torch.cat([w_hi, w_hi, w_mid], dim=0)
        b_TK = torch.cat([d_hi, d_mid, d_lo], dim=1)
    dx = torch.mm(a_TK, b_KD) if a_TK.is_cuda else torch.mm(a_TK.float(), b_KD.float())
    dw = _mm_f32(b_TK.T, x_TD)
    return dx.to(x_TD.dtype), (dw[:E] + dw[E : 2 * E]) + dw[2 * E :]
