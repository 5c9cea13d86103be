"""Triton kernel of ``route``'s backward: the scores' gradient (T, E) from the plan weights'
gradient (P,) in one launch (the torch formula is about fifteen small ops).

One program per BLOCK_T tokens. Per token t and choice j (K = top_k, unrolled): the pair r =
inverse[t, j] (unrouted: r < 0), g_j = scale * grad[r], its expert e_j = expert_indices[r] + start
(a pair outside [0, P) or an expert outside [0, E) counts as unrouted: memory-safe even for inputs
that are not route's). Plain weights: d_j = g_j. With ``RENORM`` (every choice routed or none: the
full expert range) the quotient rule of w_j = s_j / S, S = s_0 + s_1 + ... in choice order (the
forward's sum): d_j = (g_j - sum_i g_i w_i) / S, that sum in choice order too. The row is written
whole: d_j at column e_j (a token's experts are distinct), zero elsewhere. No atomics, no host
reads; the oracle is ``moe_kernels.reference.routing.route_backward_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _route_backward_kernel(
    grad_ptr,  # (P,) float: the plan weights' gradient
    inv_ptr,  # (T, K) int: route's inverse
    exp_ptr,  # (P,) int: local expert of each sorted pair
    scores_ptr,  # (T, E) float (RENORM only)
    out_ptr,  # (T, E), contiguous
    T,
    E,
    P,
    start,
    scale,
    stride_it,
    stride_ij,
    stride_st,
    stride_se,
    K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NUM_E: tl.constexpr,  # cdiv(E, BLOCK_E), unrolled (constexpr: Triton 3.5's interpreter)
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_in = t < T
    j = tl.arange(0, BLOCK_K)
    tj_in = t_in[:, None] & (j < K)[None, :]
    r = tl.load(inv_ptr + t[:, None] * stride_it + j[None, :] * stride_ij, mask=tj_in, other=-1)
    r = r.to(tl.int64)
    ok = tj_in & (r >= 0) & (r < P)
    e = tl.load(exp_ptr + r, mask=ok, other=-1).to(tl.int64) + start
    ok = ok & (e >= 0) & (e < E)  # (trusted inputs; clamped all the same: memory safety)
    # fp32 arithmetic on every launcher: Inductor passes a Python float as an fp64 argument
    # (Triton's launcher as fp32), which would carry the whole quotient rule in fp64
    g = tl.load(grad_ptr + r, mask=ok, other=0.0).to(tl.float32) * tl.cast(scale, tl.float32)
    e = tl.where(ok, e, -1)
    if RENORM:
        s = tl.load(scores_ptr + t[:, None] * stride_st + e * stride_se, mask=ok, other=0.0)
        s = s.to(tl.float32)
        total = tl.sum(tl.where(j[None, :] == 0, s, 0.0), axis=1)
        for i in tl.static_range(1, K):  # S in choice order, as the forward sums it
            total = total + tl.sum(tl.where(j[None, :] == i, s, 0.0), axis=1)
        any_ok = tl.sum(ok.to(tl.int32), axis=1) > 0
        total = tl.where(any_ok, total, 1.0)
        w = s / total[:, None]
        gw = g * w
        dot = tl.sum(tl.where(j[None, :] == 0, gw, 0.0), axis=1)
        for i in tl.static_range(1, K):
            dot = dot + tl.sum(tl.where(j[None, :] == i, gw, 0.0), axis=1)
        d = (g - dot[:, None]) / total[:, None]
    else:
        d = g
    d = tl.where(ok, d, 0.0)
    for c in tl.static_range(NUM_E):
        cols = c * BLOCK_E + tl.arange(0, BLOCK_E)
        val = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for i in tl.static_range(K):
            e_i = tl.sum(tl.where(j[None, :] == i, e, 0), axis=1)
            d_i = tl.sum(tl.where(j[None, :] == i, d, 0.0), axis=1)
            val = tl.where(cols[None, :] == e_i[:, None], d_i[:, None], val)
        dst = out_ptr + t[:, None] * E + cols[None, :]
        tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=t_in[:, None] & (cols < E)[None, :])


_launcher = FastKernel(_route_backward_kernel)


def route_backward(
    grad_P: torch.Tensor,
    inverse_TK: torch.Tensor,
    expert_indices_P: torch.Tensor,
    scores_TE: torch.Tensor,
    start: int,
    scale: float,
    renormalize: bool,
) -> torch.Tensor:
    """d scores (T, E) in the scores' dtype (module docstring). ``renormalize`` needs the full
    expert range (every choice of a token routed, or none). Inputs are trusted."""
    T, E = scores_TE.shape
    K = inverse_TK.shape[1]
    out = torch.empty((T, E), dtype=scores_TE.dtype, device=scores_TE.device)
    if T == 0 or E == 0:
        return out
    block_e = min(next_pow2(E), 64 if INTERPRET else 256)
    block_t = 16 if INTERPRET else max(1, min(64, 4096 // block_e))
    args = (grad_P, inverse_TK, expert_indices_P, scores_TE, out, T, E, grad_P.shape[0], start,
            float(scale), inverse_TK.stride(0), inverse_TK.stride(1), scores_TE.stride(0),
            scores_TE.stride(1))  # fmt: skip
    constexprs = dict(K=K, RENORM=bool(renormalize), BLOCK_T=block_t, BLOCK_K=next_pow2(K),
                      BLOCK_E=block_e, NUM_E=cdiv(E, block_e))  # fmt: skip
    _launcher.launch((cdiv(T, block_t),), args, constexprs, num_warps=4)
    return out
