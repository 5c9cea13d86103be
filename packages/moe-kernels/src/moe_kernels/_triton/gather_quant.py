"""Triton kernel of ``gather_scale_quant_dense_tokens`` and its launcher.

Each program takes BLOCK_T output rows i: it reads tok[i], exp[i] and scores[tok[i], exp[i]], then
the gathered row x[tok[i]] (through its strides; 16-byte vectors where the column stride is 1),
forms ``v = fp32(x) * fp32(score)`` and quantises it with ``fp8_rowwise``'s pieces: the whole row
in registers when BLOCK_D >= D, else two passes over BLOCK_D chunks (maxima, then quantise; the
second pass reads the row from L2). Dead rows (token index outside [0, T), expert index outside
[0, E), i >= *valid_token_count) read nothing and are written as zeros, scale included. Index
and row offsets are int64. Nothing here checks arguments: ``moe_kernels.gather_quant`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import e4m3_native
from moe_kernels._triton.blocks import cdiv
from moe_kernels._triton.fp8_rowwise import (
    RowConfig,
    check_config,
    col64,
    col_offsets,
    e4m3_bits,
    num_chunks,
    pick_config,
    row_absmax,
    row_scales,
)
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _gather_tile(x_ptr, tok, score, live, cols, D, stride_xt, stride_xd, COL64: tl.constexpr,
                 EVICT: tl.constexpr):  # fmt: skip
    """fp32 (rows, cols) tile of x[tok] * score; zero where not live or cols >= D."""
    mask = live[:, None] & (cols < D)[None, :]
    ptrs = x_ptr + tok[:, None] * stride_xt + col_offsets(cols, stride_xd, COL64)[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return x * score[:, None]


@triton.jit
def _gather_quant_kernel(
    q_ptr,  # (N, D) uint8: e4m3fn bits, contiguous
    scale_ptr,  # (N,) fp32
    x_ptr,  # (T, D)
    tok_ptr,  # (N,) int32/int64
    exp_ptr,  # (N,) int32/int64
    scores_ptr,  # (T, E)
    ub_ptr,  # (1,) fp32 (HAS_UB only)
    vtc_ptr,  # (1,) int (HAS_VTC only)
    N,
    D,
    T,
    E,
    stride_xt,
    stride_xd,
    stride_st,
    stride_se,
    HAS_UB: tl.constexpr,
    HAS_VTC: tl.constexpr,
    IEEE_DIV: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # 1: the whole row in registers
    COL64: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < N
    live = row_in
    if HAS_VTC:
        live = live & (rows < tl.load(vtc_ptr).to(tl.int64))
    tok = tl.load(tok_ptr + rows, mask=live, other=-1).to(tl.int64)
    exp = tl.load(exp_ptr + rows, mask=live, other=-1).to(tl.int64)
    live = live & (tok >= 0) & (tok < T) & (exp >= 0) & (exp < E)
    score = tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=live, other=0.0)
    score = score.to(tl.float32)

    cols = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + rows[:, None] * D
    if NUM_CHUNKS == 1:
        v = _gather_tile(x_ptr, tok, score, live, cols, D, stride_xt, stride_xd, COL64, "")
        s, inv = row_scales(row_absmax(v), ub_ptr, HAS_UB, IEEE_DIV)
        bits = e4m3_bits(v, s[:, None], NATIVE_CAST)
        tl.store(q_rows + cols[None, :], bits, mask=row_in[:, None] & (cols < D)[None, :])
    else:
        amax = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for c in range(NUM_CHUNKS):  # pass 1: row maxima (the row stays in L2 for pass 2)
            v = _gather_tile(x_ptr, tok, score, live, c * BLOCK_D + cols, D, stride_xt,
                             stride_xd, COL64, "evict_last")  # fmt: skip
            amax = tl.maximum(amax, row_absmax(v))
        s, inv = row_scales(amax, ub_ptr, HAS_UB, IEEE_DIV)
        for c in range(NUM_CHUNKS):  # pass 2: the same products again, quantised
            cc = c * BLOCK_D + cols
            v = _gather_tile(x_ptr, tok, score, live, cc, D, stride_xt, stride_xd, COL64,
                             "evict_first")  # fmt: skip
            bits = e4m3_bits(v, s[:, None], NATIVE_CAST)
            tl.store(q_rows + cc[None, :], bits, mask=row_in[:, None] & (cc < D)[None, :])
    tl.store(scale_ptr + rows, tl.where(live, inv, 0.0), mask=row_in)


_gather_quant = FastKernel(_gather_quant_kernel)


def gather_scale_quant(
    x_TD: torch.Tensor,
    token_indices_N: torch.Tensor,
    expert_indices_N: torch.Tensor,
    scores_TE: torch.Tensor,
    scale_ub: torch.Tensor | None,
    valid_token_count: torch.Tensor | None,
    *,
    config: RowConfig | None = None,
    ieee_div: bool = False,
    native_cast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, D) float8_e4m3fn, scale (N,) fp32) of x[tok] * scores[tok, exp], dead rows zero.
    ``config`` overrides the launch shape (``pick_config("gather", N, D)``); ``ieee_div=True``
    divides with IEEE division (the reference's; default: FBGEMM's ``div.full.f32`` on the GPU);
    ``native_cast`` (default: on GPUs with the e4m3 type, sm_89+) picks the hardware e4m3 cast over
    the integer rounding.
    Index tensors must be contiguous."""
    num_tokens, dim = x_TD.shape
    num_rows = token_indices_N.shape[0]
    q = torch.empty((num_rows, dim), dtype=torch.uint8, device=x_TD.device)
    scale = torch.empty((num_rows,), dtype=torch.float32, device=x_TD.device)
    if num_rows > 0:
        cfg = pick_config("gather", num_rows, dim) if config is None else check_config(config)
        args = (
            q,
            scale,
            x_TD,
            token_indices_N,
            expert_indices_N,
            scores_TE,
            x_TD if scale_ub is None else scale_ub,
            token_indices_N if valid_token_count is None else valid_token_count,
            num_rows,
            dim,
            num_tokens,
            scores_TE.shape[1],
            *x_TD.stride(),
            *scores_TE.stride(),
        )
        consts = dict(
            HAS_UB=scale_ub is not None,
            HAS_VTC=valid_token_count is not None,
            IEEE_DIV=ieee_div,
            NATIVE_CAST=e4m3_native(x_TD.device) if native_cast is None else native_cast,
            BLOCK_T=cfg.block_t,
            BLOCK_D=cfg.block_d,
            NUM_CHUNKS=num_chunks(dim, cfg.block_d),
            COL64=col64(dim, x_TD.stride(1)),
        )
        _gather_quant.launch((cdiv(num_rows, cfg.block_t),), args, consts,
                             num_warps=cfg.num_warps)  # fmt: skip
    return q.view(torch.float8_e4m3fn), scale
