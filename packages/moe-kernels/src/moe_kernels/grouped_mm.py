"""Grouped GEMMs for MoE experts: the forward one that gathers its A rows and fuses the
activation, and the K-grouped one of its weight gradient.

``gather_grouped_mm(x, w, offsets, row_indices, activation="silu")`` replaces
``dispatch`` + ``torch._grouped_mm`` + ``F.silu`` of an MoE layer's first expert GEMM by one
kernel; with ``row_indices=None`` it is a plain grouped GEMM (the second expert GEMM).
``grouped_weight_grad(dy, x, offsets, row_indices)`` is each expert's ``dy_e.T @ x_e``.
At a decode step's few rows the plan runs both forward GEMMs as a grouped GEMV
(``grouped_gemv_op``: one read of each touched expert's weights, SiLU or SwiGLU fused).

Both are ``torch.library`` custom ops (``moe_kernels::<name>``) with fake implementations: on
CUDA no host syncs (static grids, groups found on the device), safe under
``torch.compile(fullgraph=True)`` and CUDA-graph capture, deterministic (no split-K, no atomics).
``gather_grouped_mm`` is differentiable in x and w (backward below).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels
from moe_kernels._gemm_plan import plan_rows, plan_wgrad
from moe_kernels.reference import grouped_mm as _ref
from moe_kernels.reference import tokens as _ref_tokens

__all__ = ["ACTIVATIONS", "gather_grouped_mm", "grouped_weight_grad"]

ACTIVATIONS: tuple[str | None, ...] = (None, "silu")


def _triton():
    return triton_kernels("grouped_mm")  # imported on first use: triton only when a kernel runs


def _impl(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None,
    activation: str,
    zero_tail: bool = True,
) -> torch.Tensor:
    """The kernel ``_gemm_plan.plan_rows`` chooses. ``zero_tail=False`` (callers that never
    read rows past the groups): the persistent GEMM and CUTLASS then leave those rows unwritten
    instead of a launch zeroing them (the Triton GEMMs zero them in their own launch)."""
    act = None if activation == "none" else activation
    plan = plan_rows(x, w, row_indices, act is not None)
    if plan.kernel == "reference":
        return _ref.gather_grouped_mm(x, w, offsets, row_indices, act)
    if plan.kernel == "gemv":
        return _gemv_impl(x, w, offsets, row_indices, activation)
    tri = _triton()
    if plan.kernel in ("persistent", "cutlass"):
        if plan.kernel == "persistent":
            w_sorted = w.mT if plan.layout == "kn" else w
            y = triton_kernels("persistent_grouped_mm").persistent_grouped_mm(
                x, w_sorted, offsets.contiguous(), plan.layout, plan.config
            )
        else:
            y = torch._grouped_mm(x, w.mT, offs=_ref.clamp_offsets(offsets, x.shape[0]))
        if zero_tail:
            tri.zero_tail(y, offsets)
        return y
    return tri.gather_grouped_mm(
        x,
        w,
        offsets.contiguous(),
        row_indices.contiguous() if row_indices is not None else None,
        tri.ACT_SILU if act == "silu" else tri.ACT_NONE,
    )


def _fake(x, w, offsets, row_indices, activation, zero_tail=True):
    num_rows = x.shape[0] if row_indices is None else row_indices.shape[0]
    return x.new_empty((num_rows, w.shape[1]))


gather_grouped_mm_op = register_op("gather_grouped_mm", _impl, _fake)


def _gemv_impl(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """The grouped GEMV (``_triton/grouped_gemv.py``), whatever the plan: for callers whose
    plan chose "gemv" (the plan's rule: few rows in all). ``activation``: "none", "silu" or
    "swiglu" (w's gate rows first, the output H = N / 2 wide: expert_mlp's no-grad
    up-projection)."""
    return triton_kernels("grouped_gemv").grouped_gemv(
        x,
        w,
        offsets.contiguous(),
        row_indices.contiguous() if row_indices is not None else None,
        activation,
    )


def _gemv_fake(x, w, offsets, row_indices, activation):
    num_rows = x.shape[0] if row_indices is None else row_indices.shape[0]
    return x.new_empty((num_rows, w.shape[1] // 2 if activation == "swiglu" else w.shape[1]))


grouped_gemv_op = register_op("grouped_gemv", _gemv_impl, _gemv_fake)


def _setup_context(ctx, inputs, output):
    x, w, offsets, row_indices, activation = inputs[:5]
    ctx.save_for_backward(x, w, offsets, row_indices)
    ctx.activation = activation


def _backward(ctx, grad_PN):
    """dz = dy * silu'(z) (z recomputed: one more forward GEMM, no saved activation);
    dx = the per-token sum, in ascending p, of the rows ``dz @ w[e]`` (a grouped GEMM with the
    transposed weights, then ``scatter_add_dense_tokens`` into fp32); dw = ``grouped_weight_grad``.
    """
    from moe_kernels.activation import expert_activation_backward_op
    from moe_kernels.dense_tokens import scatter_add_dense_tokens_op

    x, w, offsets, rows = ctx.saved_tensors
    grad_PN = grad_PN.to(x.dtype)
    if ctx.activation == "silu":  # z in x's dtype: the fp32 accumulator rounded once
        z = gather_grouped_mm_op.call(x, w, offsets, rows, "none")
        grad_PN = expert_activation_backward_op.call(grad_PN, z, False)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        dx_PD = gather_grouped_mm_op.call(grad_PN, w.mT, offsets, None, "none")
        if rows is None:
            grad_x = dx_PD
        else:
            grad_x = x.new_zeros(x.shape, dtype=torch.float32)
            scatter_add_dense_tokens_op.call(grad_x, dx_PD, rows, None)
            grad_x = grad_x.to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_w = grouped_weight_grad_op.call(grad_PN, x, offsets, rows, w.dtype)
    return grad_x, grad_w, None, None, None, None


gather_grouped_mm_op.register_autograd(_backward, _setup_context)


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
    Offsets are read on the device: they must be non-decreasing from offsets[0] = 0 and <= P
    (not checked, that would sync). Every path clamps them by one rule, so any offsets are
    memory-safe and give the same result on each path: offsets[0] reads as 0 and each later
    offset is clamped into [the previous clamped offset, P] (the running maximum of the offsets
    clamped into [0, P]; ``reference.grouped_mm.group_bounds``). E = 0 (no experts) gives
    zeros.

    Differentiable in x_TD and w_END (backward: two grouped GEMMs, plus one that recomputes the
    pre-activation when ``activation="silu"``; deterministic, see ``_backward``).
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
    return gather_grouped_mm_op.call(x_TD, w_END, offsets, row_indices, act)


# --------------------------------------------------------------------------------------------
# grouped_weight_grad


def _wgrad_impl(
    dy_PN: torch.Tensor,
    x_TD: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The kernel ``_gemm_plan.plan_wgrad`` chooses."""
    plan = plan_wgrad(dy_PN, x_TD, offsets.shape[0] - 1, row_indices is not None)
    if plan.kernel == "reference":
        return _ref.grouped_weight_grad(dy_PN, x_TD, offsets, row_indices, out_dtype)
    if plan.kernel == "cutlass":
        if row_indices is None:
            x_PD = x_TD
        else:  # the sorted rows CUTLASS reads (zero where the index is outside [0, T))
            live = _ref_tokens.row_mask(row_indices, x_TD.shape[0], None)
            x_PD = _ref_tokens.gather_rows(x_TD, row_indices, None, live)
        offs = _ref.clamp_offsets(offsets, dy_PN.shape[0])
        return torch._grouped_mm(dy_PN.mT, x_PD, offs=offs).to(out_dtype)
    return triton_kernels("grouped_weight_grad").grouped_weight_grad(
        dy_PN,
        x_TD,
        offsets.contiguous(),
        row_indices.contiguous() if row_indices is not None else None,
        out_dtype,
        plan.config,
    )


def _wgrad_fake(dy_PN, x_TD, offsets, row_indices, out_dtype):
    return dy_PN.new_empty((offsets.shape[0] - 1, dy_PN.shape[1], x_TD.shape[1]), dtype=out_dtype)


grouped_weight_grad_op = register_op("grouped_weight_grad", _wgrad_impl, _wgrad_fake)


def grouped_weight_grad(
    dy_PN: torch.Tensor,
    x_TD: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-expert ``dy_e.T @ x_e``: the weight gradient of ``gather_grouped_mm``.

    dy_PN: (P, N) bf16/fp16/fp32 rows in expert-sorted order; x_TD: (T, D), dy's dtype; offsets
    and row_indices as in ``gather_grouped_mm`` (``row_indices=None``: P = T, source row p).
    Returns (E, N, D) in ``out_dtype`` (default dy's dtype) with
    ``out[e] = sum over offsets[e] <= p < offsets[e+1] of outer(dy[p], x[row_indices[p]])``
    accumulated in fp32; rows whose index is outside [0, T) add nothing; an empty group gives
    zeros. Offsets clamped as in ``gather_grouped_mm`` (memory-safe for any values; the same
    result on each path). Deterministic (each group's rows summed in one fixed order, no split
    over rows): the kernel ``_gemm_plan.choose_gemm`` picks, the persistent Triton kernel, or on
    sm90+ bf16 with 16-aligned N and D above a few rows per expert ``torch._grouped_mm``'s
    K-grouped CUTLASS GEMM.
    """
    dy_PN = V.tensor("dy_PN", dy_PN)
    V.dtype("dy_PN", dy_PN, V.FLOAT_DTYPES)
    V.rank("dy_PN", dy_PN, 2)
    x_TD = V.tensor("x_TD", x_TD)
    V.rank("x_TD", x_TD, 2)
    if x_TD.dtype != dy_PN.dtype:
        raise TypeError(f"x_TD must have dy_PN's dtype {dy_PN.dtype}, got {x_TD.dtype}")
    V.same_device("dy_PN", dy_PN, x_TD=x_TD)
    offsets = V.tensor("offsets", offsets)
    V.dtype("offsets", offsets, V.INDEX_DTYPES)
    V.rank("offsets", offsets, 1)
    V.same_device("dy_PN", dy_PN, offsets=offsets)
    if offsets.shape[0] < 1:
        raise ValueError("offsets must have E+1 >= 1 entries, got shape (0,)")
    if row_indices is None:
        V.dim_size("dy_PN", dy_PN, 0, x_TD.shape[0], "T, the rows of x_TD (no row_indices)")
    else:
        row_indices = V.tensor("row_indices", row_indices)
        V.dtype("row_indices", row_indices, V.INDEX_DTYPES)
        V.rank("row_indices", row_indices, 1)
        V.same_device("dy_PN", dy_PN, row_indices=row_indices)
        V.dim_size("row_indices", row_indices, 0, dy_PN.shape[0], "P, the rows of dy_PN")
    if out_dtype is None:
        out_dtype = dy_PN.dtype
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
    return grouped_weight_grad_op.call(dy_PN, x_TD, offsets, row_indices, out_dtype)
