"""Triton kernel for the fused MoE router (logits GEMM + softmax/sigmoid) and its launcher.

One program per block of BLOCK_T tokens holds all E logits of its tokens: it walks D in BLOCK_D
chunks, upcasting each x chunk to fp32 right after the load, and accumulates
``x_chunk @ w_chunk.T`` in fp32 with IEEE FMAs (``tl.dot(..., input_precision="ieee")``, or a
broadcast multiply + sum when ``RouterConfig.dot`` is False; never TF32), then applies the
max-subtracted softmax over E (or the sigmoid) in registers and writes (BLOCK_T, E) fp32 scores.
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
    SPLIT3: tl.constexpr,
    INTERP: tl.constexpr,
):
    """acc (BLOCK_T, BLOCK_E) + x[:, d0:d0+BLOCK_D] @ w[:, d0:d0+BLOCK_D].T, all fp32; with ACC3
    acc is (BLOCK_T, BLOCK_E, BLOCK_D) and gets the bare products (reduced over D at the end).
    SPLIT3 (bf16 x): w = hi + mid + lo exactly, three bf16 parts; three bf16 tensor-core dots."""
    c = d0 + cols
    x_ptrs = x_rows[:, None] + c[None, :] * stride_xd
    w_ptrs = w_rows[:, None] + c[None, :] * stride_wd
    if EVEN_D:
        x_c = tl.load(x_ptrs)
        w_c = tl.load(w_ptrs).to(tl.float32)
    else:
        c_in = c < D
        x_c = tl.load(x_ptrs, mask=c_in[None, :], other=0.0)
        w_c = tl.load(w_ptrs, mask=c_in[None, :], other=0.0).to(tl.float32)
    if SPLIT3:
        # Each part is the rounding error of the one before: exact in fp32, 8 significant bits
        # each (fp32 has 24), so x * part is exact and only the additions round (in fp32).
        w_hi = w_c.to(tl.bfloat16)
        r = w_c - w_hi.to(tl.float32)
        w_mid = r.to(tl.bfloat16)
        w_lo = (r - w_mid.to(tl.float32)).to(tl.bfloat16)
        if INTERP:  # the interpreter's bf16 dot is wrong: the same products in fp32
            x_c = x_c.to(tl.float32)
            acc = tl.dot(x_c, tl.trans(w_lo.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(x_c, tl.trans(w_mid.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(x_c, tl.trans(w_hi.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_c, tl.trans(w_lo), acc)
            acc = tl.dot(x_c, tl.trans(w_mid), acc)
            acc = tl.dot(x_c, tl.trans(w_hi), acc)
    else:
        x_c = x_c.to(tl.float32)
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
    SPLIT3: tl.constexpr,  # bf16 x: w split into three bf16 parts, bf16 tensor-core dots
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
    if WHILE_LOOPS:
        d0 = D * 0
        while d0 < D:
            acc = _router_step(
                acc,
                d0,
                x_rows,
                w_rows,
                cols,
                D,
                stride_xd,
                stride_wd,
                EVEN_D,
                USE_DOT,
                ACC3,
                SPLIT3,
                WHILE_LOOPS,
            )
            d0 += BLOCK_D
    else:
        for d0 in range(0, D, BLOCK_D):
            acc = _router_step(
                acc,
                d0,
                x_rows,
                w_rows,
                cols,
                D,
                stride_xd,
                stride_wd,
                EVEN_D,
                USE_DOT,
                ACC3,
                SPLIT3,
                WHILE_LOOPS,
            )
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
    split3: bool = False  # bf16 x only: three bf16 tensor-core dots with exact parts of w


def block_e(num_experts: int) -> int:
    """E padded to a power of two, at least 16 (tl.dot's smallest N)."""
    return max(16, triton.next_power_of_2(num_experts))


def pick_config(num_tokens: int, dim: int, num_experts: int) -> RouterConfig:
    """Blocks and warps from T, D, E.

    GPU: the (BLOCK_T, BLOCK_E) fp32 accumulator and the fp32 chunks of x (BLOCK_T, BLOCK_D) and
    w (BLOCK_E, BLOCK_D) live in registers: (BLOCK_T + BLOCK_D) * BLOCK_E <= 10240 keeps 4 warps
    below ptxas's 255 registers without spills (sm_90a, triton 3.8: E=128 at 32 x 64 spills,
    32 x 32 and 16 x 64 do not), so BLOCK_T and BLOCK_D shrink as E grows. BLOCK_T also
    shrinks until there are about two programs per SM of an H200 (132 SMs): small T would
    otherwise leave most SMs idle while x streams through a few. Very large E (> 256) gets 8
    warps and may still spill. Under the interpreter: few, large programs.
    """
    be = block_e(num_experts)
    bd_cap = max(16, triton.next_power_of_2(max(dim, 1)))
    if INTERPRET:
        return RouterConfig(
            min(64, max(16, triton.next_power_of_2(max(num_tokens, 1)))), min(256, bd_cap), 4, 1
        )
    block_t = 64 if be <= 64 else 32 if be <= 128 else 16
    while block_t > 16 and triton.cdiv(num_tokens, block_t) < 264:
        block_t //= 2
    block_d = 128
    while block_d > 16 and (block_t + block_d) * be > 10240:
        block_d //= 2
    block_d = min(block_d, bd_cap)
    num_warps = 4 if (block_t + block_d) * be <= 10240 else 8
    return RouterConfig(block_t, block_d, num_warps, 3)


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
        (triton.cdiv(num_tokens, cfg.block_t),),
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
            SPLIT3=cfg.split3 and x_TD.dtype == torch.bfloat16,
            WHILE_LOOPS=INTERPRET,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out_TE
