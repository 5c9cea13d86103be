"""Triton kernels for the MXFP8 casts (row-wise, column-wise) and the dequantisation, with their
launchers. No argument checks here (``moe_kernels.mxfp8`` does them).

Scales are computed with integer bit math (exact everywhere). The fp32 -> e4m3 rounding uses the
hardware cast on the GPU (``cvt.rn.satfinite``) and, under the interpreter (whose float8 cast is off
near powers of two), an integer round-to-nearest-even: both are bit-exact to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import INTERPRET

_MX_BLOCK = 32


@triton.jit
def _e4m3_bits_rne(q):
    """uint8-valued int32 e4m3fn bits of fp32 ``q`` (|q| <= 448, not NaN), round to nearest even."""
    qb = q.to(tl.int32, bitcast=True)
    sign = (qb >> 24) & 0x80
    a = qb & 0x7FFFFFFF
    # normal e4m3 (|q| >= 2**-6): drop 20 mantissa bits with RNE, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # subnormal e4m3: round(|q| * 2**9) to nearest even, 8 -> 0x08 is the smallest normal
    eb = a >> 23
    m = (a & 0x7FFFFF) | tl.where(eb > 0, 0x800000, 0)
    s = tl.minimum(tl.maximum(141 - eb, 1), 25)
    sub = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s
    return sign | tl.where(eb >= 121, normal, sub)


@triton.jit
def _quantize_blocks(x, AXIS: tl.constexpr, FLOOR: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """MX-quantise fp32 ``x`` in blocks along ``AXIS`` (of size 32).

    Returns (data bits as uint8, same shape as x; biased e8m0 scale bytes as uint8, x reduced
    along AXIS)."""
    bits = x.to(tl.int32, bitcast=True)
    amax = tl.max(bits & 0x7FFFFFFF, axis=AXIS)  # int max: NaN > inf > finite
    biased = amax >> 23
    e = biased - 135
    if not FLOOR:
        e += ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(biased == 0, -127, e)
    e = tl.where(amax == 0x7F800000, 127, e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    is_nan = amax > 0x7F800000
    inv = tl.where(e == 127, 0x00400000, (127 - e) << 23).to(tl.float32, bitcast=True)
    q = x * tl.expand_dims(inv, AXIS)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if NATIVE_CAST:
        qbits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        qbits = _e4m3_bits_rne(q)
    qbits = tl.where(tl.expand_dims(is_nan, AXIS), 0x7F, qbits)
    scale = tl.where(is_nan, 255, e + 127)
    return qbits.to(tl.uint8), scale.to(tl.uint8)


@triton.jit
def _mxfp8_dim0_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    FLOOR: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
    q, s = _quantize_blocks(x3, 2, FLOOR, NATIVE_CAST)
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], tl.reshape(q, (BLOCK_M, BLOCK_K)), mask)
    KB = K // 32
    scols = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    smask = (rows[:, None] < M) & (scols[None, :] < KB)
    tl.store(scale_ptr + rows[:, None] * KB + scols[None, :], s, smask)


@triton.jit
def _mxfp8_dim1_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    M,
    K,
    stride_xb,
    stride_xm,
    FLOOR: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x (B, M, K) -> data (B, K, M), scale (B, K, M // 32): blocks of 32 down the rows.

    The tile is loaded already transposed, (BLOCK_K, BLOCK_M) (memory-contiguous along dim 0), so
    the reduction and the store work in the output's orientation. On an H200 this beat a 3-D
    reshape of a row-major tile (1.6x slower) and a loop over 32-row blocks (1.07x slower): see
    commit 1995de9 for both."""
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (cols[:, None] < K) & (rows[None, :] < M)
    x_ptrs = x_ptr + b * stride_xb + rows[None, :].to(tl.int64) * stride_xm + cols[:, None]
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    x3 = tl.reshape(x.to(tl.float32), (BLOCK_K, BLOCK_M // 32, 32))
    q, s = _quantize_blocks(x3, 2, FLOOR, NATIVE_CAST)
    d_ptrs = data_ptr + b * K * M + cols[:, None].to(tl.int64) * M + rows[None, :]
    tl.store(d_ptrs, tl.reshape(q, (BLOCK_K, BLOCK_M)), mask)
    MB = M // 32
    srows = tl.program_id(0) * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
    s_ptrs = scale_ptr + b * K * MB + cols[:, None].to(tl.int64) * MB + srows[None, :]
    tl.store(s_ptrs, s, (cols[:, None] < K) & (srows[None, :] < MB))


@triton.jit
def _mxfp8_dequant_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    d = tl.load(data_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
    E = (d >> 3) & 15
    m = d & 7
    mag = tl.where(
        E == 0,
        m.to(tl.float32) * (1.0 / 512.0),
        (((E + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True),
    )
    mag = tl.where((d & 0x7F) == 0x7F, float("nan"), mag)
    val = tl.where((d & 0x80) != 0, -mag, mag)
    KB = K // 32
    scols = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    smask = (rows[:, None] < M) & (scols[None, :] < KB)
    sb = tl.load(scale_ptr + rows[:, None] * KB + scols[None, :], mask=smask, other=127)
    sb = sb.to(tl.int32)
    sbits = tl.where(sb == 0, 0x00400000, sb << 23)
    sbits = tl.where(sb == 255, 0x7FC00000, sbits)
    sf = sbits.to(tl.float32, bitcast=True)
    out = tl.reshape(val, (BLOCK_M, BLOCK_K // 32, 32)) * sf[:, :, None]
    out = tl.reshape(out, (BLOCK_M, BLOCK_K))
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], out.to(out_ptr.dtype.element_ty), mask)


def _pow2_at_most(n: int, cap: int) -> int:
    return max(1, min(cap, triton.next_power_of_2(max(n, 1))))


def _tile(M: int, K: int, block_m: int | None, block_k: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps): ~8K-element tiles on the GPU; one big tile per few hundred
    rows under the interpreter (each program instance costs ~0.4 ms there)."""
    if INTERPRET:
        bk = block_k or _pow2_at_most(K, 512)
        bm = block_m or _pow2_at_most(M, max(32, 16384 // bk))
        return bm, bk, 4
    # H200: 16 x 512 tiles ran at 90-93% of the copy ceiling, 32 x 128 at 86-75%
    bk = block_k or _pow2_at_most(K, 512)
    bm = block_m or _pow2_at_most(M, max(16, 8192 // bk))
    return bm, bk, 8 if bm * bk >= 8192 else 4


def to_mxfp8(
    x_MK: torch.Tensor,
    floor: bool,
    *,
    native_cast: bool | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise cast: (M, K) -> data (M, K) e4m3fn, scale (M, K // 32) e8m0fnu."""
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x_MK.device)
    scale = torch.empty((M, K // _MX_BLOCK), dtype=torch.float8_e8m0fnu, device=x_MK.device)
    if M == 0 or K == 0:
        return data, scale
    bm, bk, warps = _tile(M, K, block_m, block_k)
    native = (not INTERPRET) if native_cast is None else native_cast
    grid = (triton.cdiv(M, bm), triton.cdiv(K, bk))
    _mxfp8_dim0_kernel[grid](
        x_MK,
        data.view(torch.uint8),
        scale.view(torch.uint8),
        M,
        K,
        x_MK.stride(0),
        FLOOR=floor,
        NATIVE_CAST=native,
        BLOCK_M=bm,
        BLOCK_K=bk,
        num_warps=warps,
    )
    return data, scale


def to_mxfp8_dim1(
    x_BMK: torch.Tensor,
    floor: bool,
    *,
    native_cast: bool | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise cast of (M, K) or (B, M, K): data (.., K, M) e4m3fn, scale (.., K, M // 32)."""
    squeeze = x_BMK.dim() == 2
    x = x_BMK.unsqueeze(0) if squeeze else x_BMK
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, M, K = x.shape
    data = torch.empty((B, K, M), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((B, K, M // _MX_BLOCK), dtype=torch.float8_e8m0fnu, device=x.device)
    if B * M * K > 0:
        if INTERPRET:
            bm = block_m or _pow2_at_most(M, 256)
            bk = block_k or _pow2_at_most(K, max(16, 16384 // bm))
            warps = 4
        else:
            # H200 (16384 x 8192 bf16): 32 x 128 took 2.3x the copy ceiling's time, 64 x 64
            # 2.4x, 128 x 32 3.4x, 64 x 128 3.7x, 128 x 64 5.1x
            bm = block_m or _pow2_at_most(M, 32)
            bk = block_k or _pow2_at_most(K, 128)
            warps = 8 if bm * bk >= 8192 else 4
        bm = max(bm, 32)
        native = (not INTERPRET) if native_cast is None else native_cast
        grid = (triton.cdiv(M, bm), triton.cdiv(K, bk), B)
        _mxfp8_dim1_kernel[grid](
            x,
            data.view(torch.uint8),
            scale.view(torch.uint8),
            M,
            K,
            x.stride(0),
            x.stride(1),
            FLOOR=floor,
            NATIVE_CAST=native,
            BLOCK_M=bm,
            BLOCK_K=bk,
            num_warps=warps,
        )
    if squeeze:
        return data[0], scale[0]
    return data, scale


def from_mxfp8(
    data_MK: torch.Tensor,
    scale_MB: torch.Tensor,
    dtype: torch.dtype,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Dequantise (M, K) e4m3fn data with (M, K // 32) e8m0 scales into ``dtype``."""
    data_MK = data_MK.contiguous()
    scale_MB = scale_MB.contiguous()
    M, K = data_MK.shape
    out = torch.empty((M, K), dtype=dtype, device=data_MK.device)
    if M * K == 0:
        return out
    bm, bk, warps = _tile(M, K, block_m, block_k)
    grid = (triton.cdiv(M, bm), triton.cdiv(K, bk))
    _mxfp8_dequant_kernel[grid](
        data_MK.view(torch.uint8),
        scale_MB.view(torch.uint8),
        out,
        M,
        K,
        BLOCK_M=bm,
        BLOCK_K=bk,
        num_warps=warps,
    )
    return out
