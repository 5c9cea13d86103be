"""MXFP8 oracles: the e4m3 code table, the casts (bytes by nearest-value search in numpy, values
in float64 torch), the cuBLAS blocked scale layout by its definition, the grouped GEMM's operands'
round trip and the training recipe's gradients emulated by hand.

numpy is imported where a function needs it (``moe-bench verify`` runs the torch ones without
numpy).
"""

from __future__ import annotations

import functools
import math
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "oracle_blocked",
    "oracle_blocked_start_rows",
    "oracle_dequant",
    "oracle_e4m3",
    "oracle_e4m3_bits",
    "oracle_e4m3_value",
    "oracle_mxfp8",
    "oracle_mxfp8_bits",
    "oracle_mxfp8_exponent",
    "oracle_mxfp8_grouped_mm_grads",
    "oracle_mxfp8_round_trip",
    "oracle_mxfp8_scale",
]

# ----------------------------------------------------------------------------------------------
# bytes: the e4m3 code table, the exponent rules, python per block (numpy)


def oracle_e4m3_value(code: int) -> float:
    """The value of a non-negative e4m3fn code (0x00 .. 0x7E; bit 7, the sign, ignored)."""
    e, m = (code >> 3) & 15, code & 7
    return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


@functools.cache
def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """(codes 0x00 .. 0x7E, their values): the non-negative finite e4m3fn values, increasing."""
    import numpy as np

    codes = np.arange(0x7F)
    values = np.array([oracle_e4m3_value(int(c)) for c in codes])
    assert values[-1] == 448.0 and np.all(np.diff(values) > 0)
    return codes, values


def oracle_e4m3_bits(v: np.ndarray) -> np.ndarray:
    """float64 -> e4m3fn bits: round to nearest, ties to even code, saturate to +-448."""
    import numpy as np

    _CODES, _VALUES = _e4m3_table()
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(_VALUES, a), 0, len(_VALUES) - 1)
    lo = np.clip(hi - 1, 0, None)
    dlo, dhi = a - _VALUES[lo], _VALUES[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (_CODES[hi] % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def oracle_mxfp8_exponent(amax: float, mode: str) -> int:
    """Unbiased scale exponent of a finite block amax (inf / NaN blocks are invalid: no scale),
    ``mode`` "floor" or "rceil"."""
    assert math.isfinite(amax)
    if amax == 0:
        return -127
    if mode == "floor":
        e = math.frexp(amax)[1] - 1 - 8
    else:  # smallest e with 448 * 2**e >= amax, exact in float64
        e = math.frexp(amax)[1] - 1 - 9
        while 448.0 * 2.0**e < amax:
            e += 1
    return max(-127, min(127, e))


def oracle_mxfp8_bits(x: torch.Tensor, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(data bytes (M, K) uint8, scale bytes (M, K/32) uint8) of ``to_mxfp8(x, mode)`` for a
    CPU (M, K) ``x``, K % 32 == 0, one block of 32 at a time: a block with an inf or a NaN gets
    the NaN scale (255) and NaN data (0x7F)."""
    import numpy as np

    x64 = x.double().numpy()
    M, K = x64.shape
    data = np.zeros((M, K), np.uint8)
    scale = np.zeros((M, K // 32), np.uint8)
    for i in range(M):
        for b in range(K // 32):
            blk = x64[i, 32 * b : 32 * b + 32]
            if not np.isfinite(blk).all():  # any inf or NaN: NaN scale, NaN data
                scale[i, b], data[i, 32 * b : 32 * b + 32] = 255, 0x7F
                continue
            e = oracle_mxfp8_exponent(float(np.abs(blk).max()), mode)
            scale[i, b] = e + 127
            data[i, 32 * b : 32 * b + 32] = oracle_e4m3_bits(blk / 2.0**e)
    return data, scale


# ----------------------------------------------------------------------------------------------
# values: the rceil cast in float64 torch (finite inputs)


def oracle_mxfp8_scale(x_MK: torch.Tensor) -> torch.Tensor:
    """(M, K/32) uint8 biased exponents: the smallest e with 2**e >= amax / 448 (rceil), in fp64."""
    M, K = x_MK.shape
    amax = x_MK.double().abs().reshape(M, K // 32, 32).amax(-1)
    e = torch.ceil(torch.log2(amax / 448.0))
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def oracle_e4m3(v: torch.Tensor) -> torch.Tensor:
    """The nearest e4m3fn value of each float64 value (ties to even; 3 mantissa bits, exponent at
    least -6 with subnormals below, saturating at 448)."""
    ex = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    step = torch.exp2(ex - 3)
    return (torch.round(v / step) * step).clamp(-448.0, 448.0)


def oracle_mxfp8(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data as float64 e4m3 values, scale bytes) of the rceil MXFP8 cast of (M, K), K % 32 == 0."""
    M, K = x_MK.shape
    scale = oracle_mxfp8_scale(x_MK)
    x = x_MK.double().cpu().reshape(M, K // 32, 32)
    data = oracle_e4m3(x / torch.exp2(scale.double() - 127)[..., None])
    return data.reshape(M, K), scale


def oracle_dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 value of an MXFP8 cast, by hand: data * 2**(byte - 127) per block of 32 along the
    last dim. ``data``: e4m3 (or its float64 values), ``scale``: e8m0 or uint8 bytes."""
    s = torch.exp2(scale.view(torch.uint8).double() - 127.0)
    return data.double() * s.repeat_interleave(32, dim=-1)


def oracle_mxfp8_round_trip(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """float64 values of ``x`` cast to MXFP8 (rceil, blocks of 32 along ``dim``; finite values)
    and back, on the CPU: ``oracle_dequant(*oracle_mxfp8(...))`` of every 1-D slice."""
    xt = x.double().cpu().movedim(dim, -1)
    flat = xt.reshape(-1, xt.shape[-1])
    return oracle_dequant(*oracle_mxfp8(flat)).reshape(xt.shape).movedim(-1, dim)


# ----------------------------------------------------------------------------------------------
# the blocked scale layouts


def oracle_blocked(scale_RC: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scaling layout by its definition: 128x4 tiles in row-major tile order, inside
    a tile byte (r, c) at offset (r % 32) * 16 + (r // 32) * 4 + c; zero padding. (R, C) bytes
    (uint8 or e8m0) -> (Rp, Cp) uint8 on the CPU."""
    R, C = scale_RC.shape
    Rp, Cp = -(-R // 128) * 128, -(-C // 4) * 4
    src = scale_RC.view(torch.uint8).cpu()
    out = torch.zeros(Rp * Cp, dtype=torch.uint8)
    r = torch.arange(R)[:, None].expand(R, C)
    c = torch.arange(C)[None, :].expand(R, C)
    tile = (r // 128) * (Cp // 4) + c // 4
    rr, cc = r % 128, c % 4
    out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = src
    return out.view(Rp, Cp)


def oracle_blocked_start_rows(sizes: list[int]) -> list[int]:
    """The first row of each group's blocks in the per-group blocked layout (each group's rows
    rounded up to a multiple of 128), and the total: G + 1 ints."""
    rows = [0]
    for n in sizes:
        rows.append(rows[-1] + -(-n // 128) * 128)
    return rows


# ----------------------------------------------------------------------------------------------
# the training recipe's gradients (moe_kernels._mxfp8_train), emulated with the public casts


def _rowwise64(x: torch.Tensor) -> torch.Tensor:
    """q(x) along the last dim, zero padding of a partial last block."""
    from moe_kernels import mxfp8 as mx

    pad = -x.shape[-1] % 32
    xp = torch.nn.functional.pad(x, (0, pad))
    return oracle_dequant(*mx.to_mxfp8(xp))[:, : x.shape[-1]]


def oracle_mxfp8_grouped_mm_grads(a, b, ends, dy):
    """float64 dA (M, K), dB (E, K, N) of ``mxfp8_grouped_mm(a, b, ends)`` for upstream ``dy``
    (M, N): torchao's recipe per group with host loops, each cast by the public ``to_mxfp8``
    (dA: dY and b[e] along N; dB: a and dY along the tokens, each group's rows zero-padded at
    its start in the 128-row layout of ``compute_per_group_blocked_scale_offsets``)."""
    from moe_kernels import mxfp8 as mx

    E, K, N = b.shape
    sizes, start_rows = mx.compute_per_group_blocked_scale_offsets(ends)
    sizes, start_rows = sizes.tolist(), start_rows.tolist()
    bounds = [0, *ends.tolist()]
    dyq = _rowwise64(dy)  # along N
    da = torch.zeros(a.shape, dtype=torch.float64)
    # each group's rows at its padded start; both operands transposed, cast along the tokens
    a_pad = a.new_zeros(start_rows[-1], K)
    dy_pad = dy.new_zeros(start_rows[-1], N)
    for e in range(E):
        s, t = bounds[e], bounds[e + 1]
        da[s:t] = dyq[s:t] @ _rowwise64(b[e]).T  # b[e] (K, N) along N
        a_pad[start_rows[e] : start_rows[e] + sizes[e]] = a[s:t]
        dy_pad[start_rows[e] : start_rows[e] + sizes[e]] = dy[s:t]
    aq_t = oracle_dequant(*mx.to_mxfp8(a_pad.t().contiguous()))  # (K, rows)
    dyq_t = oracle_dequant(*mx.to_mxfp8(dy_pad.t().contiguous()))  # (N, rows)
    db = torch.stack([aq_t[:, r:t] @ dyq_t[:, r:t].T for r, t in pairwise(start_rows)])
    return da, db
