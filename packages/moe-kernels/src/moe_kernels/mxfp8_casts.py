"""MXFP8 (OCP microscaling, e4m3 data + e8m0 scales, blocks of 32): quantisation, dequantisation
and the cuBLAS blocked scale layout (whole, per row group, per expert). The grouped GEMM is in
``mxfp8.py``, its backward in ``_mxfp8_train.py``.

Every op is a ``torch.library`` custom op (``moe_kernels::<name>``) with a fake implementation:
safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no host sync, deterministic.
CUDA runs Triton kernels, CPU the pure-torch reference (the kernels under ``TRITON_INTERPRET=1``);
both are bit-exact to each other (checked on an H200), except that the interpreter truncates where
``from_mxfp8`` rounds to bfloat16 (only bf16-subnormal results need rounding there).

Numerics of the casts (``to_mxfp8``, ``to_mxfp8_dim1``), per block of 32 values. They are
torchao's rules after 0.18 (pytorch/ao #4725); 0.18 itself gave inf blocks scale 254 and data +-448.

* amax: the largest |x| of the block, in fp32 (bf16 / fp16 inputs convert to fp32 exactly).
* scale exponent e: ``"floor"`` (OCP MX) floor(log2(amax)) - 8; ``"rceil"`` the smallest e with
  2**e >= amax / 448 (computed exactly from the fp32 bits); clamped to [-127, 127]. Scale byte =
  e + 127 (``torch.float8_e8m0fnu``). E.g. amax 448: byte 127 in both modes; 480: 127 (floor) /
  128 (rceil); the fp32 or bf16 maximum: 246 / 247.
* data = round-to-nearest-even(x / 2**e) to ``torch.float8_e4m3fn``, saturated to +-448 (bytes
  0x7E / 0xFE), sign kept (also where a value rounds to zero: 0x80). E.g. 480 with the floor scale
  2**0 saturates to 448 (0x7E); 1.0 in a block whose amax is 1.0: e = -8, data 256 (0x78).
* a block that is all zero, or whose amax is below 2**-118 (floor) / at most 448 * 2**-127
  (rceil), gets the clamped e = -127 (byte 0, the scale 2**-127): data x * 2**127, e.g. 2**-126
  -> 2.0 (0x40), the smallest bf16 subnormal 2**-133 -> 2**-6 (0x08, negative 0x88), the smallest
  fp32 subnormal 2**-149 -> 0 (0x00, negative 0x80). fp16 subnormals are fp32 normals: ordinary
  scales.
* a block holding any +-inf or any NaN is invalid: scale byte 255 (e8m0 NaN; e8m0 has no
  infinity, so NaN is the consistent answer) and every data byte 0x7F (e4m3 NaN), so the whole
  block dequantises to NaN.
"""

from __future__ import annotations

import torch

from . import _validate as v
from ._dispatch import register_op, triton_kernels, use_triton
from .reference import mxfp8 as _ref

__all__ = [
    "SCALING_MODES",
    "to_mxfp8",
    "to_mxfp8_dim1",
    "from_mxfp8",
    "to_blocked",
    "compute_per_group_blocked_scale_offsets",
    "to_blocked_per_group_2d",
    "to_blocked_per_group_3d",
]

SCALING_MODES = ("floor", "rceil")
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = _ref.BLOCK
_ceil_to = _ref.ceil_to


def _tq():
    return triton_kernels("mxfp8_quant")  # imported on first use: triton only when a kernel runs


def _tl():
    return triton_kernels("mxfp8_layout")


def _check_mode(scaling_mode: object) -> str:
    if not isinstance(scaling_mode, str):
        raise TypeError(f"scaling_mode must be a str, got {type(scaling_mode).__name__}")
    if scaling_mode not in SCALING_MODES:
        raise ValueError(f"scaling_mode must be one of {SCALING_MODES}, got {scaling_mode!r}")
    return scaling_mode


def _check_x(x: torch.Tensor, dim: int) -> None:
    v.dtype("x", x, v.FLOAT_DTYPES)
    v.rank("x", x, 2)
    if x.shape[dim] % BLOCK:
        which = "K (dim 1)" if dim == 1 else "M (dim 0)"
        raise ValueError(f"x's {which} must be a multiple of 32, got shape {tuple(x.shape)}")


_MAX_GROUPS = 2**24  # start rows are int32: 128 * G must leave room for the rows


def _check_offsets(name: str, offs: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    v.dtype(name, offs, v.INDEX_DTYPES)
    v.rank(name, offs, 1)
    if not 1 <= offs.shape[0] < _MAX_GROUPS:
        raise ValueError(
            f"{name} must hold between 1 and {_MAX_GROUPS - 1} groups, got shape "
            f"{tuple(offs.shape)}"
        )
    if ref is not None:
        v.same_device(ref_name, ref, **{name: offs})


# --------------------------------------------------------------------------------------------
# casts. The custom ops take 8-bit inputs as uint8 views (opcheck's schema check cannot compare
# float8 tensors on CPU); the public functions view them back.


def _to_mxfp8_impl(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x.device):
        return _tq().to_mxfp8(x, scaling_mode == "floor")
    return _ref.to_mxfp8(x, scaling_mode)


def _to_mxfp8_fake(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    return (
        x.new_empty((M, K), dtype=torch.float8_e4m3fn),
        x.new_empty((M, K // BLOCK), dtype=torch.float8_e8m0fnu),
    )


to_mxfp8_op = register_op("to_mxfp8", _to_mxfp8_impl, _to_mxfp8_fake)


def to_mxfp8(x: torch.Tensor, *, scaling_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise MXFP8 cast, blocks of 32 along the last dim (numerics: see the module docstring).

    x: (M, K) float32 / bfloat16 / float16, K % 32 == 0.
    Returns data (M, K) ``float8_e4m3fn`` and scale (M, K // 32) ``float8_e8m0fnu``.
    """
    _check_x(x, 1)
    return to_mxfp8_op.call(x, _check_mode(scaling_mode))


def _to_mxfp8_dim1_impl(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x.device):
        return _tq().to_mxfp8_dim1(x, scaling_mode == "floor")
    return _ref.to_mxfp8_dim1(x, scaling_mode)


def _to_mxfp8_dim1_fake(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    return (
        x.new_empty((K, M), dtype=torch.float8_e4m3fn),
        x.new_empty((K, M // BLOCK), dtype=torch.float8_e8m0fnu),
    )


to_mxfp8_dim1_op = register_op("to_mxfp8_dim1", _to_mxfp8_dim1_impl, _to_mxfp8_dim1_fake)


def to_mxfp8_dim1(
    x: torch.Tensor, *, scaling_mode: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise MXFP8 cast, blocks of 32 down the rows; equal to ``to_mxfp8(x.t())`` without
    materialising the transpose.

    x: (M, K) float32 / bfloat16 / float16, M % 32 == 0.
    Returns data (K, M) ``float8_e4m3fn`` and scale (K, M // 32) ``float8_e8m0fnu``.
    """
    _check_x(x, 0)
    return to_mxfp8_dim1_op.call(x, _check_mode(scaling_mode))


def _from_mxfp8_impl(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if use_triton(data.device):
        return _tq().from_mxfp8(data, scale, dtype)
    return _ref.from_mxfp8(data, scale, dtype)


def _from_mxfp8_fake(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=dtype)


from_mxfp8_op = register_op("from_mxfp8", _from_mxfp8_impl, _from_mxfp8_fake)


def from_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantise: data (M, K) ``float8_e4m3fn`` (or uint8 bits), scale (M, K // 32)
    ``float8_e8m0fnu`` (or uint8) -> (M, K) ``dtype`` (bfloat16 / float16 / float32).

    value = data * 2**(byte - 127), exact in fp32 then rounded once to ``dtype``; byte 255 -> NaN.
    """
    v.dtype("data", data, (torch.float8_e4m3fn, torch.uint8))
    v.dtype("scale", scale, _SCALE_DTYPES)
    v.rank("data", data, 2)
    v.rank("scale", scale, 2)
    v.same_device("data", data, scale=scale)
    if not isinstance(dtype, torch.dtype) or dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    M, K = data.shape
    if K % BLOCK:
        raise ValueError(f"data's K must be a multiple of 32, got shape {tuple(data.shape)}")
    if tuple(scale.shape) != (M, K // BLOCK):
        raise ValueError(f"scale must have shape {(M, K // BLOCK)}, got {tuple(scale.shape)}")
    return from_mxfp8_op.call(data.view(torch.uint8), scale.view(torch.uint8), dtype)


# --------------------------------------------------------------------------------------------
# blocked scale layouts


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)  # a view costs ~1 us of host


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def _check_scales(name: str, s: torch.Tensor, ndim: int) -> None:
    v.dtype(name, s, _SCALE_DTYPES)
    v.rank(name, s, ndim)


def _to_blocked_impl(scale: torch.Tensor) -> torch.Tensor:
    if use_triton(scale.device):
        return _tl().to_blocked(scale)
    return _ref.to_blocked(scale).clone()


def _to_blocked_fake(scale: torch.Tensor) -> torch.Tensor:
    R, C = scale.shape
    return scale.new_empty((_ceil_to(R, 128), _ceil_to(C, 4)))


to_blocked_op = register_op("to_blocked", _to_blocked_impl, _to_blocked_fake)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS "1D block scaling factors" layout of (R, C) scales, in its flat order.

    Returns (ceil(R/128)*128, ceil(C/4)*4), same dtype (e8m0fnu or uint8). Each 128x4 tile is 512
    contiguous bytes, element (r, c) of a tile at byte (r % 32) * 16 + (r // 32) * 4 + c, tiles in
    row-of-tiles order; padding is zero.
    """
    _check_scales("scale", scale, 2)
    return _as(to_blocked_op.call(_as_u8(scale)), scale.dtype)


def _group_offsets_impl(group_end_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(group_end_offsets.device):
        return _tl().group_offsets(group_end_offsets)
    return _ref.compute_per_group_blocked_scale_offsets(group_end_offsets)


def _group_offsets_fake(group_end_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    G = group_end_offsets.shape[0]
    return (
        group_end_offsets.new_empty((G,), dtype=torch.int32),
        group_end_offsets.new_empty((G + 1,), dtype=torch.int32),
    )


compute_per_group_blocked_scale_offsets_op = register_op(
    "compute_per_group_blocked_scale_offsets", _group_offsets_impl, _group_offsets_fake
)


def compute_per_group_blocked_scale_offsets(
    group_end_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group sizes and padded start rows of row groups in the per-group blocked layout.

    group_end_offsets: (G,) int32/int64, non-decreasing, last = R (not checked: no sync); each
    end is clamped into [previous clamped end, 2**31 - 1 - 127 G] (0 before the first group),
    so sizes are never negative and start_rows never overflows (results for offsets breaking
    the contract are unspecified but deterministic). 1 <= G < 2**24.
    Returns group_sizes (G,) int32 and start_rows (G + 1,) int32 with start_rows[0] = 0,
    start_rows[g + 1] = start_rows[g] + ceil(size_g / 128) * 128. On the device, no sync.
    """
    _check_offsets("group_end_offsets", group_end_offsets, "", None)
    return compute_per_group_blocked_scale_offsets_op.call(group_end_offsets)


def _blocked_2d_impl(
    scales: torch.Tensor, group_end_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(scales.device):
        return _tl().to_blocked_per_group_2d(scales, group_end_offsets)
    return _ref.to_blocked_per_group_2d(scales, group_end_offsets)


def _blocked_2d_fake(
    scales: torch.Tensor, group_end_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = scales.shape
    G = group_end_offsets.shape[0]
    return (
        scales.new_empty((R + 128 * G, _ceil_to(C, 4))),
        group_end_offsets.new_empty((G + 1,), dtype=torch.int32),
    )


to_blocked_per_group_2d_op = register_op(
    "to_blocked_per_group_2d", _blocked_2d_impl, _blocked_2d_fake
)


def to_blocked_per_group_2d(
    scales: torch.Tensor, group_end_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of row groups, each group on its own (for MXFP8 grouped GEMMs along M).

    scales: (R, C) e8m0fnu or uint8; group_end_offsets: (G,) int32/int64, non-decreasing, last = R
    (not checked: no sync); 1 <= G < 2**24, empty groups allowed. Memory-safe for any offsets:
    each end is clamped into [previous clamped end, R] (0 before the first group), so every
    group lies inside the scales (results for offsets breaking the contract are unspecified but
    deterministic, the same on every path).
    Returns blocked (R + 128 * G, ceil(C/4)*4), same dtype: group g is ``to_blocked`` of its rows at
    rows [start_rows[g], start_rows[g+1]) (zero padding inside its tiles); rows past start_rows[G]
    are unspecified (not written). And start_rows (G + 1,) int32 as in
    ``compute_per_group_blocked_scale_offsets`` (of the ends clamped to R).
    """
    _check_scales("scales", scales, 2)
    _check_offsets("group_end_offsets", group_end_offsets, "scales", scales)
    R, G = scales.shape[0], group_end_offsets.shape[0]
    if R + 128 * (G + 1) >= 2**31:  # int32 row arithmetic in the kernel
        raise ValueError(f"scales' rows plus 128 per group must stay below 2**31, got R={R}, G={G}")
    blocked, start_rows = to_blocked_per_group_2d_op.call(_as_u8(scales), group_end_offsets)
    return _as(blocked, scales.dtype), start_rows


def _blocked_3d_impl(scales: torch.Tensor) -> torch.Tensor:
    if use_triton(scales.device):
        return _tl().to_blocked_per_group_3d(scales)
    return _ref.to_blocked_per_group_3d(scales).clone()


def _blocked_3d_fake(scales: torch.Tensor) -> torch.Tensor:
    E, N, C = scales.shape
    return scales.new_empty((E, _ceil_to(N, 128) * _ceil_to(C, 4)))


to_blocked_per_group_3d_op = register_op(
    "to_blocked_per_group_3d", _blocked_3d_impl, _blocked_3d_fake
)


def to_blocked_per_group_3d(scales: torch.Tensor) -> torch.Tensor:
    """(E, N, C) scales -> (E, ceil(N/128)*128 * ceil(C/4)*4), same dtype: each expert's (N, C)
    matrix laid out with ``to_blocked`` (flattened)."""
    _check_scales("scales", scales, 3)
    return _as(to_blocked_per_group_3d_op.call(_as_u8(scales)), scales.dtype)
