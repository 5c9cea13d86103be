"""Score keys: each (token, expert) score as an integer whose order is the routing order.

The order-preserving code of the score sits in the high bits and ``E_PAD - 1 - e`` in the low
bits, so keys are unique and ties go to the lower expert; NaN ranks as -inf and -0.0 as +0.0.
int32 keys for 16-bit scores, int64 for fp32; for 16-bit scores and <= 128 experts the same
order as fp32 values holding exact integers (``score_fkeys``), which compare-exchange faster.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bits16_to_f32(bits, IS_BF16: tl.constexpr):
    """Raw bf16/fp16 bits (int32 holding the 16-bit pattern, sign-extended) -> fp32 value."""
    if IS_BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def popcount_swar(x):
    """Set bits of each int32 (SWAR bit counting; the interpreter has no popc)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def score_keys(
    x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
    E_PAD: tl.constexpr, KIND: tl.constexpr, EVEN_E: tl.constexpr, SENT: tl.constexpr,
):  # fmt: skip
    """(rows, cols) scores -> unique integer keys: the order-preserving code of the score in the
    high bits, ``E_PAD - 1 - e`` in the low bits (ties to the lower expert), NaN as -inf, -0.0 as
    +0.0; int32 for 16-bit scores, int64 for fp32; SENT in padded columns."""
    col_ok = cols < E
    low = E_PAD - 1 - cols
    offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
    if EVEN_E:
        ld_mask = row_ok[:, None]
    else:
        ld_mask = row_ok[:, None] & col_ok[None, :]
    if KIND == 0:
        x = tl.load(x_ptr + offs, mask=ld_mask, other=0.0)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == 0.0, 0.0, x)
        bits = x.to(tl.int32, bitcast=True)
        code = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (code.to(tl.int64) << 32) | low[None, :].to(tl.int64)
    else:
        bits = tl.load(x_ptr + offs, mask=ld_mask, other=0).to(tl.int32)  # sign-extended
        mag = bits & 0x7FFF
        if KIND == 1:
            bits = tl.where(mag > 0x7F80, -128, bits)  # NaN -> -inf (0xFF80)
        else:
            bits = tl.where(mag > 0x7C00, -1024, bits)  # NaN -> -inf (0xFC00)
        code = bits ^ ((bits >> 15) & 0x7FFF)
        code = tl.where(mag == 0, 0, code)  # -0.0 -> +0.0
        key = (code << 16) | low[None, :]
    if not EVEN_E:
        key = tl.where(col_ok[None, :], key, SENT)
    return key


@triton.jit
def score_fkeys(
    x_ptr, rows64, row_ok, cols, stride_t, stride_e, E,
    E_PAD: tl.constexpr, KIND: tl.constexpr, EVEN_E: tl.constexpr, OLD_INTERP: tl.constexpr,
):  # fmt: skip
    """16-bit scores (E_PAD <= 128) -> the same order as ``score_keys`` as fp32 keys holding
    exact integers in [2^23, 2^24): (sortable 16-bit code) << 7 | (E_PAD - 1 - e). Differences
    of such keys are exact, so a compare-exchange needs one max and two adds (``_ce``). 0.0 in
    padded columns."""
    col_ok = cols < E
    offs = rows64[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_e
    if EVEN_E:
        ld_mask = row_ok[:, None]
    else:
        ld_mask = row_ok[:, None] & col_ok[None, :]
    bits = tl.load(x_ptr + offs, mask=ld_mask, other=0).to(tl.int32)  # sign-extended
    low = (E_PAD - 1 - cols)[None, :] | 0x4B000000  # exponent of 2^23
    if KIND == 1:
        f = (bits << 16).to(tl.float32, bitcast=True)
        if OLD_INTERP:
            f = tl.where(f != f, float("-inf"), f)
        else:
            f = tl.maximum(f, float("-inf"))  # NaN -> -inf: max.f32 returns the other operand
        f = f + 0.0  # -0.0 -> +0.0
        b = f.to(tl.int32, bitcast=True)
        u = (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)  # order as unsigned
        key = ((u >> 9) & 0x7FFF80).to(tl.int32) | low
    else:
        mag = bits & 0x7FFF
        bits = tl.where(mag > 0x7C00, -1024, bits)  # NaN -> -inf (0xFC00)
        code = bits ^ ((bits >> 15) & 0x7FFF)
        code = tl.where(mag == 0, 0, code)  # -0.0 -> +0.0
        key = ((code + 0x8000) << 7) | low
    key = key.to(tl.float32, bitcast=True)
    if not EVEN_E:
        key = tl.where(col_ok[None, :], key, 0.0)
    return key


@triton.jit
def fkeys_to_keys(mk):
    """fp32 keys of ``score_fkeys`` -> the int32 keys of ``score_keys`` (INT32_MIN for 0.0)."""
    kb = mk.to(tl.int32, bitcast=True) & 0x7FFFFF
    return tl.where(mk == 0.0, -2147483648, (((kb >> 7) - 0x8000) << 16) | (kb & 0x7F))


# Packed 16-bit pairs: int32 words each holding two bf16 or fp16 scores (``MODE`` of ``_ce``: 2
# bf16x2 and 3 fp16x2 by inline PTX, 4 and 5 the same emulated in fp32 for the interpreter, which


@triton.jit
def popc(x, ASM: tl.constexpr):
    """Set bits of each int32: ``popc`` on the GPU, ``popcount_swar`` in the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return popcount_swar(x)
