"""MXFP8 grouped GEMM (``mxfp8_grouped_mm``: torchao's MXFP8 training recipe, its backward in
``_mxfp8_train.py``), and the public home of the MXFP8 casts and scale layouts
(``mxfp8_casts.py``, re-exported here). Numerics of the casts: ``mxfp8_casts``.
"""

from __future__ import annotations

import torch

from . import _mxfp8_train as _train
from . import _validate as v
from ._dispatch import register_op, triton_kernels, use_triton
from ._gemm_plan import plan_mxfp8
from .mxfp8_casts import (
    BLOCK,
    SCALING_MODES,
    compute_per_group_blocked_scale_offsets,
    from_mxfp8,
    to_blocked,
    to_blocked_per_group_2d,
    to_blocked_per_group_2d_op,
    to_blocked_per_group_3d,
    to_blocked_per_group_3d_op,
    to_mxfp8,
    to_mxfp8_dim1,
)
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
    "mxfp8_grouped_mm",
]


def _tq():
    return triton_kernels("mxfp8_quant")  # imported on first use: triton only when a kernel runs


# --------------------------------------------------------------------------------------------
# grouped GEMM


def _quantize_operands(a: torch.Tensor, b: torch.Tensor):
    """a rowwise along K; b per expert along K (the column-wise cast of each (K, N) matrix)."""
    E, K, N = b.shape
    if use_triton(a.device):
        a_data, a_scale = _tq().to_mxfp8(a, False)
        b_data, b_scale = _tq().to_mxfp8_dim1(b, False)  # (E, N, K), (E, N, K // 32)
    else:
        a_data, a_scale = _ref.to_mxfp8(a, "rceil")
        bt = b.transpose(-2, -1).reshape(E * N, K)
        b_data, b_scale = _ref.to_mxfp8(bt, "rceil")
        b_data, b_scale = b_data.view(E, N, K), b_scale.view(E, N, K // BLOCK)
    return a_data, a_scale, b_data, b_scale


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if use_triton(data.device):
        return _tq().from_mxfp8(data, scale, torch.bfloat16)
    return _ref.from_mxfp8(data, scale, torch.bfloat16)


def _mxfp8_grouped_mm_impl(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    M, K = a.shape
    E, _, N = b.shape
    if E == 0:
        return a.new_zeros((M, N), dtype=out_dtype)
    offsets = _ref.clamp_group_ends(offsets, M).to(torch.int32)  # memory safety: see the docstring
    a_data, a_scale, b_data, b_scale = _quantize_operands(a, b)
    if plan_mxfp8(a).kernel == "scaled_cutlass":
        a_blk, _ = to_blocked_per_group_2d_op.call(a_scale.view(torch.uint8), offsets)
        b_blk = to_blocked_per_group_3d_op.call(b_scale.view(torch.uint8))
        out = torch._scaled_grouped_mm(
            a_data,
            b_data.transpose(-2, -1),
            a_blk.view(torch.float8_e8m0fnu),
            b_blk.view(torch.float8_e8m0fnu),
            offs=offsets,
            out_dtype=out_dtype,
        )
        return _train.zero_tail(out, offsets)
    # Emulation with the same numerics: the dequantised operands are exact in bf16.
    a_dq = _dequant(a_data, a_scale)
    b_dq = _dequant(b_data.view(E * N, K), b_scale.view(E * N, K // BLOCK))
    b_dq = b_dq.view(E, N, K).transpose(-2, -1)  # (E, K, N), column-major per expert
    return _train.dequantized_grouped_mm(a_dq, b_dq, offsets, out_dtype)


def _mxfp8_grouped_mm_fake(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


mxfp8_grouped_mm_op = register_op(
    "mxfp8_grouped_mm", _mxfp8_grouped_mm_impl, _mxfp8_grouped_mm_fake
)
mxfp8_grouped_mm_op.register_autograd(_train.backward, _train.setup_context)


def mxfp8_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped GEMM in MXFP8: out[m] = q(a)[m] @ q(b)[g] for the rows m of group g.

    a: (M, K) bfloat16, rows grouped by expert; b: (E, K, N) bfloat16; offsets: (E,) int32 end
    offsets (non-decreasing, last <= M, as ``torch._grouped_mm`` takes them; not checked: no
    sync; each end is clamped into [previous clamped end, M], 0 before the first group, in the
    forward and the backward, so offsets breaking the contract give unspecified but
    memory-safe, deterministic results); K % 32 == 0. Both operands are quantised with rceil
    scales along K: a row-wise (``to_mxfp8``), each b[e] column-wise (``to_mxfp8_dim1``, blocks
    of 32 along K).
    Returns (M, N) ``out_dtype`` (bfloat16 or float32); rows past offsets[-1] are zero.

    Runs ``torch._scaled_grouped_mm`` with blocked scales on compute capability 10.x; elsewhere an
    emulation with the same numerics (dequantise exactly to bf16, then ``torch._grouped_mm`` on
    CUDA sm90+, or a per-expert masked GEMM with static shapes, fp32 accumulation).

    Differentiable in a and b (torchao's MXFP8 training recipe, every cast rceil): dA = q(dY along
    N) @ q(b[g] along N).T, dB[e] = q(a_e along M).T @ q(dY_e along M) with blocks of 32 rows from
    each group's start; emulated exactly on every device, sync-free and deterministic. Saves only
    a, b and offsets. Details, and what sm100 would run: ``moe_kernels._mxfp8_train``.
    """
    v.dtype("a", a, (torch.bfloat16,))
    v.dtype("b", b, (torch.bfloat16,))
    v.rank("a", a, 2)
    v.rank("b", b, 3)
    v.dtype("offsets", offsets, (torch.int32,))
    v.rank("offsets", offsets, 1)
    v.same_device("a", a, b=b, offsets=offsets)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    M, K = a.shape
    E, Kb, N = b.shape
    if K % BLOCK:
        raise ValueError(f"a's K must be a multiple of 32, got shape {tuple(a.shape)}")
    v.dim_size("b", b, 1, K, "K, matching a")
    v.dim_size("offsets", offsets, 0, E, "one end offset per expert of b")
    return mxfp8_grouped_mm_op.call(a, b, offsets, out_dtype)
