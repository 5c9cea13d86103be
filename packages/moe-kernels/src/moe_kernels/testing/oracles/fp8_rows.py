"""Row-wise FP8 oracles (FBGEMM's SwiGLU and quantisation ops): the quantisation one numpy row at
a time with fp32 IEEE divisions and e4m3 rounding by nearest-value search (bit-exact), SiLU-and-mul
in FBGEMM's fp32 expression row by row, the gathered and scaled rows, and SiLU-and-mul in float64
with the error bound of any fp32 evaluation."""

from __future__ import annotations

import torch

from moe_kernels.testing.oracles.mxfp8 import oracle_e4m3_bits

__all__ = [
    "oracle_gather_quant",
    "oracle_quant_rows",
    "oracle_silu_mul",
    "oracle_silu_mul_exact",
]

U32 = 2.0**-24  # unit roundoff of fp32


def oracle_quant_rows(v: torch.Tensor, live: list[bool] | None, ub: float | None):
    """(q bytes (N, D) uint8, scale (N,) fp32) of fp32 ``v``: one numpy row at a time. Per live
    row: m = max(max |finite v|, 1e-12), bounded by ``ub`` (a bound below the floor acts as the
    floor), s = 448 / m, scale = 1 / s, q = e4m3 of clip(v * s) (NaN stays NaN, 0x7F); rows not
    ``live`` zero."""
    import numpy as np

    v32 = v.float().numpy()
    n, d = v32.shape
    q, scale = np.zeros((n, d), np.uint8), np.zeros(n, np.float32)
    with np.errstate(all="ignore"):
        for i in range(n):
            if live is not None and not live[i]:
                continue
            row = v32[i]
            finite = np.abs(row[~np.isnan(row)])
            m = np.float32(max(float(finite.max()) if finite.size else 0.0, np.float32(1e-12)))
            if ub is not None and ub < m:  # a bound below the 1e-12 floor acts as the floor
                m = np.float32(max(np.float32(ub), np.float32(1e-12)))
            s = np.float32(448.0) / m
            scale[i] = np.float32(1.0) / s
            y = row * s
            bits = oracle_e4m3_bits(np.clip(y, -448.0, 448.0).astype(np.float64))
            q[i] = np.where(np.isnan(y), 0x7F, bits)
    return torch.from_numpy(q), torch.from_numpy(scale)


def oracle_silu_mul(x0: torch.Tensor, x1: torch.Tensor, vtc: int | None = None) -> torch.Tensor:
    """fp32 (T, D): (x0 * (1 / (1 + exp(-x0)))) * x1 one row at a time; rows >= vtc zero."""
    out = torch.zeros(x0.shape, dtype=torch.float32)
    for t in range(x0.shape[0] if vtc is None else min(vtc, x0.shape[0])):
        a = x0[t].float()
        out[t] = (a * torch.reciprocal(1.0 + torch.exp(-a))) * x1[t].float()
    return out


def oracle_gather_quant(x, tok, exp, scores, ub=None, vtc=None):
    """(q bytes, scale) of ``gather_scale_quant_dense_tokens``: the rows x[t] * scores[t, e] in
    fp32, a Python loop deciding which rows live (0 <= t < T, 0 <= e < E, i < vtc), then
    ``oracle_quant_rows``."""
    n, (num_tokens, num_experts) = tok.shape[0], scores.shape
    v = torch.zeros(n, x.shape[1])
    live = []
    for i in range(n):
        t, e = int(tok[i]), int(exp[i])
        ok = 0 <= t < num_tokens and 0 <= e < num_experts and (vtc is None or i < vtc)
        live.append(ok)
        if ok:
            v[i] = x[t].float() * scores[t, e].float()
    return oracle_quant_rows(v, live, ub)


def oracle_silu_mul_exact(x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0 * sigmoid(x0) * x1 in float64, the bound on the error of any fp32 evaluation of
    FBGEMM's expression ``(x0 * (1 / (1 + exp(-x0)))) * x1``, relative to the exact value).

    exp: 4 ulps (``ex2.approx``) plus the rounding of its argument ``-x0 * log2(e)`` (and of
    log2(e)): (2 |x0| + 8) u; it moves ``1 + e`` and the sigmoid by (1 - sigmoid) times that.
    Then ``1 + e`` (u), the division (``div.full``: 2 ulps, 4 u) and the two products (u each):
    7 u, taken as 12 u (margin: the emulated worst case of each step reaches 8 u)."""
    a, b = x0.double().cpu(), x1.double().cpu()
    sig = torch.sigmoid(a)
    return a * sig * b, ((1 - sig) * (2 * a.abs() + 8) + 12) * U32
