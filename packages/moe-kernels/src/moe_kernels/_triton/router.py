"""Triton kernel for the fused MoE router (logits GEMM + softmax/sigmoid) and its launcher.

One program per block of BLOCK_T tokens holds all E logits of its tokens: it walks D in BLOCK_D
chunks, upcasting each x chunk to fp32 right after the load, and accumulates the products in
fp32 with IEEE multiply-adds, never TF32. The GPU default (``RouterConfig.acc3``) keeps a
(BLOCK_T, BLOCK_E, BLOCK_D) accumulator of per-lane partial sums, so the D loop is loads and FMAs
only, and reduces it over BLOCK_D once at the end; with ``RouterConfig.prefetch`` the loads of
chunk i+1 are issued before the FMAs of chunk i (registers double-buffered).
``tl.dot(..., input_precision="ieee")`` and a per-chunk broadcast multiply + sum are the other
modes. Then it applies the max-subtracted softmax over E (or the sigmoid) in registers and
writes (BLOCK_T, E) fp32 scores.
x is read once; no split over D, no atomics: every program reduces in a fixed order, so results
are bitwise reproducible. Rows past T and experts past E are clamped on load (no masks in the D
loop) and masked on store / out of the softmax. Nothing here checks arguments: the public module
``moe_kernels.router`` does that before any launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel

# WHILE_LOOPS (True only under the interpreter): triton 3.5's interpreter cannot ``range()`` over a
# runtime scalar, so the D loop there is a ``while`` loop; the GPU compiles the ``for`` loop.


@triton.jit
def _router_load(d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D: tl.constexpr):
    """The chunk d0:d0+BLOCK_D of the x rows and w rows, in their own dtypes (zeros past D)."""
    c = d0 + cols
    x_ptrs = x_rows[:, None] + c[None, :] * stride_xd
    w_ptrs = w_rows[:, None] + c[None, :] * stride_wd
    if EVEN_D:
        x_c = tl.load(x_ptrs)
        w_c = tl.load(w_ptrs)
    else:
        c_in = c < D
        x_c = tl.load(x_ptrs, mask=c_in[None, :], other=0.0)
        w_c = tl.load(w_ptrs, mask=c_in[None, :], other=0.0)
    return x_c, w_c


@triton.jit
def _router_fma(acc, x_c, w_c, USE_DOT: tl.constexpr, ACC3: tl.constexpr):
    """acc (BLOCK_T, BLOCK_E) + x_c @ w_c.T, all fp32; with ACC3 acc is (BLOCK_T, BLOCK_E,
    BLOCK_D) and gets the bare products (reduced over D at the end)."""
    x_c = x_c.to(tl.float32)
    w_c = w_c.to(tl.float32)
    if ACC3:
        acc += x_c[:, None, :] * w_c[None, :, :]
    elif USE_DOT:
        acc = tl.dot(x_c, tl.trans(w_c), acc, input_precision="ieee")
    else:
        acc += tl.sum(x_c[:, None, :] * w_c[None, :, :], axis=2)
    return acc


@triton.jit
def _router_kernel(
    x_ptr,  # (T, D) fp32/bf16/fp16, any strides
    w_ptr,  # (E, D) fp32/bf16/fp16, any strides
    out_ptr,  # (T, E) fp32, contiguous
    T,
    D,
    E,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wd,
    SIGMOID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    ACC3: tl.constexpr,  # per-lane partial sums over D, one tree reduction at the end
    PREFETCH: tl.constexpr,  # issue chunk i+1's loads before chunk i's FMAs (needs D > 0)
    WHILE_LOOPS: tl.constexpr,
):
    pid = tl.program_id(0)
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
    if PREFETCH:  # registers double-buffered: the next chunk is in flight during the FMAs
        x_c, w_c = _router_load(0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D)
        if WHILE_LOOPS:
            d0 = D * 0 + BLOCK_D
            while d0 < D:
                x_n, w_n = _router_load(d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D)
                acc = _router_fma(acc, x_c, w_c, USE_DOT, ACC3)
                x_c, w_c = x_n, w_n
                d0 += BLOCK_D
        else:
            for d0 in range(BLOCK_D, D, BLOCK_D):
                x_n, w_n = _router_load(d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D)
                acc = _router_fma(acc, x_c, w_c, USE_DOT, ACC3)
                x_c, w_c = x_n, w_n
        acc = _router_fma(acc, x_c, w_c, USE_DOT, ACC3)
    elif WHILE_LOOPS:
        d0 = D * 0
        while d0 < D:
            x_c, w_c = _router_load(d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D)
            acc = _router_fma(acc, x_c, w_c, USE_DOT, ACC3)
            d0 += BLOCK_D
    else:
        for d0 in range(0, D, BLOCK_D):
            x_c, w_c = _router_load(d0, x_rows, w_rows, cols, D, stride_xd, stride_wd, EVEN_D)
            acc = _router_fma(acc, x_c, w_c, USE_DOT, ACC3)
    if ACC3:
        acc = tl.sum(acc, axis=2)

    e_in = experts < E
    if SIGMOID:
        scores = tl.math.div_rn(tl.full(acc.shape, 1.0, tl.float32), 1.0 + tl.exp(-acc))
    else:
        logits = tl.where(e_in[None, :], acc, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None])  # IEEE divide, like torch
    dst = out_ptr + rows[:, None] * E + experts[None, :]
    tl.store(dst, scores, mask=(rows < T)[:, None] & e_in[None, :])


_router = FastKernel(_router_kernel)


class RouterConfig(NamedTuple):
    """Launch shape: tokens per program, D chunk, warps, pipeline stages, tl.dot or sum."""

    block_t: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    acc3: bool = False  # (BLOCK_T, BLOCK_E, BLOCK_D) partial sums: FMAs only in the D loop
    prefetch: bool = False  # chunk i+1's loads issued before chunk i's FMAs


def block_e(num_experts: int) -> int:
    """E padded to a power of two, at least 16 (tl.dot's smallest N)."""
    return max(16, next_pow2(num_experts))


def pick_config(num_tokens: int, dim: int, num_experts: int) -> RouterConfig:
    """Blocks and warps from T, D, E.

    GPU: per-lane partial sums (``acc3``) with the next D chunk's loads issued before the
    current chunk's FMAs (``prefetch``); the (BLOCK_T, BLOCK_E, BLOCK_D) fp32 accumulator is kept
    at <= 128 registers per thread (ptxas: no spills). H200, D=2048, graph medians
    (``benchmarks/gpu/router_sweep.py``, session 5): E=16: 4 x 128 at T=512 (7.0 us vs 14.4 us for
    the torch formula compiled), 16 x 64 at T=2048 (11.2 vs 24.1), 16 x 32 at T=16384 (76 vs 135);
    E=128, where the compiled formula (cuBLAS) stays faster: 4 x 64 with 8 warps at T=512 (28.5 vs
    19.3, no prefetch), 8 x 16 above (58 vs 44 at T=2048). Under the interpreter: few, large
    programs with ``tl.dot``.
    """
    be = block_e(num_experts)
    bd_cap = max(16, next_pow2(max(dim, 1)))
    if INTERPRET:
        return RouterConfig(min(64, max(16, next_pow2(max(num_tokens, 1)))), min(256, bd_cap), 4, 1)
    prefetch = True
    if be <= 32:
        warps = 4
        block_t, block_d = (
            (4, 128) if num_tokens <= 1024 else (16, 64) if num_tokens <= 4096 else (16, 32)
        )
    elif num_tokens <= 1024:
        block_t, block_d, warps, prefetch = 4, 64, 8, False
    else:
        block_t, block_d, warps = 8, 16, 4 if be <= 128 else 8
        prefetch = be <= 128  # E=1000: ptxas spills with the second buffer
    while block_t * be * block_d > 128 * 32 * warps:  # accumulator registers per thread
        if block_d > 16:
            block_d //= 2
        elif block_t > 1:
            block_t //= 2
        else:
            break
    return RouterConfig(
        block_t, min(block_d, bd_cap), warps, 3, dot=False, acc3=True, prefetch=prefetch
    )


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
    _router.launch(
        (cdiv(num_tokens, cfg.block_t),),
        (
            x_TD,
            weight_ED,
            out_TE,
            num_tokens,
            dim,
            num_experts,
            x_TD.stride(0),
            x_TD.stride(1),
            weight_ED.stride(0),
            weight_ED.stride(1),
        ),
        dict(
            SIGMOID=sigmoid,
            BLOCK_T=cfg.block_t,
            BLOCK_E=block_e(num_experts),
            BLOCK_D=block_d,
            EVEN_D=dim % block_d == 0,
            USE_DOT=cfg.dot,
            ACC3=cfg.acc3,
            PREFETCH=cfg.prefetch and dim > 0,
            WHILE_LOOPS=INTERPRET,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out_TE
