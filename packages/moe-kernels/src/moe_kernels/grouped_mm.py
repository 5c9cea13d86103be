"""Grouped GEMM for MoE experts that gathers its A rows and fuses the activation.

``gather_grouped_mm(x, w, offsets, row_indices, activation="silu")`` replaces
``dispatch`` + ``torch._grouped_mm`` + ``F.silu`` of an MoE layer's first expert GEMM by one
kernel; with ``row_indices=None`` it is a plain grouped GEMM (the second expert GEMM).

A ``torch.library`` custom op (``moe_kernels::gather_grouped_mm``) with a fake implementation:
on CUDA no host syncs (static grid, groups found on the device), safe under
``torch.compile(fullgraph=True)`` and CUDA-graph capture, deterministic (no split-K, no atomics).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import eager_direct, register_op, triton_kernels, use_triton
from moe_kernels._reference import grouped_mm as _ref

__all__ = ["ACTIVATIONS", "gather_grouped_mm"]

ACTIVATIONS: tuple[str | None, ...] = (None, "silu")


def _triton():
    return triton_kernels("grouped_mm")  # imported on first use: triton only when a kernel runs


def _impl(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    act = None if activation == "none" else activation
    if not use_triton(x.device):
        return _ref.gather_grouped_mm(x, w, offsets, row_indices, act)
    tri = _triton()
    return tri.gather_grouped_mm(
        x,
        w,
        offsets.contiguous(),
        row_indices.contiguous() if row_indices is not None else None,
        tri.ACT_SILU if act == "silu" else tri.ACT_NONE,
    )


def _fake(x, w, offsets, row_indices, activation):
    num_rows = x.shape[0] if row_indices is None else row_indices.shape[0]
    return x.new_empty((num_rows, w.shape[1]))


_op = register_op("gather_grouped_mm", _impl, _fake)


def gather_grouped_mm(
    x_TD: torch.Tensor,
    w_END: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Grouped ``act(x[rows] @ w[e].T)`` over expert-sorted rows.

    x_TD: (T, D) bf16/fp16/fp32 (may be strided). w_END: (E, N, D), x's dtype (an expert's weight
    as ``nn.Linear`` stores it: out x in; may be strided, e.g. a ``.mT`` view of (E, D, N)).
    offsets: (E+1,) int32/int64 exclusive prefix sum of the group sizes, offsets[0] = 0,
    offsets[E] = n <= P (e.g. ``RoutingPlan.offsets``). row_indices: (P,) int32/int64, the source
    row of x for each output row (``RoutingPlan.token_indices``, -1 in the tail), or None for
    ``rows = arange(T)`` (P = T, x already in sorted order). activation: None or "silu".

    Returns y_PN (P, N) in x's dtype: for offsets[e] <= p < offsets[e+1],
    ``y[p] = act(x[row_indices[p]] @ w[e].T)`` accumulated in fp32, the activation applied in fp32
    before the single cast; rows p >= offsets[E] and rows whose index is outside [0, T) are zero.
    Offsets are read on the device: they must be non-decreasing and <= P (not checked, that would
    sync; violating values are clamped to stay memory-safe, with unspecified results).
    """
    x_TD = V.tensor("x_TD", x_TD)
    V.dtype("x_TD", x_TD, V.FLOAT_DTYPES)
    V.rank("x_TD", x_TD, 2)
    w_END = V.tensor("w_END", w_END)
    V.rank("w_END", w_END, 3)
    if w_END.dtype != x_TD.dtype:
        raise TypeError(f"w_END must have x_TD's dtype {x_TD.dtype}, got {w_END.dtype}")
    V.same_device("x_TD", x_TD, w_END=w_END)
    V.dim_size("w_END", w_END, 2, x_TD.shape[1], "D, the columns of x_TD")
    offsets = V.tensor("offsets", offsets)
    V.dtype("offsets", offsets, V.INDEX_DTYPES)
    V.rank("offsets", offsets, 1)
    V.same_device("x_TD", x_TD, offsets=offsets)
    V.dim_size("offsets", offsets, 0, w_END.shape[0] + 1, "E+1, one more than w_END's experts")
    if row_indices is not None:
        row_indices = V.tensor("row_indices", row_indices)
        V.dtype("row_indices", row_indices, V.INDEX_DTYPES)
        V.rank("row_indices", row_indices, 1)
        V.same_device("x_TD", x_TD, row_indices=row_indices)
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    act = "none" if activation is None else activation
    op = _impl if eager_direct(x_TD, w_END) else _op
    return op(x_TD, w_END, offsets, row_indices, act)
