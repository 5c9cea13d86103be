"""Triton FP8 grouped GEMM (e4m3 operands, fp32 accumulation, scaled epilogue) and its launcher.

``y[p] = (x[rows[p]] @ w[e].T) * x_scale[rows[p]] * w_scale[e]`` for the rows p of group e: x
(T, D) and w (E, N, D) float8_e4m3fn, x_scale (T,) fp32 per row; w_scale (E, N) fp32 per output
channel, or with ``BLOCK_SCALES`` (E, ceil(N/128), ceil(D/128)) per 128 x 128 block of w
(DeepSeek-V3's checkpoints), applied to each 128-deep K step's partial sum. Each K step's MMA
sum is added into the fp32 accumulator on its own (on the H100, accumulating the whole K loop in
the fp8 MMA, Triton's sm_90 default, left errors of 5e-3 of the largest output at K = 2048).
The tile walk is the bf16 gathering GEMM's (``grouped_mm.group_tiles`` / ``find_tile``: a static
grid, the offsets clamped on the device, tail rows zero). Nothing here checks arguments:
``moe_kernels.fp8`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET, has_tma
from moe_kernels._gemm_plan import Fp8Config, PersistentConfig, fp8_config
from moe_kernels._triton.blocks import next_pow2
from moe_kernels._triton.grouped_mm import (
    find_tile,
    group_tiles,
    num_programs,
    row_sources,
    tile_pids,
    tma_descriptors,
    zero_tail,
)
from moe_kernels._triton.launch import FastKernel
from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm

SCALE_BLOCK = 128  # the block of w's block scales, both dims


@triton.jit
def e4m3_value(bits):
    """fp32 values of uint8 e4m3fn bits, exactly (every e4m3 value is an fp32 one): normals
    (1 + m / 8) 2^(e - 7), subnormals m 2^-9, NaN for 0x7F / 0xFF; integer arithmetic only (no
    e4m3 type: GPUs before sm_89)."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _k_step(acc, k, a_ptrs, b_ptrs, a_desc, b_desc, a_row, b_row, s_ptr, ks, D, stride_sk,
            BK: tl.constexpr, EVEN_K: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
            BLOCK_SCALES: tl.constexpr, UPCAST: tl.constexpr, FAST_ACCUM: tl.constexpr,
            DECODE: tl.constexpr):  # fmt: skip
    """acc + the K step k of the tile: A (BM, BK) at ``a_ptrs`` or from ``a_desc`` (x) at row
    ``a_row``, B (BK, BN) at ``b_ptrs`` or from ``b_desc`` (w viewed (E*N, D)) at row ``b_row``,
    transposed (columns past D read as zero); with ``BLOCK_SCALES`` the step's partial sum times
    its block scale (BK = 128). ``UPCAST`` (the interpreter): an exact fp32 dot of the fp8
    values. ``FAST_ACCUM`` (per-channel scales only): the step accumulated in the MMA's own
    accumulator (FBGEMM's ``use_fast_accum``). ``DECODE``: x and w come as uint8 bytes, decoded
    to bf16 (exact) for a bf16 MMA (GPUs before sm_89)."""
    k0 = k * BK
    if A_TMA:
        a = a_desc.load([a_row, k0])
    elif EVEN_K:
        a = tl.load(a_ptrs + k0)
    else:
        a = tl.load(a_ptrs + k0, mask=((k0 + ks) < D)[None, :], other=0.0)
    if B_TMA:
        b = b_desc.load([b_row, k0]).T
    elif EVEN_K:
        b = tl.load(b_ptrs + k0)
    else:
        b = tl.load(b_ptrs + k0, mask=((k0 + ks) < D)[:, None], other=0.0)
    if DECODE:
        a = e4m3_value(a)
        b = e4m3_value(b)
        if not UPCAST:
            a = a.to(tl.bfloat16)
            b = b.to(tl.bfloat16)
    elif UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # Each step's sum on its own, then added in fp32: sm_90's fp8 MMA accumulates with fewer
    # mantissa bits than fp32 (Triton's sm_90 default lets it run the whole K loop so), so the
    # step's partial sum is promoted every BK = 128 products (DeepSeek-V3's rule).
    if FAST_ACCUM and not UPCAST:
        return tl.dot(a, b, acc)
    part = tl.dot(a, b, input_precision="ieee") if UPCAST else tl.dot(a, b)
    if BLOCK_SCALES:
        return acc + part * tl.load(s_ptr + k * stride_sk)
    return acc + part


@triton.jit
def _fp8_grouped_mm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, ridx_ptr, y_ptr, a_desc, b_desc, T, P, N, D, E,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    HAS_RIDX: tl.constexpr, BLOCK_SCALES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, UPCAST: tl.constexpr, WHILE_LOOPS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, DECODE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_pids(tl.program_id(0), tl.cdiv(P, BM) + E, tl.cdiv(N, BN), GROUP_M)

    idx = tl.arange(0, BLOCK_E)
    raw_start = tl.load(offs_ptr + idx, mask=(idx >= 1) & (idx <= E), other=0)
    raw_end = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0)
    start, end, tiles, cum = group_tiles(raw_start, raw_end, idx, E, P, BM, True)
    seg, row0, row_end = find_tile(start, end, tiles, cum, idx, pid_m, BM)
    rows = row0 + tl.arange(0, BM)
    row_in = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    col_in = cols < N
    # (the output pointers are formed where they are stored: a (BM, BN) int64 tile held across
    # the K loop took 128 registers a thread and made the sorted 128 x 128 tile spill)
    if seg == E:  # tail rows: zeros
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(y_ptrs, tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty),
                 mask=row_in[:, None] & col_in[None, :])  # fmt: skip
    elif seg < E:
        safe_rows = tl.where(row_in, rows, row0)  # row0 < row_end: a row of this group
        src, live = row_sources(ridx_ptr, safe_rows, row_in, T, HAS_RIDX)
        safe_cols = tl.where(col_in, cols, 0)
        ks = tl.arange(0, BK)
        a_ptrs = x_ptr + src[:, None] * stride_xt + ks[None, :]
        b_ptrs = w_ptr + seg.to(tl.int64) * stride_we + safe_cols.to(tl.int64)[None, :] * stride_wn
        b_ptrs += ks[:, None]
        s_ptr = ws_ptr + seg.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
        b_row = seg * N + pid_n * BN  # w viewed as (E*N, D)
        num_k = tl.cdiv(D, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if WHILE_LOOPS:  # the interpreter: Triton 3.5's cannot range() over a runtime bound
            k = num_k * 0
            while k < num_k:
                acc = _k_step(acc, k, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, s_ptr, ks, D,
                              stride_sk, BK, EVEN_K, A_TMA, B_TMA, BLOCK_SCALES,
                              UPCAST, FAST_ACCUM, DECODE)  # fmt: skip
                k += 1
        else:  # (a for loop: software pipelined by num_stages)
            for k in range(0, num_k):
                acc = _k_step(acc, k, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, s_ptr, ks, D,
                              stride_sk, BK, EVEN_K, A_TMA, B_TMA, BLOCK_SCALES,
                              UPCAST, FAST_ACCUM, DECODE)  # fmt: skip
        acc = acc * tl.load(xs_ptr + src, mask=live, other=0.0)[:, None]
        if not BLOCK_SCALES:
            w_s = tl.load(ws_ptr + seg.to(tl.int64) * stride_se + safe_cols * stride_sn)
            acc = acc * w_s[None, :]
        acc = tl.where(live[:, None], acc, 0.0)
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


_launcher = FastKernel(_fp8_grouped_mm_kernel)


def fp8_grouped_mm(
    x_TD: torch.Tensor,
    x_scale_T: torch.Tensor,
    w_END: torch.Tensor,
    w_scale: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8Config | None = None,
    decode: bool = False,
) -> torch.Tensor:
    """(P, N) in ``out_dtype``; see ``moe_kernels.fp8.fp8_grouped_mm``. Inputs checked; x and w
    contiguous along D. ``decode``: a GPU without e4m3 tensor cores (the GEMM plan's
    "triton_fp8_decoded"): the operands' bytes decoded to bf16 in the kernel, pointer loads."""
    num_tokens, dim = x_TD.shape
    num_experts, n, _ = w_END.shape
    num_rows = num_tokens if row_indices_P is None else row_indices_P.shape[0]
    y_PN = torch.empty((num_rows, n), dtype=out_dtype, device=x_TD.device)
    if num_rows == 0 or n == 0:
        return y_PN
    if num_tokens == 0 or dim == 0 or num_experts == 0:
        return y_PN.zero_()
    block_scales = w_scale.dim() == 3
    cfg = config or fp8_config(num_rows, n, dim, block_scales, row_indices_P is not None)
    if decode or (cfg.tma and not (x_TD.is_cuda and has_tma(x_TD.get_device()))):
        cfg = cfg._replace(tma=False)  # (a GPU without TMA, or decoded bytes: pointer loads)
    if decode:  # (the kernel reads the bytes; no e4m3 type in it)
        x_TD, w_END = x_TD.view(torch.uint8), w_END.view(torch.uint8)
    if cfg.persistent and not block_scales and row_indices_P is None and not decode:
        pcfg = PersistentConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
                                cfg.num_stages, cfg.tma, flatten=not INTERPRET)  # fmt: skip
        y_PN = persistent_grouped_mm(x_TD, w_END, offsets_E1, "nk", pcfg,
                                     (x_scale_T, w_scale.contiguous()), out_dtype)  # fmt: skip
        zero_tail(y_PN, offsets_E1)
        return y_PN
    s_strides = (*w_scale.stride(), 0)[:3]  # (per-channel scales: no K stride)
    grid = (num_programs(num_rows, n, num_experts, cfg),)
    a_desc, b_desc = tma_descriptors(x_TD, w_END, row_indices_P is None, cfg)
    args = (x_TD, x_scale_T, w_END, w_scale, offsets_E1,
            offsets_E1 if row_indices_P is None else row_indices_P, y_PN, a_desc, b_desc,
            num_tokens, num_rows,
            n, dim, num_experts, x_TD.stride(0), w_END.stride(0), w_END.stride(1),
            *s_strides)  # fmt: skip
    constexprs = dict(
        HAS_RIDX=row_indices_P is not None, BLOCK_SCALES=block_scales, BM=cfg.block_m,
        BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        BLOCK_E=next_pow2(num_experts + 1), EVEN_K=dim % cfg.block_k == 0,
        A_TMA=a_desc is not None, B_TMA=b_desc is not None, UPCAST=INTERPRET,
        WHILE_LOOPS=INTERPRET, FAST_ACCUM=cfg.fast_accum and not block_scales, DECODE=decode,
    )  # fmt: skip
    _launcher.launch(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y_PN
