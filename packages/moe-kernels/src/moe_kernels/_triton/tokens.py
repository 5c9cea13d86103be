"""Triton kernels for token movement (gather / dispatch, scatter-add, combine) and their launchers.

Every kernel moves D-long rows: one program per (block of BLOCK_N rows, chunk of BLOCK_D columns),
16-byte vector accesses along D, masks for odd D, int64 row offsets (column offsets are int32:
a column stride times D must stay below 2**31). The launchers pick the block shape and warps
from the kernel, D and the row count. Nothing here checks arguments: the
public module ``moe_kernels.tokens`` does that before any launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel

# Gather scale modes: plain copy, times a per-row weight, times scores[token, expert].
SCALE_NONE, SCALE_ROW, SCALE_SCORES = 0, 1, 2

# WHILE_LOOPS (True only under the interpreter): triton 3.5's interpreter cannot ``range()`` over a
# runtime scalar (it holds scalars as 1-element arrays), so the loops there are ``while`` loops;
# the GPU compiles the ``for`` loops.


@triton.jit
def _gather_rows_kernel(
    x_ptr,  # (T, D)
    out_ptr,  # (N, D), contiguous
    tok_ptr,  # (N,) int32/int64
    exp_ptr,  # (N,) int32/int64 (SCALE_SCORES only)
    scale_ptr,  # (N,) float (SCALE_ROW) or (T, E) float (SCALE_SCORES)
    vtc_ptr,  # (1,) int: rows >= *vtc_ptr are zero (HAS_VTC only)
    N,
    D,
    T,
    E,
    stride_xt,
    stride_xd,
    stride_st,
    stride_se,
    SCALE_MODE: tl.constexpr,
    HAS_VTC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    tok = tl.load(tok_ptr + rows, mask=row_in, other=-1).to(tl.int64)
    live = row_in & (tok >= 0) & (tok < T)
    if HAS_VTC:
        live = live & (rows < tl.load(vtc_ptr).to(tl.int64))
    if SCALE_MODE == 2:
        exp = tl.load(exp_ptr + rows, mask=live, other=-1).to(tl.int64)
        live = live & (exp >= 0) & (exp < E)
        scale = tl.load(scale_ptr + tok * stride_st + exp * stride_se, mask=live, other=0.0)
        scale = scale.to(tl.float32)
    elif SCALE_MODE == 1:
        scale = tl.load(scale_ptr + rows, mask=live, other=0.0).to(tl.float32)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < D
    src = x_ptr + tok[:, None] * stride_xt + cols[None, :] * stride_xd
    vals = tl.load(src, mask=live[:, None] & col_in[None, :], other=0.0)
    if SCALE_MODE != 0:
        vals = (vals.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty)
    dst = out_ptr + rows[:, None] * D + cols[None, :]
    tl.store(dst, vals, mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _scatter_step(
    acc,
    r,
    count,
    start,
    src_ptr,
    in_ptr,
    cols,
    col_in,
    stride_in,
    stride_id,
    OUT_DTYPE: tl.constexpr,
    INT_ADD: tl.constexpr,
):
    """Add each row's r-th source (if it has one) to acc, rounding to OUT_DTYPE (INT_ADD: acc is
    in OUT_DTYPE, an integer type, and the add is exact)."""
    has = count > r
    src = tl.load(src_ptr + start + r, mask=has, other=0).to(tl.int64)
    ptrs = in_ptr + src[:, None] * stride_in + cols[None, :] * stride_id
    if INT_ADD:  # masked lanes add 0
        total = acc + tl.load(ptrs, mask=has[:, None] & col_in[None, :], other=0).to(OUT_DTYPE)
    else:
        v = tl.load(ptrs, mask=has[:, None] & col_in[None, :], other=0.0).to(tl.float32)
        # Round to out's dtype after every add: the sequential in-order sum in out's dtype.
        total = tl.where(has[:, None], (acc + v).to(OUT_DTYPE).to(tl.float32), acc)
    return total  # one return: both branches of a constexpr test are type-checked


@triton.jit
def _combine_step(
    acc,
    j,
    rows,
    row_in,
    cols,
    col_in,
    inv_ptr,
    y_ptr,
    w_ptr,
    N,
    stride_yn,
    stride_yd,
    stride_it,
    stride_ik,
    WEIGHTED: tl.constexpr,
    EXACT_MUL: tl.constexpr,
):
    """acc + (weights[p] *) y[p] for p = inverse[row, j]; unrouted entries add +0.0. The product
    is rounded before the add: with ``EXACT_MUL`` (GPU) through ``mul.rn.f32``, which the
    compiler never contracts into a fused multiply-add (whatever the launch's fp-fusion
    setting, so Inductor's launches of this kernel give the same bits as ours)."""
    pos = tl.load(inv_ptr + rows * stride_it + j * stride_ik, mask=row_in, other=-1)
    pos = pos.to(tl.int64)
    ok = row_in & (pos >= 0) & (pos < N)
    v = tl.load(
        y_ptr + pos[:, None] * stride_yn + cols[None, :] * stride_yd,
        mask=ok[:, None] & col_in[None, :],
        other=0.0,
    ).to(tl.float32)
    if WEIGHTED:
        w = tl.load(w_ptr + pos, mask=ok, other=0.0).to(tl.float32)
        if EXACT_MUL:
            v = tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=f,f,f", [w[:, None], v], dtype=tl.float32,
                is_pure=True, pack=1,
            )  # fmt: skip
        else:
            v = w[:, None] * v
    # Unrouted entries load as +0.0, and acc + 0.0 == acc bit for bit (acc starts at +0.0 and
    # round-to-nearest never produces -0.0 from a sum with a +0.0 start): same as skipping.
    return acc + v


@triton.jit
def _scatter_add_kernel(
    out_ptr,  # (T, D), updated in place
    in_ptr,  # (N, D)
    src_ptr,  # (N,) int: sources ordered by (destination row, ascending i)
    bounds_ptr,  # (T+1,) int: row t's sources are src[bounds[t] : bounds[t+1]]
    T,
    D,
    stride_ot,
    stride_od,
    stride_in,
    stride_id,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
    INT_ADD: tl.constexpr,  # out (and in) are integers: exact adds in out's dtype
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < T
    start = tl.load(bounds_ptr + rows, mask=row_in, other=0).to(tl.int64)
    count = tl.load(bounds_ptr + rows + 1, mask=row_in, other=0).to(tl.int64) - start
    longest = tl.max(count, axis=0)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < D
    touched = (count > 0)[:, None] & col_in[None, :]
    dst = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_od
    if INT_ADD:
        acc = tl.load(dst, mask=touched, other=0)
    else:
        acc = tl.load(dst, mask=touched, other=0.0).to(tl.float32)
    if WHILE_LOOPS:
        r = longest * 0
        while r < longest:
            acc = _scatter_step(
                acc,
                r,
                count,
                start,
                src_ptr,
                in_ptr,
                cols,
                col_in,
                stride_in,
                stride_id,
                out_ptr.dtype.element_ty,
                INT_ADD,
            )
            r += 1
    else:
        for r in range(0, longest):
            acc = _scatter_step(
                acc,
                r,
                count,
                start,
                src_ptr,
                in_ptr,
                cols,
                col_in,
                stride_in,
                stride_id,
                out_ptr.dtype.element_ty,
                INT_ADD,
            )
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=touched)


@triton.jit
def _combine_kernel(
    y_ptr,  # (N, D)
    w_ptr,  # (N,) float32 (WEIGHTED only)
    inv_ptr,  # (T, K) int: sorted position of token t's j-th choice, -1 when not routed
    out_ptr,  # (T, D), contiguous
    T,
    K,
    N,
    D,
    stride_yn,
    stride_yd,
    stride_it,
    stride_ik,
    WEIGHTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
    EXACT_MUL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < T
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if WHILE_LOOPS:
        j = K * 0
        while j < K:
            acc = _combine_step(
                acc,
                j,
                rows,
                row_in,
                cols,
                col_in,
                inv_ptr,
                y_ptr,
                w_ptr,
                N,
                stride_yn,
                stride_yd,
                stride_it,
                stride_ik,
                WEIGHTED,
                EXACT_MUL,
            )
            j += 1
    else:
        for j in range(0, K):
            acc = _combine_step(
                acc,
                j,
                rows,
                row_in,
                cols,
                col_in,
                inv_ptr,
                y_ptr,
                w_ptr,
                N,
                stride_yn,
                stride_yd,
                stride_it,
                stride_ik,
                WEIGHTED,
                EXACT_MUL,
            )
    dst = out_ptr + rows[:, None] * D + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


# --------------------------------------------------------------------------------------------
# Launchers


# (max BLOCK_D, elements per program) per kernel, from sweeps on an H200 at T=65536, k=8,
# D=2048 bf16 (gather: 8 rows x 256 columns best, 902 us vs 980 us for 4 x 512 and 1064 us for
# 1 x 1024, a clone of the same bytes 1004 us; combine / scatter: one 1024-column chunk of one
# row per program best, 570 / 753 us; more rows per program made them slower).
_GPU_SHAPES = {"gather": (256, 2048), "combine": (1024, 1024), "scatter": (1024, 1024)}
_INTERPRET_SHAPE = (4096, 16384)  # numpy: slow per program, fast per element


_gather_rows = FastKernel(_gather_rows_kernel)
_scatter_add = FastKernel(_scatter_add_kernel)
_combine = FastKernel(_combine_kernel)


def pick_config(kind: str, num_rows: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D, num_warps) for ``kind`` moving ``num_rows`` rows of ``dim`` elements.

    BLOCK_D is the next power of two of D up to a cap (at least 16: 16-byte vectors for bf16
    need 8); small D packs several rows per program up to a tile size.
    """
    block_d_max, tile_elems = _INTERPRET_SHAPE if INTERPRET else _GPU_SHAPES[kind]
    block_d = min(max(next_pow2(max(dim, 1)), 16), block_d_max)
    row_cap = min(64, next_pow2(max(num_rows, 1)))
    block_n = max(1, min(tile_elems // block_d, row_cap))
    num_warps = 4 if block_n * block_d >= 1024 else 2
    return block_n, block_d, num_warps


def gather_rows(
    x_TD: torch.Tensor,
    token_indices_N: torch.Tensor,
    *,
    mode: int,
    scale: torch.Tensor | None,
    expert_indices_N: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """(N, D) in x's dtype: row i = x[tok[i]] (scaled per ``mode``), zero where dead."""
    num_tokens, dim = x_TD.shape
    num_rows = token_indices_N.shape[0]
    out_ND = torch.empty((num_rows, dim), dtype=x_TD.dtype, device=x_TD.device)
    if num_rows == 0 or dim == 0:
        return out_ND
    if num_tokens == 0:  # every row is dead
        return out_ND.zero_()
    block_n, block_d, num_warps = config or pick_config("gather", num_rows, dim)
    num_experts = scale.shape[1] if mode == SCALE_SCORES else 0
    stride_st, stride_se = scale.stride() if mode == SCALE_SCORES else (0, 0)
    grid = (cdiv(num_rows, block_n), cdiv(dim, block_d))
    _gather_rows.launch(
        grid,
        (
            x_TD,
            out_ND,
            token_indices_N,
            expert_indices_N if expert_indices_N is not None else token_indices_N,
            scale if scale is not None else x_TD,
            valid_token_count if valid_token_count is not None else token_indices_N,
            num_rows,
            dim,
            num_tokens,
            num_experts,
            x_TD.stride(0),
            x_TD.stride(1),
            stride_st,
            stride_se,
        ),
        dict(
            SCALE_MODE=mode,
            HAS_VTC=valid_token_count is not None,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
        ),
        num_warps=num_warps,
    )
    return out_ND


def scatter_add_sorted(
    out_TD: torch.Tensor,
    in_ND: torch.Tensor,
    src_N: torch.Tensor,
    bounds_T1: torch.Tensor,
    config: tuple[int, int, int] | None = None,
) -> None:
    """out[t] += in[src[b]] for b in bounds[t]..bounds[t+1]-1, in that order, rounding to out's
    dtype after each add (exact for integer out and in)."""
    num_tokens, dim = out_TD.shape
    if num_tokens == 0 or dim == 0 or in_ND.shape[0] == 0:
        return
    block_n, block_d, num_warps = config or pick_config("scatter", num_tokens, dim)
    grid = (cdiv(num_tokens, block_n), cdiv(dim, block_d))
    _scatter_add.launch(
        grid,
        (
            out_TD,
            in_ND,
            src_N,
            bounds_T1,
            num_tokens,
            dim,
            out_TD.stride(0),
            out_TD.stride(1),
            in_ND.stride(0),
            in_ND.stride(1),
        ),
        dict(
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            WHILE_LOOPS=INTERPRET,
            INT_ADD=not out_TD.dtype.is_floating_point,
        ),
        num_warps=num_warps,
    )


def combine(
    y_ND: torch.Tensor,
    inverse_TK: torch.Tensor,
    weights_N: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """(T, D) out_dtype: sum_j weights[inverse[t, j]] * y[inverse[t, j]] in fp32, j order."""
    num_rows, dim = y_ND.shape
    num_tokens, top_k = inverse_TK.shape
    out_TD = torch.empty((num_tokens, dim), dtype=out_dtype, device=y_ND.device)
    if num_tokens == 0 or dim == 0:
        return out_TD
    if num_rows == 0:  # nothing routed
        return out_TD.zero_()
    block_n, block_d, num_warps = config or pick_config("combine", num_tokens, dim)
    grid = (cdiv(num_tokens, block_n), cdiv(dim, block_d))
    _combine.launch(
        grid,
        (
            y_ND,
            weights_N if weights_N is not None else y_ND,
            inverse_TK,
            out_TD,
            num_tokens,
            top_k,
            num_rows,
            dim,
            y_ND.stride(0),
            y_ND.stride(1),
            inverse_TK.stride(0),
            inverse_TK.stride(1),
        ),
        dict(
            WEIGHTED=weights_N is not None,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            WHILE_LOOPS=INTERPRET,
            EXACT_MUL=not INTERPRET,  # numpy rounds the product itself
        ),
        num_warps=num_warps,
    )
    return out_TD
