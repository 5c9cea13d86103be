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

from .._dispatch import INTERPRET, e4m3_native
from .blocks import cdiv, next_pow2
from .launch import launch

_MX_BLOCK = 32


@triton.jit
def e4m3_bits_rne(q):
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
def _mx_exponent(amax, FLOOR: tl.constexpr):
    """Block scale from int32 ``|x|`` bit maxima (NaN > inf > finite as integers).

    Returns (unbiased exponent e in [-127, 127] as int32, invalid): ``invalid`` marks a block
    holding an inf or a NaN (its e is meaningless: the callers write NaN bytes instead)."""
    biased = amax >> 23
    e = biased - 135
    if not FLOOR:
        e += ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(biased == 0, -127, e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return e, amax >= 0x7F800000


@triton.jit
def _mx_encode_raw(x, e, NATIVE_CAST: tl.constexpr, CLAMP: tl.constexpr = True):
    """e4m3 bits (int32) of fp32 ``x / 2**e`` (``e`` broadcasts against ``x``), inf / NaN blocks
    not handled. ``CLAMP=False`` leaves the saturation to the hardware cast (``cvt.rn.satfinite``,
    which clamps out-of-range and infinite values to +-448); only with ``NATIVE_CAST``."""
    inv = tl.where(e == 127, 0x00400000, (127 - e) << 23).to(tl.float32, bitcast=True)
    q = x * inv
    if CLAMP or not NATIVE_CAST:
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if NATIVE_CAST:
        qbits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        qbits = e4m3_bits_rne(q)
    return qbits


@triton.jit
def _mx_encode(x, e, invalid, NATIVE_CAST: tl.constexpr):
    """e4m3 bits (int32) of fp32 ``x / 2**e``, 0x7F (NaN) where ``invalid``; ``e`` and
    ``invalid`` broadcast against ``x``."""
    return tl.where(invalid, 0x7F, _mx_encode_raw(x, e, NATIVE_CAST))


@triton.jit
def _quantize_blocks(x, AXIS: tl.constexpr, FLOOR: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """MX-quantise fp32 ``x`` in blocks along ``AXIS`` (of size 32).

    Returns (data bits as uint8, same shape as x; biased e8m0 scale bytes as uint8, x reduced
    along AXIS)."""
    bits = x.to(tl.int32, bitcast=True)
    amax = tl.max(bits & 0x7FFFFFFF, axis=AXIS)  # int max: NaN > inf > finite
    e, invalid = _mx_exponent(amax, FLOOR)
    qbits = _mx_encode(x, tl.expand_dims(e, AXIS), tl.expand_dims(invalid, AXIS), NATIVE_CAST)
    scale = tl.where(invalid, 255, e + 127)
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
def _bit_or(a, b):
    return a | b


@triton.jit
def _pack_e4m3x4(b0, b1, b2, b3):
    """int32 word of the saturated RNE e4m3 bytes of 4 fp32 values (given as int32 bits), b0 in
    the low byte. GPU (sm_89+) only: inline PTX."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r",
        [b0, b1, b2, b3],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mxfp8_dim1_regs_kernel(
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
    RPT: tl.constexpr,
    KV: tl.constexpr,
    VW: tl.constexpr,
    K_FAST: tl.constexpr,
    MASKED: tl.constexpr,
    OFFS64: tl.constexpr,
    SAT_CAST: tl.constexpr,
    ASM_PACK: tl.constexpr,
):
    """x (B, M, K) -> data (B, K, M // 4) int32 (4 e4m3 bytes each), scale (B, K, M // 32).

    Needs M % 32 == 0. Each thread owns RPT consecutive rows ("a group") of KV adjacent columns:
    it loads them KV-wide, takes the block amax in registers (32 // RPT lanes share a block of 32
    rows: a log2(32 // RPT)-step lane reduction), and packs its RPT output bytes per column
    (contiguous along M in data) into int32 words stored VW words at a time, so the data never
    goes through shared memory.

    Layout control: the load and the store are 2-D, (cells, KV) and (cells, VW), whose dim 1 is
    the only contiguous one and whose dim 0 enumerates (column group kl, row group g, register
    index) from its lowest bits up, through index arithmetic Triton sees no contiguity in. Triton
    then puts the low bits on lanes and warps and the high ones in registers; the launcher's
    default num_warps gives exactly (BLOCK_K // KV) * (BLOCK_M // RPT) threads, so the register
    bits are the rows (load) and the words (store), and every reshape/permute in between is free.

    Instruction diet (sm_90 SASS: the "tload" kernel spends ~37 instructions per element, enough
    to be issue-bound at the copy ceiling; this one 12-16): 64-bit tile bases, 32-bit offsets inside
    the tile (unless OFFS64), no masks when the tiles divide the shape (MASKED=False), the
    invalid-block (inf/NaN) select on packed words, and with SAT_CAST no clamp before the
    saturating hardware cast; with ASM_PACK (GPU only) two ``cvt.rn.satfinite.e4m3x2.f32`` and one
    ``mov.b32`` turn 4 fp32 values straight into a word instead of unpacking the bytes and shifting
    them back together."""
    S: tl.constexpr = BLOCK_M // RPT  # row groups
    NB: tl.constexpr = BLOCK_M // 32  # blocks of 32 rows
    LM: tl.constexpr = 32 // RPT  # row groups per block
    KL: tl.constexpr = BLOCK_K // KV  # column groups
    WPT: tl.constexpr = RPT // 4  # int32 words per thread and column
    HH: tl.constexpr = WPT // VW
    b = tl.program_id(2).to(tl.int64)
    if K_FAST:
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    k0 = pid_k * BLOCK_K
    MW = M // 4
    j = tl.arange(0, KV)[None, :]
    # load: cell i = (r * S + g) * KL + kl; row (in the tile) g * RPT + r, column kl * KV + j
    i = tl.max_contiguous(tl.arange(0, RPT * S * KL), 1)
    row = (((i // KL) % S) * RPT + i // (KL * S))[:, None]
    col = ((i % KL) * KV)[:, None] + j
    x_tile = x_ptr + b * stride_xb + m0.to(tl.int64) * stride_xm + k0
    if OFFS64:
        x_ptrs = x_tile + row.to(tl.int64) * stride_xm + col
    else:
        x_ptrs = x_tile + (row * stride_xm + col)
    if MASKED:
        x = tl.load(x_ptrs, mask=(m0 + row < M) & (k0 + col < K), other=0.0)
    else:
        x = tl.load(x_ptrs)
    x = tl.reshape(x.to(tl.float32), (RPT, S, KL, KV))
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)  # (S, KL, KV)
    amax = tl.max(tl.reshape(amax, (NB, LM, KL, KV)), axis=1)  # (NB, KL, KV)
    e, invalid = _mx_exponent(amax, FLOOR)
    e_g = tl.reshape(tl.broadcast_to(e[:, None, :, :], (NB, LM, KL, KV)), (S, KL, KV))
    bad_g = tl.reshape(tl.broadcast_to(invalid[:, None, :, :], (NB, LM, KL, KV)), (S, KL, KV))
    # row r = (hh * VW + v) * 4 + byte: byte `byte` of word v of vector hh (little-endian)
    if ASM_PACK:
        inv = tl.where(e_g == 127, 0x00400000, (127 - e_g) << 23).to(tl.float32, bitcast=True)
        qf = (x * inv[None]).to(tl.int32, bitcast=True)  # (RPT, S, KL, KV) fp32 bits
        qf = tl.permute(tl.reshape(qf, (HH, VW, 4, S, KL, KV)), (0, 1, 3, 4, 5, 2))
        even, odd = tl.split(tl.reshape(qf, (HH, VW, S, KL, KV, 2, 2)))  # bytes 0/2, 1/3
        b0, b2 = tl.split(even)
        b1, b3 = tl.split(odd)
        words = _pack_e4m3x4(b0, b1, b2, b3)  # (HH, VW, S, KL, KV)
    else:
        q = _mx_encode_raw(x, e_g[None], NATIVE_CAST, not SAT_CAST)  # (RPT, S, KL, KV)
        q = tl.reshape(q, (HH, VW, 4, S, KL, KV))
        shift = (tl.arange(0, 4) * 8)[None, None, :, None, None, None]
        words = tl.reduce(q << shift, 2, _bit_or)  # (HH, VW, S, KL, KV)
    words = tl.where(bad_g[None, None], 0x7F7F7F7F, words)  # an inf/NaN block: all bytes 0x7F
    words = tl.reshape(tl.permute(words, (4, 0, 2, 3, 1)), (KV * HH * S * KL, VW))
    # store: cell c = ((j * HH + hh) * S + g) * KL + kl; word (g * WPT + hh * VW + v) of column
    # kl * KV + j, in the tile
    c = tl.max_contiguous(tl.arange(0, KV * HH * S * KL), 1)
    kcol = ((c % KL) * KV + c // (KL * S * HH))[:, None]
    wcol = (((c // KL) % S) * WPT + ((c // (KL * S)) % HH) * VW)[:, None]
    wcol = wcol + tl.arange(0, VW)[None, :]
    d_tile = data_ptr + b * K * MW + k0.to(tl.int64) * MW + pid_m * (S * WPT)
    if OFFS64:
        d_ptrs = d_tile + kcol.to(tl.int64) * MW + wcol
    else:
        d_ptrs = d_tile + (kcol * MW + wcol)
    if MASKED:
        tl.store(d_ptrs, words, (k0 + kcol < K) & (pid_m * (S * WPT) + wcol < MW))
    else:
        tl.store(d_ptrs, words)
    MB = M // 32
    scale = tl.where(invalid, 255, e + 127).to(tl.uint8)  # (NB, KL, KV)
    kk = k0 + tl.arange(0, KL)[None, :, None] * KV + tl.arange(0, KV)[None, None, :]
    nb = pid_m * NB + tl.arange(0, NB)[:, None, None]
    s_ptrs = scale_ptr + b * K * MB + kk.to(tl.int64) * MB + nb
    tl.store(s_ptrs, scale, (nb < MB) & (kk < K))


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
    # the sign as a bit: Triton lowers `-x` to `0 - x`, which turns -0.0 (byte 0x80) into +0.0
    val = (mag.to(tl.int32, bitcast=True) | ((d & 0x80) << 24)).to(tl.float32, bitcast=True)
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
    return max(1, min(cap, next_pow2(max(n, 1))))


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
    native = e4m3_native(x_MK.device) if native_cast is None else native_cast
    grid = (cdiv(M, bm), cdiv(K, bk))
    launch(
        _mxfp8_dim0_kernel,
        grid,
        (x_MK, data.view(torch.uint8), scale.view(torch.uint8), M, K, x_MK.stride(0)),
        dict(FLOOR=floor, NATIVE_CAST=native, BLOCK_M=bm, BLOCK_K=bk),
        num_warps=warps,
    )
    return data, scale


DIM1_VARIANTS = ("regs", "tload")
_DIM1_KEYS = (
    "variant",
    "BLOCK_M",
    "BLOCK_K",
    "num_warps",
    "RPT",
    "KV",
    "K_FAST",
    "SAT_CAST",
    "ASM_PACK",
    "OFFS64",
)


def dim1_config(
    M: int,
    K: int,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    config: dict | None = None,
) -> dict:
    """The full launch config of ``to_mxfp8_dim1`` for an (.., M, K) input: ``config`` entries
    override ``block_m`` / ``block_k``, which override the defaults.

    Keys: ``variant`` ("regs": rows in registers, packed int32 stores, see
    ``_mxfp8_dim1_regs_kernel``; "tload": the tile loaded transposed), ``BLOCK_M`` (multiple of
    32), ``BLOCK_K``, ``num_warps``; "regs" only: ``RPT`` (rows per thread, 4 / 8 / 16 / 32),
    ``KV`` (adjacent columns per thread, the load width), ``K_FAST`` (grid walks K tiles first),
    ``SAT_CAST`` (no clamp before the GPU's saturating e4m3 cast: fewer instructions, same bits
    by the PTX spec), ``ASM_PACK`` (4 values -> one word with inline PTX, implies SAT_CAST; GPU
    only, ignored under the interpreter; on by default, checked bit-exact on the H200),
    ``OFFS64`` (64-bit offsets inside a tile; None: only when 32 bits
    could overflow);
    its num_warps defaults to one thread per RPT x KV cell (at most 32 warps), and
    (32 // RPT) * (BLOCK_K // KV) <= 32 keeps each 32-row block inside one warp (any choice is
    exact; these only decide the speed). "regs" needs M % 32 == 0; other inputs fall back to
    "tload"."""
    cfg = dict(config or {})
    bad = sorted(set(cfg) - set(_DIM1_KEYS))
    if bad:
        raise ValueError(f"config has unknown keys {bad}; known: {_DIM1_KEYS}")
    variant = cfg.get("variant", "regs")
    if variant not in DIM1_VARIANTS:
        raise ValueError(f"config['variant'] must be one of {DIM1_VARIANTS}, got {variant!r}")
    if M % _MX_BLOCK:
        variant = "tload"
    bm = cfg.get("BLOCK_M", block_m)
    bk = cfg.get("BLOCK_K", block_k)
    if variant == "tload":
        if INTERPRET:
            bm = bm or _pow2_at_most(M, 256)
            bk = bk or _pow2_at_most(K, max(16, 16384 // bm))
        else:
            # H200 (16384 x 8192 bf16): 32 x 128 took 2.3x the copy ceiling's time, 64 x 64
            # 2.4x, 128 x 32 3.4x, 64 x 128 3.7x, 128 x 64 5.1x
            bm = bm or _pow2_at_most(M, 32)
            bk = bk or _pow2_at_most(K, 128)
        bm = max(bm, _MX_BLOCK)
        warps = cfg.get("num_warps", 8 if bm * bk >= 8192 else 4)
        return {"variant": "tload", "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": warps}
    if INTERPRET:  # few, big programs (each instance costs ~0.4 ms); layouts do not matter
        rpt, kv = cfg.get("RPT", 32), cfg.get("KV", 1)
        bm = bm or _pow2_at_most(M, 256)
        bk = bk or _pow2_at_most(K, max(16, 16384 // bm))
    else:
        # 16 rows x 4 columns per thread (256 x 64 tiles, 8 warps), packed with inline PTX:
        # 8-byte bf16 loads (a warp reads 2 rows x 128 bytes per load), one 16-byte store per
        # column. H200 (benchmarks/gpu/mxfp8_dim1_sweep.py, bit-exact): 91% of the copy ceiling at
        # (16384, 8192) bf16, 90% at (131072, 2048), 94% at (8192, 4096) fp32; 128 x 64 without
        # the packing 86% / 86% / 38%; the old transposed-tile kernel 45% / 45% / 64%.
        rpt, kv = cfg.get("RPT", 16), cfg.get("KV", 4)
        bk = bk or _pow2_at_most(K, rpt * kv)  # (32 // RPT) * (BLOCK_K // KV) = 32 lanes
        bm = bm or _pow2_at_most(M, 256)
    bm = max(_pow2_at_most(bm, 1 << 30), _MX_BLOCK)
    bk = _pow2_at_most(bk, 1 << 30)
    if rpt not in (4, 8, 16, 32):
        raise ValueError(f"config['RPT'] must be 4, 8, 16 or 32, got {rpt}")
    kv = max(1, min(_pow2_at_most(kv, 1 << 30), bk))
    # one thread per (column group, row group) cell: the rows stay in registers
    cells = (bk // kv) * (bm // rpt)
    warps = cfg.get("num_warps", max(1, min(32, cells // 32)))
    return {
        "variant": "regs",
        "BLOCK_M": bm,
        "BLOCK_K": bk,
        "num_warps": warps,
        "RPT": rpt,
        "KV": kv,
        "K_FAST": bool(cfg.get("K_FAST", True)),
        "SAT_CAST": bool(cfg.get("SAT_CAST", False)),
        "ASM_PACK": bool(cfg.get("ASM_PACK", not INTERPRET)),
        "OFFS64": cfg.get("OFFS64"),
    }


def to_mxfp8_dim1(
    x_BMK: torch.Tensor,
    floor: bool,
    *,
    native_cast: bool | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise cast of (M, K) or (B, M, K): data (.., K, M) e4m3fn, scale (.., K, M // 32).

    ``block_m`` / ``block_k`` / ``config`` pick the kernel and its launch (see ``dim1_config``);
    every choice gives the same bits."""
    squeeze = x_BMK.dim() == 2
    x = x_BMK.unsqueeze(0) if squeeze else x_BMK
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, M, K = x.shape
    data = torch.empty((B, K, M), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((B, K, M // _MX_BLOCK), dtype=torch.float8_e8m0fnu, device=x.device)
    if B * M * K > 0:
        cfg = dim1_config(M, K, block_m=block_m, block_k=block_k, config=config)
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        native = e4m3_native(x.device) if native_cast is None else native_cast
        args = (x, data.view(torch.uint8), scale.view(torch.uint8), M, K, x.stride(0), x.stride(1))
        if cfg["variant"] == "tload":
            grid = (cdiv(M, bm), cdiv(K, bk), B)
            launch(
                _mxfp8_dim1_kernel,
                grid,
                args,
                dict(FLOOR=floor, NATIVE_CAST=native, BLOCK_M=bm, BLOCK_K=bk),
                num_warps=cfg["num_warps"],
            )
        else:
            k_fast = cfg["K_FAST"]
            grid_mk = [cdiv(M, bm), cdiv(K, bk)]
            if grid_mk[0 if k_fast else 1] > 65535:  # CUDA caps grid dim 1
                k_fast = not k_fast
            grid = (*(grid_mk[::-1] if k_fast else grid_mk), B)
            rpt = cfg["RPT"]
            # 32-bit offsets inside a tile unless its span could overflow them
            offs64 = cfg["OFFS64"]
            if offs64 is None:
                offs64 = bm * x.stride(1) + bk >= 2**31 or bk * (M // 4) + M // 4 >= 2**31
            launch(
                _mxfp8_dim1_regs_kernel,
                grid,
                (x, data.view(torch.int32), *args[2:]),
                dict(
                    FLOOR=floor,
                    NATIVE_CAST=native,
                    BLOCK_M=bm,
                    BLOCK_K=bk,
                    RPT=rpt,
                    KV=cfg["KV"],
                    VW=min(rpt // 4, 4),
                    K_FAST=k_fast,
                    MASKED=M % bm != 0 or K % bk != 0,
                    OFFS64=bool(offs64),
                    SAT_CAST=cfg["SAT_CAST"] and native,
                    ASM_PACK=cfg["ASM_PACK"] and native and not INTERPRET,
                ),
                num_warps=cfg["num_warps"],
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
    grid = (cdiv(M, bm), cdiv(K, bk))
    launch(
        _mxfp8_dequant_kernel,
        grid,
        (data_MK.view(torch.uint8), scale_MB.view(torch.uint8), out, M, K),
        dict(BLOCK_M=bm, BLOCK_K=bk),
        num_warps=warps,
    )
    return out
