"""Triton kernel for the fused MoE router (logits GEMM + softmax/sigmoid) and its launcher.

One program per block of BLOCK_T tokens holds all E logits of its tokens: it walks D in BLOCK_D
chunks, upcasting each x chunk to fp32 right after the load, and accumulates the products in
fp32 with IEEE multiply-adds, never TF32. The GPU default (``RouterConfig.acc3``) keeps a
(BLOCK_T, BLOCK_E, BLOCK_D) accumulator of per-lane partial sums, so the D loop is loads and FMAs
only, and reduces it over BLOCK_D once at the end; ``tl.dot(..., input_precision="ieee")`` and a
per-chunk broadcast multiply + sum are the other modes. Then it applies the max-subtracted
softmax over E (or the sigmoid) in registers and writes (BLOCK_T, E) fp32 scores.
x is read once. With ``RouterConfig.split`` = S > 1 the D loop is cut into S contiguous slices
(a second grid axis, S times the programs): each writes its raw fp32 partial logits to a (S, T, E)
scratch and a small second kernel adds the S partials in slice order before the softmax. No
atomics anywhere: every sum has a fixed order, so results are bitwise reproducible for a given
config (a different S rounds differently). Rows past T and experts past E are clamped on load
(no masks in the D loop) and masked on store / out of the softmax. Nothing here checks
arguments: the public module ``moe_kernels.router`` does that before any launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.launch import FastKernel

# WHILE_LOOPS (True only under the interpreter): triton 3.5's interpreter cannot ``range()`` over a
# runtime scalar, so the D loop there is a ``while`` loop; the GPU compiles the ``for`` loop.


@triton.jit
def _router_step(
    acc,
    d0,
    x_rows,
    w_rows,
    cols,
    D,
    stride_xd,
    stride_wd,
    EVEN_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    ACC3: tl.constexpr,
):
    """acc (BLOCK_T, BLOCK_E) + x[:, d0:d0+BLOCK_D] @ w[:, d0:d0+BLOCK_D].T, all fp32; with ACC3
    acc is (BLOCK_T, BLOCK_E, BLOCK_D) and gets the bare products (reduced over D at the end)."""
    c = d0 + cols
    x_ptrs = x_rows[:, None] + c[None, :] * stride_xd
    w_ptrs = w_rows[:, None] + c[None, :] * stride_wd
    if EVEN_D:
        x_c = tl.load(x_ptrs).to(tl.float32)
        w_c = tl.load(w_ptrs).to(tl.float32)
    else:
        c_in = c < D
        x_c = tl.load(x_ptrs, mask=c_in[None, :], other=0.0).to(tl.float32)
        w_c = tl.load(w_ptrs, mask=c_in[None, :], other=0.0).to(tl.float32)
    if ACC3:
        acc += x_c[:, None, :] * w_c[None, :, :]
    elif USE_DOT:
        acc = tl.dot(x_c, tl.trans(w_c), acc, input_precision="ieee")
    else:
        acc += tl.sum(x_c[:, None, :] * w_c[None, :, :], axis=2)
    return acc


@triton.jit
def _scores_store(acc, rows, experts, out_ptr, T, E, SIGMOID: tl.constexpr):
    """softmax over E (max-subtracted, IEEE divide like torch) or sigmoid of the (BLOCK_T,
    BLOCK_E) fp32 logits; store rows < T, experts < E into out (T, E)."""
    e_in = experts < E
    if SIGMOID:
        scores = tl.math.div_rn(tl.full(acc.shape, 1.0, tl.float32), 1.0 + tl.exp(-acc))
    else:
        logits = tl.where(e_in[None, :], acc, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None])
    dst = out_ptr + rows[:, None] * E + experts[None, :]
    tl.store(dst, scores, mask=(rows < T)[:, None] & e_in[None, :])


@triton.jit
def _router_kernel(
    x_ptr,  # (T, D) fp32/bf16/fp16, any strides
    w_ptr,  # (E, D) fp32/bf16/fp16, any strides
    out_ptr,  # (T, E) fp32 scores, or (S, T, E) fp32 partial logits when SPLIT
    T,
    D,
    E,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wd,
    d_split,  # columns per D slice (SPLIT; a multiple of BLOCK_D), else D
    SIGMOID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    ACC3: tl.constexpr,  # per-lane partial sums over D, one tree reduction at the end
    SPLIT: tl.constexpr,  # program_id(1) picks a D slice; store raw partial logits
    WHILE_LOOPS: tl.constexpr,
):
    pid = tl.program_id(0)
    d_lo = tl.program_id(1) * d_split
    d_hi = tl.minimum(D, d_lo + d_split)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    # Clamped indices: padded rows / experts re-read the last real one (no load masks); their
    # results are dropped below.
    x_rows = x_ptr + tl.minimum(rows, T - 1) * stride_xt
    w_rows = w_ptr + tl.minimum(experts, E - 1).to(tl.int64) * stride_we
    cols = tl.arange(0, BLOCK_D)
    if ACC3:
        acc = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_D), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if WHILE_LOOPS:
        d0 = d_lo
        while d0 < d_hi:
            acc = _router_step(
                acc, d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D, USE_DOT, ACC3
            )
            d0 += BLOCK_D
    else:
        for d0 in range(d_lo, d_hi, BLOCK_D):
            acc = _router_step(
                acc, d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D, USE_DOT, ACC3
            )
    if ACC3:
        acc = tl.sum(acc, axis=2)
    if SPLIT:
        dst = out_ptr + tl.program_id(1).to(tl.int64) * T * E + rows[:, None] * E + experts[None, :]
        tl.store(dst, acc, mask=(rows < T)[:, None] & (experts < E)[None, :])
    else:
        _scores_store(acc, rows, experts, out_ptr, T, E, SIGMOID)


@triton.jit
def _router_finish_kernel(
    part_ptr,  # (S, T, E) fp32 partial logits
    out_ptr,  # (T, E) fp32 scores
    T,
    E,
    S,
    SIGMOID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """logits = partial[0] + partial[1] + ... + partial[S-1] (in that order), then the scores."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    m = (rows < T)[:, None] & (experts < E)[None, :]
    src = part_ptr + rows[:, None] * E + experts[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if WHILE_LOOPS:
        s = S * 0
        while s < S:
            acc += tl.load(src + s * T * E, mask=m, other=0.0)
            s += 1
    else:
        for s in range(0, S):
            acc += tl.load(src + s * T * E, mask=m, other=0.0)
    _scores_store(acc, rows, experts, out_ptr, T, E, SIGMOID)


_router = FastKernel(_router_kernel)
_router_finish = FastKernel(_router_finish_kernel)


class RouterConfig(NamedTuple):
    """Launch shape: tokens per program, D chunk, warps, pipeline stages, tl.dot or sum."""

    block_t: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    acc3: bool = False  # (BLOCK_T, BLOCK_E, BLOCK_D) partial sums: FMAs only in the D loop
    split: int = 1  # D slices (a second grid axis) summed in order by a second kernel


def block_e(num_experts: int) -> int:
    """E padded to a power of two, at least 16 (tl.dot's smallest N)."""
    return max(16, triton.next_power_of_2(num_experts))


def pick_config(num_tokens: int, dim: int, num_experts: int) -> RouterConfig:
    """Blocks and warps from T, D, E.

    GPU: per-lane partial sums (``acc3``), whose (BLOCK_T, BLOCK_E, BLOCK_D) fp32 accumulator
    is kept at <= 128 registers per thread (ptxas: no spills). H200, D=2048, graph medians
    (``gpu/router_sweep.py``): E=16: 4 x 128 at T=512 (8.5 us vs 13.7 us for the torch formula
    compiled), 8 x 128 at T=2048 (14.2 vs 25.6), 16 x 64 at T=16384 (89 vs 152); E=128, where
    the compiled formula (cuBLAS) stays faster from T=512 on: 4 x 64 with 8 warps at T=512 (29 vs
    19), 8 x 16 above (60 vs 44 at T=2048). The old ``tl.dot`` (FMA) layout took 44 / 158 us at
    T=2048. Under the interpreter: few, large programs with ``tl.dot``.
    """
    be = block_e(num_experts)
    bd_cap = max(16, triton.next_power_of_2(max(dim, 1)))
    if INTERPRET:
        return RouterConfig(
            min(64, max(16, triton.next_power_of_2(max(num_tokens, 1)))), min(256, bd_cap), 4, 1
        )
    if be <= 32:
        warps = 4
        block_t, block_d = (
            (4, 128) if num_tokens <= 1024 else (8, 128) if num_tokens <= 4096 else (16, 64)
        )
    elif num_tokens <= 1024:
        block_t, block_d, warps = 4, 64, 8
    else:
        block_t, block_d, warps = 8, 16, 4 if be <= 128 else 8
    while block_t * be * block_d > 128 * 32 * warps:  # accumulator registers per thread
        if block_d > 16:
            block_d //= 2
        elif block_t > 1:
            block_t //= 2
        else:
            break
    return RouterConfig(block_t, min(block_d, bd_cap), warps, 3, dot=False, acc3=True)


def router_scores(
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    sigmoid: bool,
    config: RouterConfig | None = None,
) -> torch.Tensor:
    """(T, E) fp32 scores: softmax over E (or sigmoid) of the fp32 logits x @ w.T."""
    num_tokens, dim = x_TD.shape
    num_experts = weight_ED.shape[0]
    out_TE = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x_TD.device)
    if num_tokens == 0:
        return out_TE
    cfg = config or pick_config(num_tokens, dim, num_experts)
    block_d = cfg.block_d
    # D slices of whole BLOCK_D chunks; S = the number of non-empty slices.
    d_split = triton.cdiv(triton.cdiv(dim, max(cfg.split, 1)), block_d) * block_d
    n_split = triton.cdiv(dim, d_split) if dim else 1
    dst = out_TE
    if n_split > 1:
        dst = out_TE.new_empty((n_split, num_tokens, num_experts))
    _router.launch(
        (triton.cdiv(num_tokens, cfg.block_t), n_split),
        (
            x_TD,
            weight_ED,
            dst,
            num_tokens,
            dim,
            num_experts,
            x_TD.stride(0),
            x_TD.stride(1),
            weight_ED.stride(0),
            weight_ED.stride(1),
            d_split if n_split > 1 else dim,
        ),
        dict(
            SIGMOID=sigmoid,
            BLOCK_T=cfg.block_t,
            BLOCK_E=block_e(num_experts),
            BLOCK_D=block_d,
            EVEN_D=dim % block_d == 0,
            USE_DOT=cfg.dot,
            ACC3=cfg.acc3,
            SPLIT=n_split > 1,
            WHILE_LOOPS=INTERPRET,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if n_split > 1:
        finish_t = max(1, min(64, 4096 // block_e(num_experts)))
        _router_finish.launch(
            (triton.cdiv(num_tokens, finish_t),),
            (dst, out_TE, num_tokens, num_experts, n_split),
            dict(
                SIGMOID=sigmoid,
                BLOCK_T=finish_t,
                BLOCK_E=block_e(num_experts),
                WHILE_LOOPS=INTERPRET,
            ),
            num_warps=4,
        )
    return out_TE
