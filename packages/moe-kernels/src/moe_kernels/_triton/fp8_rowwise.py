"""The row-wise FP8 (e4m3fn) quantiser's Triton pieces, shared by ``_triton/swiglu.py`` and
``_triton/gather_quant.py``, and the launch shape of their row kernels (one heuristic, one
typed override: ``RowConfig``).

The formula is ``moe_kernels.reference.fp8_rowwise``'s, step for step: NaN-free row maxima, the
1e-12 floor, the optional bound read on the device (floored at 1e-12 too), ``s = 448 / m`` and
``1 / s``, then ``e4m3fn(clamp(v * s, -448, 448))`` with 0x7F for NaN products. NaNs are handled
with explicit selects: the GPU's min/max ignore NaN operands and the interpreter's propagate them
(3.5, 3.6) or not (3.8), so nothing here leaves a NaN to either.

Division: Triton's fp32 ``/`` compiles to ``div.full.f32`` (approximate, up to 2 ulp; read in the
sm_90a PTX of Triton 3.5, 3.6 and 3.8: ``tests/test_swiglu.py``), which is what FBGEMM's kernels
run; the launchers' default (``IEEE_DIV=False``) divides the same way, so on the GPU the scales
and data equal FBGEMM's bit for bit (0 of 200 calls differ on the H200, session 19), while the
IEEE division differed in 1-3 ulp of about a fifth of the scales and moved data bytes with them.
Under the interpreter ``/`` is numpy's IEEE division: there the kernels equal the reference bit
for bit either way. ``IEEE_DIV=True`` (the launchers' ``ieee_div=True``, a typed override for
diagnostics) divides with ``tl.math.div_rn`` (``div.rn.f32``; ``div.rn.ftz.f32`` on Triton 3.5,
the same results here), the reference's IEEE division, on the GPU too.
The e4m3 rounding is the hardware's ``cvt.rn.satfinite`` on the GPU and, under the interpreter
(whose float8 cast is wrong near powers of two), the exact integer RNE of ``mxfp8_quant``.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import next_pow2
from moe_kernels._triton.mxfp8_quant import e4m3_bits_rne


@triton.jit
def row_absmax(v):
    """Per row (axis 1) max |v| of fp32 ``v``, NaN elements ignored (0 for a row of NaNs)."""
    return tl.max(tl.where(v == v, tl.abs(v), 0.0), axis=1)


@triton.jit
def row_scales(amax, ub_ptr, HAS_UB: tl.constexpr, IEEE_DIV: tl.constexpr):
    """(s, 1 / s) from NaN-free row maxima: m = max(amax, 1e-12), then the bound *ub_ptr where
    it is smaller (a NaN bound never is), raised to the 1e-12 floor (a zero, negative or -inf
    bound gives m = 1e-12: s stays positive and finite), s = 448 / m."""
    m = tl.maximum(amax, 1e-12)
    if HAS_UB:
        ub = tl.load(ub_ptr).to(tl.float32)
        m = tl.where(ub < m, tl.maximum(ub, 1e-12), m)
    if IEEE_DIV:
        s = tl.math.div_rn(tl.full(m.shape, 448.0, tl.float32), m)
        inv = tl.math.div_rn(tl.full(m.shape, 1.0, tl.float32), s)
    else:  # FBGEMM's `/`: div.full.f32 on the GPU
        s = 448.0 / m
        inv = 1.0 / s
    return s, inv


@triton.jit
def e4m3_bits(v, s, NATIVE_CAST: tl.constexpr):
    """uint8 e4m3fn bits of clamp(v * s, -448, 448), round to nearest even; 0x7F where the
    product is NaN. ``s`` broadcasts against ``v``."""
    y = v * s
    c = tl.clamp(y, -448.0, 448.0)
    if NATIVE_CAST:
        bits = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        bits = e4m3_bits_rne(c)
    return tl.where(y != y, 0x7F, bits).to(tl.uint8)


@triton.jit
def col_offsets(cols, stride, COL64: tl.constexpr):
    """cols * stride, in int64 where (D - 1) * stride may not fit in int32."""
    if COL64:
        offs = cols.to(tl.int64) * stride
    else:
        offs = cols * stride
    return offs


# --------------------------------------------------------------------------------------------
# Launch shapes


class RowConfig(NamedTuple):
    """Launch shape of the row kernels: ``block_t`` rows x ``block_d`` columns per program (powers
    of two), ``num_warps``. The quantising kernels hold a whole row when ``block_d >= D`` and
    otherwise walk it twice in ``block_d`` chunks (maxima, then quantise: the second pass reads
    from L2); the elementwise ``silu_mul`` tiles its 2-D grid with it."""

    block_t: int
    block_d: int
    num_warps: int


# Measured on the H200 (session 19, ``benchmarks/gpu/fp8_ops_gpu.py --configs-only``, CUDA-graph
# device time): silu_mul at (65536, 2048) 196 us with one row of 2048 a program against 212 us
# with 4 x 1024 (FBGEMM 186), and 2.3 against 3.5 us at (128, 5120); the gather-quant at
# D=5120 (not a power of two) 84 us at 16384 rows with two rows of 1024-wide chunks against 108
# holding the row padded to 8192 (FBGEMM 66), while silu_mul_quant is fastest with the padded row.
_ELEMWISE_TILE = 2048  # elements per program (GPU)
_ROW_CAP = 8192  # widest row a quantising program holds in registers (GPU)
_CHUNK = 4096  # chunk of a wider row
_GATHER_CHUNKS = RowConfig(2, 1024, 4)  # the gather-quant's rows of a width not a power of two
_INTERPRET_TILE, _INTERPRET_ROW_CAP = 16384, 2048  # numpy: few large programs


def _warps(tile: int) -> int:
    return 8 if tile >= 8192 else 4 if tile >= 2048 else 2 if tile >= 512 else 1


def pick_config(kind: str, num_rows: int, dim: int) -> RowConfig:
    """The default launch shape for ``kind`` ("elementwise": silu_mul; "quant": silu_mul_quant;
    "gather": the gather-quant) over ``num_rows`` rows of ``dim`` elements."""
    tile = _INTERPRET_TILE if INTERPRET else _ELEMWISE_TILE
    row_cap = _INTERPRET_ROW_CAP if INTERPRET else _ROW_CAP
    full = max(next_pow2(dim), 16)  # 16 elements: a 16-byte vector of 8 halves at least
    if kind == "gather" and not INTERPRET and 2048 <= dim < full:
        return _GATHER_CHUNKS
    if kind == "elementwise":
        block_d = min(full, 2048 if not INTERPRET else 4096)
    elif full <= row_cap:
        block_d = full
    else:
        block_d = _CHUNK if not INTERPRET else 1024
    block_t = max(1, min(tile // block_d, next_pow2(num_rows), 64))
    return RowConfig(block_t, block_d, _warps(block_t * block_d))


def check_config(config: object) -> RowConfig:
    """A ``RowConfig`` override, or ValueError/TypeError saying what is wrong with it."""
    if not isinstance(config, RowConfig):
        raise TypeError(f"config must be a RowConfig, got {type(config).__name__}")
    for name, value in config._asdict().items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
        if name != "num_warps" and value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two, got {value}")
    if config.num_warps & (config.num_warps - 1) or config.num_warps > 32:
        raise ValueError(f"config.num_warps must be a power of two <= 32, got {config.num_warps}")
    return config


def col64(dim: int, *strides: int) -> bool:
    """Whether column offsets need int64: (dim - 1) * stride >= 2**31 for a column stride."""
    return any((dim - 1) * s >= 2**31 for s in strides)


def num_chunks(dim: int, block_d: int) -> int:
    """Chunks of ``block_d`` columns covering a row of ``dim`` (1 for an empty row)."""
    return max(1, -(-dim // block_d))
