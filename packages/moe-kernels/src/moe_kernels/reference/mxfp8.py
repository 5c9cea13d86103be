"""Pure-torch references for the MXFP8 ops: the CPU path and the oracle of the Triton kernels.

Every function here is exact bit for bit (integer bit manipulation for the scales, a power-of-two
multiply and one round-to-nearest-even cast for the data) and sync-free. No argument checks: the
public module ``moe_kernels.mxfp8`` checks before calling.
"""

from __future__ import annotations

import torch

from moe_kernels.reference.grouped_mm import clamp_group_ends

BLOCK = 32  # elements per MX block
E4M3_MAX = 448.0
E8M0_NAN = 255  # biased e8m0 byte of a NaN scale
_F32_INF_BITS = 0x7F800000
_F32_QNAN_BITS = 0x7FC00000
_E4M3_NAN = 0x7F
TILE_ROWS, TILE_COLS = 128, 4  # one cuBLAS scale tile: 128 x 4 bytes, 512 contiguous bytes


def ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def scale_exponent_from_amax_bits(amax_bits: torch.Tensor, scaling_mode: str) -> torch.Tensor:
    """Unbiased int32 scale exponent from the int32 bits of a non-negative fp32 block amax.

    floor: floor(log2(amax)) - 8; rceil: the smallest e with 2**e >= amax / 448; both clamped to
    [-127, 127]; zero / fp32-subnormal amax -> -127. An inf or NaN amax (bits >= inf) makes the
    block invalid: the caller handles it (the value returned for it here is meaningless).
    """
    biased = amax_bits >> 23  # amax >= 0, so no sign bit
    mant = amax_bits & 0x7FFFFF
    if scaling_mode == "floor":
        e = biased - 127 - 8
    else:
        # 448 = 1.75 * 2**8: amax = 1.m * 2**E fits under 448 * 2**(E-8) iff 1.m <= 1.75.
        e = biased - 127 - 8 + (mant > 0x600000).to(torch.int32)
    e = torch.where(biased == 0, -127, e)
    return e.clamp(-127, 127)


def _inv_scale_f32(e: torch.Tensor) -> torch.Tensor:
    """2**-e as fp32, exact for e in [-127, 127] (2**-127 is an fp32 subnormal)."""
    bits = torch.where(e == 127, 0x00400000, (127 - e) << 23)
    return bits.to(torch.int32).view(torch.float32)


def _e8m0_to_f32(scale_u8: torch.Tensor) -> torch.Tensor:
    """fp32 value of biased e8m0 bytes: 2**(b - 127); b = 0 -> 2**-127 (subnormal); 255 -> NaN."""
    b = scale_u8.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == E8M0_NAN, _F32_QNAN_BITS, bits)
    return bits.view(torch.float32)


def to_mxfp8(x_MK: torch.Tensor, scaling_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise MXFP8 cast: (M, K) float -> data (M, K) e4m3fn, scale (M, K // 32) e8m0fnu.

    See ``moe_kernels.mxfp8.to_mxfp8`` for the semantics (NaN and inf blocks included).
    """
    M, K = x_MK.shape
    x = x_MK.to(torch.float32).reshape(M, K // BLOCK, BLOCK)
    abs_bits = x.view(torch.int32) & 0x7FFFFFFF
    amax_bits = abs_bits.amax(dim=-1)  # integer max: NaN bits > inf bits > every finite value
    invalid = amax_bits >= _F32_INF_BITS  # the block holds an inf or a NaN
    e = scale_exponent_from_amax_bits(amax_bits, scaling_mode)
    q = (x * _inv_scale_f32(e)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    data = q.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(invalid[..., None], _E4M3_NAN, data)
    scale = torch.where(invalid, E8M0_NAN, e + 127).to(torch.uint8)
    return (
        data.reshape(M, K).view(torch.float8_e4m3fn),
        scale.view(torch.float8_e8m0fnu),
    )


def to_mxfp8_dim1(
    x_MK: torch.Tensor, scaling_mode: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise MXFP8 cast: (M, K) -> data (K, M), scale (K, M // 32); = to_mxfp8(x.t())."""
    return to_mxfp8(x_MK.t().contiguous(), scaling_mode)


def from_mxfp8(
    data_MK: torch.Tensor, scale_MB: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantise: data (M, K) e4m3fn, scale (M, K // 32) e8m0fnu or uint8 -> (M, K) ``dtype``.

    The fp32 product data * 2**(b - 127) is exact; one rounding to ``dtype`` follows.
    """
    M, K = data_MK.shape
    d = data_MK.view(torch.float8_e4m3fn).to(torch.float32).reshape(M, K // BLOCK, BLOCK)
    s = _e8m0_to_f32(scale_MB.view(torch.uint8))
    return (d * s[..., None]).reshape(M, K).to(dtype)


def _zero_pad(x: torch.Tensor, *sizes: int) -> torch.Tensor:
    """``x`` zero padded at the end of its last ``len(sizes)`` dims to ``sizes`` (torch 2.9's
    ``F.pad`` refuses a dim of size 0)."""
    out = x.new_zeros((*x.shape[: x.dim() - len(sizes)], *sizes))
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def to_blocked(scale_RC: torch.Tensor) -> torch.Tensor:
    """cuBLAS 1D-block-scaling layout of (R, C) 8-bit scales, shaped (Rp, Cp), zero padded."""
    R, C = scale_RC.shape
    Rp, Cp = ceil_to(R, TILE_ROWS), ceil_to(C, TILE_COLS)
    u8 = scale_RC.view(torch.uint8)
    padded = _zero_pad(u8, Rp, Cp)
    # rows r = (i, r // 32, r % 32), cols (j, c) -> order (i, j, r % 32, r // 32, c)
    tiles = padded.reshape(Rp // TILE_ROWS, 4, 32, Cp // TILE_COLS, TILE_COLS)
    out = tiles.permute(0, 3, 2, 1, 4).reshape(Rp, Cp)
    return out.view(scale_RC.dtype)


INT32_MAX = 2**31 - 1


def offsets_bound(num_groups: int) -> int:
    """The largest end offset ``compute_per_group_blocked_scale_offsets`` keeps for G groups:
    then start_rows[G] <= end + 127 G fits in int32."""
    return INT32_MAX - 127 * num_groups


def _group_layout(
    group_end_offsets: torch.Tensor, bound: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamped ends, sizes, start rows), int32, of the groups clamped with ``bound``."""
    ends = clamp_group_ends(group_end_offsets, bound).to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    padded = (sizes + (TILE_ROWS - 1)) // TILE_ROWS * TILE_ROWS
    start_rows = torch.cat([ends.new_zeros(1), torch.cumsum(padded, 0, dtype=torch.int32)])
    return ends, sizes, start_rows


def compute_per_group_blocked_scale_offsets(
    group_end_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(G,) end offsets -> group sizes (G,) int32, start rows (G+1,) int32 of the padded groups;
    the offsets clamped by ``clamp_group_ends`` with ``offsets_bound(G)``."""
    _, sizes, start_rows = _group_layout(
        group_end_offsets, offsets_bound(group_end_offsets.shape[0])
    )
    return sizes, start_rows


def to_blocked_per_group_2d(
    scale_RC: torch.Tensor, group_end_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row group laid out with ``to_blocked`` at rows [start_rows[g], start_rows[g+1]) of a
    (R + 128 * G, Cp) output; rows past start_rows[G] are left unspecified (here: zero). The end
    offsets are clamped by ``clamp_group_ends`` with bound R (every group inside the scales).

    Sync-free: every group is handled with static shapes (a gather over the whole output with a
    per-row source index), so this is also the compile-friendly form.
    """
    R, C = scale_RC.shape
    G = group_end_offsets.shape[0]
    Cp = ceil_to(C, TILE_COLS)
    R_out = R + TILE_ROWS * G
    dev = scale_RC.device
    ends, sizes, start_rows = _group_layout(group_end_offsets, R)
    in_starts = ends - sizes
    # For every output row (in the un-swizzled, row-major picture): its group and source row.
    out_rows = torch.arange(R_out, device=dev, dtype=torch.int32)
    g = torch.searchsorted(start_rows[1:], out_rows, right=True).clamp(max=G - 1)
    local = out_rows - start_rows[g]
    valid = (local < sizes[g]) & (out_rows < start_rows[G])
    src = torch.where(valid, in_starts[g] + local, 0).long()
    u8 = scale_RC.view(torch.uint8)
    rowmajor = torch.where(valid[:, None], u8[src] if R > 0 else u8.new_zeros(R_out, C), 0)
    # Every group starts on a 128-row boundary, so one global swizzle lays out each group alone.
    rowmajor = _zero_pad(rowmajor, ceil_to(R_out, TILE_ROWS), Cp)
    blocked = to_blocked(rowmajor)[:R_out]
    return blocked.view(scale_RC.dtype), start_rows


def to_blocked_per_group_3d(scale_ENC: torch.Tensor) -> torch.Tensor:
    """(E, N, C) scales -> (E, Np * Cp): each expert's (N, C) matrix laid out by ``to_blocked``."""
    E, N, C = scale_ENC.shape
    Np, Cp = ceil_to(N, TILE_ROWS), ceil_to(C, TILE_COLS)
    u8 = scale_ENC.view(torch.uint8)
    padded = _zero_pad(u8, Np, Cp)
    tiles = padded.reshape(E, Np // TILE_ROWS, 4, 32, Cp // TILE_COLS, TILE_COLS)
    out = tiles.permute(0, 1, 4, 3, 2, 5).reshape(E, Np * Cp)
    return out.view(scale_ENC.dtype)


def grouped_mm_dequantized(
    a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Grouped GEMM with static shapes: out[m] = a[m] @ b[g(m)] for rows of group g, zero rows past
    offsets[-1]. fp32 accumulation; one masked GEMM per expert (E x the FLOPs: the fallback)."""
    M = a_MK.shape[0]
    E, _, N = b_EKN.shape
    rows = torch.arange(M, device=a_MK.device, dtype=offsets_E.dtype)
    g = torch.searchsorted(offsets_E, rows, right=True)  # (M,), E for rows past the last group
    a32 = a_MK.to(torch.float32)
    out = a32.new_zeros(M, N)
    for e in range(E):
        out = torch.where((g == e)[:, None], a32 @ b_EKN[e].to(torch.float32), out)
    return out.to(out_dtype)
