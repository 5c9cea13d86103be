"""Triton grouped GEMV for few rows per expert (a decode step), and its launcher.

``y[p] = act(x[rows[p]] @ w[e].T)`` for the rows p of expert e (``offsets[e] <= p < offsets[e+1]``);
act: none, SiLU, or SwiGLU ``silu(g) * u`` with g from w[e]'s gate rows [0, H) and u from its up
rows [H, 2H) (y then has H = N / 2 columns: expert_mlp's gated layout).

At a decode step's few rows an expert GEMM is a read of the touched experts' weights, so each
program owns one non-empty group (a *slot*) and one BN-column tile of its outputs: it streams
w[e][cols] (BN x K; gated: BN gate and BN up rows) once over K in BK steps (software pipelined by
``num_stages``) and applies every step to the group's rows as one (BM, BK) x (BK, BN) ``tl.dot``
(BM rows a chunk: 16 by default, the smallest MMA tile), fp32 accumulators, the activation on
them, one rounding. A group with more than BM rows (any routing is allowed) runs its chunks one
after another, re-reading the weight tile (from L2 while it is there): correct for every
routing, fast for few rows.

Grid (static, no host read of ``offsets``): ``min(P, E + 1) * ceil(N_out / BN)`` programs. At
most that many segments hold rows: the E groups and the tail [offsets[E], P) (zeroed, as the tile
GEMM zeroes it), each non-empty one holding at least one of the P rows, so where P <= E the tail
costs no program. Each program loads the E+1 offsets, clamps them by the grouped GEMMs' rule
(``grouped_mm.group_tiles``: memory-safe for any offsets), ranks the non-empty segments and takes
the slot-th (``grouped_mm.find_tile`` with one "tile" per non-empty segment); slots past the last
non-empty segment exit at once. (A grid of E x N tiles with early exits would launch E / (T k)
times as many programs, 16x for one token of a 128-expert top-8 layer, each paying a launch and
the offsets' load for nothing.)

Determinism and batch invariance: every output is one row's dot over K in BK steps in one fixed
order, in fp32, with a launch config that depends on K and the device only (never on the rows);
an MMA computes each row of its tile independently of the tile's other rows, so a row's bits
depend on its token, its expert's weights and K alone: the same whether the token is alone or
among others, whichever chunk or lane it lands in. (The plan picks this kernel by the total row
count, so crossing that bound changes kernel and bits.) Rows whose index is outside [0, T) are
zero. Nothing here checks arguments: the public modules do that before any launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2, pow2_clamp
from moe_kernels._triton.grouped_mm import dot_acc, find_tile, group_tiles, row_sources
from moe_kernels._triton.launch import FastKernel

ACTIVATIONS = {"none": 0, "silu": 1, "swiglu": 2}


@triton.jit
def _load_k(ptrs, k0, stride_k, ks, K, K_AXIS: tl.constexpr, EVEN_K: tl.constexpr):
    """The BK-wide K step at k0 of a tile whose K runs along axis K_AXIS (columns past K: 0)."""
    if EVEN_K:
        return tl.load(ptrs + k0 * stride_k)
    k_in = (k0 + ks) < K
    mask = k_in[None, :] if K_AXIS == 1 else k_in[:, None]
    return tl.load(ptrs + k0 * stride_k, mask=mask, other=0.0)


@triton.jit
def _grouped_gemv_kernel(
    x_ptr,  # (T, K)
    w_ptr,  # (E, N, K); gated: (E, 2N, K), gate rows first
    offs_ptr,  # (E+1,) int32/int64
    ridx_ptr,  # (P,) int32/int64 (HAS_RIDX only)
    y_ptr,  # (P, N), contiguous
    T,
    P,
    N,  # output columns (gated: H)
    K,
    E,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    up_offset,  # N * stride_wn: gated, the up rows' offset from the gate rows
    HAS_RIDX: tl.constexpr,
    ACTIVATION: tl.constexpr,  # ACTIVATIONS
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NUM_K: tl.constexpr,  # cdiv(K, BK): the fixed K order
    EVEN_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    slot = pid // num_n
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    col_in = cols < N
    idx = tl.arange(0, BLOCK_E)
    raw_start = tl.load(offs_ptr + idx, mask=(idx >= 1) & (idx <= E), other=0)
    raw_end = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0)
    start, end, _, _ = group_tiles(raw_start, raw_end, idx, E, P, 1, True)  # E: the tail
    busy = (end > start).to(tl.int32)  # one "tile" per non-empty segment: slot -> segment
    seg, row0, row_end = find_tile(start, end, busy, tl.cumsum(busy, axis=0), idx, slot, 1)
    if seg == E:  # tail rows [offsets[E], P): zeros
        r = row0
        while r < row_end:
            rows = r + tl.arange(0, BM)
            y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            zero = tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty)
            tl.store(y_ptrs, zero, mask=(rows < row_end)[:, None] & col_in[None, :])
            r += BM
    elif seg < E:  # (slots past the last non-empty segment: nothing)
        ks = tl.arange(0, BK)
        safe_cols = tl.where(col_in, cols, 0)
        g_ptrs = (
            w_ptr
            + seg.to(tl.int64) * stride_we
            + safe_cols.to(tl.int64)[None, :] * stride_wn
            + ks[:, None] * stride_wk
        )  # (BK, BN)
        u_ptrs = g_ptrs + up_offset  # gated: the up rows, H below the gate rows
        r = row0
        while r < row_end:  # BM rows a chunk, in order
            rows = r + tl.arange(0, BM)
            row_in = rows < row_end
            safe_rows = tl.where(row_in, rows, r)  # r < row_end: a row of this group
            src, live = row_sources(ridx_ptr, safe_rows, row_in, T, HAS_RIDX)
            a_ptrs = x_ptr + src[:, None] * stride_xt + ks[None, :] * stride_xk  # (BM, BK)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(NUM_K):  # K in BK steps, in order: the fixed summation order
                a = _load_k(a_ptrs, k * BK, stride_xk, ks, K, 1, EVEN_K)
                g = _load_k(g_ptrs, k * BK, stride_wk, ks, K, 0, EVEN_K)
                acc = dot_acc(a, g, acc, UPCAST, IEEE)
                if ACTIVATION == 2:
                    u = _load_k(u_ptrs, k * BK, stride_wk, ks, K, 0, EVEN_K)
                    acc_u = dot_acc(a, u, acc_u, UPCAST, IEEE)
            if ACTIVATION == 1:
                acc = acc / (1.0 + tl.exp(-acc))  # silu in fp32 (_triton/activation.py's)
            elif ACTIVATION == 2:
                acc = acc / (1.0 + tl.exp(-acc))
                acc = acc * acc_u
            acc = tl.where(live[:, None], acc, 0.0)
            y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])
            r += BM


# --------------------------------------------------------------------------------------------
# Launcher


class GemvConfig(NamedTuple):
    """Launch parameters of one grouped-GEMV launch: ``block_n`` weight rows a program streams
    (gated: half of them gate rows, half up rows, for block_n / 2 outputs, at least 16) in
    ``block_k``-wide K steps, applied to ``block_m`` rows a chunk (>= 16: the MMA's)."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 16


def default_config(k: int) -> GemvConfig:
    """The launch config for a contraction of ``k``: from K alone, never from the rows (batch
    invariance). GPU: 32 weight rows x 128-wide K steps, 4 warps, 4 stages (unmeasured: the H200
    run of ``benchmarks/gpu/decode_gemv_gpu.py --configs`` sets it). Interpreter: 64 x 32, one
    stage (few programs, several K steps)."""
    if INTERPRET:
        return GemvConfig(64, 32, 4, 1)
    return GemvConfig(32, pow2_clamp(k, 16, 128))


_launcher = FastKernel(_grouped_gemv_kernel)  # compiled-handle launches (low host cost)


def num_programs(num_rows: int, n_out: int, num_experts: int, block_n: int) -> int:
    """The static grid: min(P, E + 1) slots (the groups and the tail) x the outputs' n-tiles."""
    return min(num_rows, num_experts + 1) * cdiv(n_out, block_n)


def grouped_gemv(
    x_TD: torch.Tensor,
    w_END: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    activation: str = "none",
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """y_PN (P, N_out) in x's dtype, N_out = N (N / 2 for "swiglu"); as
    ``moe_kernels.grouped_mm.gather_grouped_mm`` (offsets (E+1,) contiguous, row_indices (P,)
    contiguous or None for P = T sorted rows), with ``activation`` in ``ACTIVATIONS``; rows past
    the clamped offsets[E] and rows reading no token are zero. Inputs checked."""
    num_tokens, dim = x_TD.shape
    num_experts, n, _ = w_END.shape
    gated = activation == "swiglu"
    n_out = n // 2 if gated else n
    num_rows = num_tokens if row_indices_P is None else row_indices_P.shape[0]
    y_PN = torch.empty((num_rows, n_out), dtype=x_TD.dtype, device=x_TD.device)
    if num_rows == 0 or n_out == 0:
        return y_PN
    if num_tokens == 0 or dim == 0 or num_experts == 0:
        return y_PN.zero_()  # no A rows / empty K: every row is act(0) = 0
    cfg = config or default_config(dim)
    bn = max(cfg.block_n // 2, 16) if gated else cfg.block_n
    bk = cfg.block_k
    grid = (num_programs(num_rows, n_out, num_experts, bn),)
    args = (
        x_TD,
        w_END,
        offsets_E1,
        row_indices_P if row_indices_P is not None else offsets_E1,
        y_PN,
        num_tokens,
        num_rows,
        n_out,
        dim,
        num_experts,
        x_TD.stride(0),
        x_TD.stride(1),
        w_END.stride(0),
        w_END.stride(1),
        w_END.stride(2),
        n_out * w_END.stride(1),
    )
    constexprs = dict(
        HAS_RIDX=row_indices_P is not None,
        ACTIVATION=ACTIVATIONS[activation],
        BM=cfg.block_m,
        BN=bn,
        BK=bk,
        NUM_K=cdiv(dim, bk),
        EVEN_K=dim % bk == 0,
        BLOCK_E=next_pow2(num_experts + 1),
        UPCAST=INTERPRET,
        IEEE=x_TD.dtype == torch.float32,
    )
    _launcher.launch(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y_PN
