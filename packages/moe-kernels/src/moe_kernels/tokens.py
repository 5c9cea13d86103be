"""Token movement for MoE layers driven by a ``moe_kernels.routing.RoutingPlan``:
``dispatch(x, plan)`` / ``combine(y, plan)``, the arrows around the grouped GEMMs, and
``gather_dots``, their backward's gather-and-dot pass. FBGEMM's dense-token ops are in
``dense_tokens.py``.

All three are ``torch.library`` custom ops (``moe_kernels::<name>``) with fake implementations:
no host syncs on CUDA, safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no
float atomics. Index tensors may be int32 or int64; float inputs may be non-contiguous (the kernels
take strides). Indices must lie in [-1, rows): an out-of-range index is treated as -1 by the
kernels (memory-safe) and is undefined behaviour by contract.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import tokens as _ref
from moe_kernels.routing import RoutingPlan

__all__ = ["combine", "dispatch"]


def _triton():
    return triton_kernels("tokens")  # imported on first use: triton only when a kernel runs


# --------------------------------------------------------------------------------------------
# dispatch / combine (RoutingPlan driven)


def _dispatch_impl(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor,
    scale: bool,
) -> torch.Tensor:
    if not use_triton(x.device):
        return _ref.dispatch(x, token_indices, weights, scale)
    tri = _triton()
    return tri.gather_rows(
        x,
        token_indices.contiguous(),
        mode=tri.SCALE_ROW if scale else tri.SCALE_NONE,
        scale=weights.contiguous() if scale else None,
    )


def _dispatch_fake(x, token_indices, weights, inverse, scale):
    return x.new_empty((token_indices.shape[0], x.shape[1]))


dispatch_op = register_op("dispatch", _dispatch_impl, _dispatch_fake)


def _dispatch_setup(ctx, inputs, output):
    x, token_indices, weights, inverse, scale = inputs
    ctx.save_for_backward(x, token_indices, weights, inverse)
    ctx.scale = scale


def _dispatch_backward(ctx, grad_PD):
    """dx = ``combine`` of the incoming rows (weighted when scaled): each token's k rows summed
    in j order through the inverse map, in fp32; d weights[p] = grad[p] . x[tok[p]] (scaled)."""
    x, tok, weights, inverse = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        # In x's dtype from the op (fp32 sums, one rounding): a torch cast here would be fused
        # with the addition of x's other gradients by Inductor, skipping the rounding.
        grad_x = combine_op.call(grad_PD, inverse, tok, weights, ctx.scale, x.dtype)
    if ctx.scale and ctx.needs_input_grad[2]:
        grad_w = gather_dots_op.call(grad_PD, x, tok, None, None)[1]
    return grad_x, None, grad_w, None, None


dispatch_op.register_autograd(_dispatch_backward, _dispatch_setup)


def _gather_dots_impl(
    a_PD: torch.Tensor | None,
    b_TD: torch.Tensor,
    tok: torch.Tensor,
    w: torch.Tensor | None,
    rows_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's gathered rows ``(w *) b[tok]`` and row dots ``a . b[tok]`` in one pass
    (``_triton/tokens_backward.py``); a result not asked for is an empty tensor."""
    if use_triton(b_TD.device):
        rows, dots = triton_kernels("tokens_backward").gather_dots(a_PD, b_TD, tok, w, rows_dtype)
    else:
        rows, dots = _ref.gather_dots(a_PD, b_TD, tok, w, rows_dtype)
    empty = b_TD.new_empty
    return (
        empty((0, b_TD.shape[1])) if rows is None else rows,
        empty(0, dtype=torch.float32) if dots is None else dots,
    )


def _gather_dots_fake(a_PD, b_TD, tok, w, rows_dtype):
    n = tok.shape[0]
    rows = b_TD.new_empty((n if rows_dtype is not None else 0, b_TD.shape[1]), dtype=rows_dtype)
    return rows, b_TD.new_empty(n if a_PD is not None else 0, dtype=torch.float32)


# The weight gradients of dispatch (scaled) and combine, and combine's row gradients.
gather_dots_op = register_op("gather_dots", _gather_dots_impl, _gather_dots_fake)


def _combine_impl(
    y: torch.Tensor,
    inverse: torch.Tensor,
    token_indices: torch.Tensor,
    weights: torch.Tensor,
    weighted: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if not use_triton(y.device):
        return _ref.combine(y, inverse, weights, weighted, out_dtype)
    return _triton().combine(y, inverse, weights.contiguous() if weighted else None, out_dtype)


def _combine_fake(y, inverse, token_indices, weights, weighted, out_dtype):
    return y.new_empty((inverse.shape[0], y.shape[1]), dtype=out_dtype)


combine_op = register_op("combine", _combine_impl, _combine_fake)


def _combine_setup(ctx, inputs, output):
    y, inverse, tok, weights, weighted, out_dtype = inputs
    ctx.save_for_backward(y, inverse, tok, weights)
    ctx.weighted = weighted


def _combine_backward(ctx, grad_TD):
    """dy[p] = weights[p] * grad[tok[p]] (unscaled when not weighted), in fp32 then cast;
    d weights[p] = y[p] . grad[tok[p]] in fp32: one gather pass, no reduction across rows."""
    y, inverse, tok, weights = ctx.saved_tensors
    grad_y = grad_w = None
    want_w = ctx.weighted and ctx.needs_input_grad[3]
    rows_dtype = y.dtype if ctx.needs_input_grad[0] else None
    if rows_dtype is None and not want_w:  # (weights that need a gradient, but unweighted)
        return None, None, None, None, None, None
    # One pass over grad[tok[p]]; in y's dtype from the op (fp32 math, one rounding: no torch
    # cast that Inductor could fuse away).
    rows, dots = gather_dots_op.call(
        y if want_w else None, grad_TD, tok, weights if ctx.weighted else None, rows_dtype
    )
    grad_y = rows if ctx.needs_input_grad[0] else None
    grad_w = dots if want_w else None
    return grad_y, None, None, grad_w, None, None


combine_op.register_autograd(_combine_backward, _combine_setup)


def _check_plan(plan: object, ref_name: str, ref: torch.Tensor) -> RoutingPlan:
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be a RoutingPlan, got {type(plan).__name__}")
    tok = V.index_1d("plan.token_indices", plan.token_indices, ref_name, ref)
    V.tensor("plan.weights", plan.weights)
    V.dtype("plan.weights", plan.weights, V.FLOAT_DTYPES)
    V.rank("plan.weights", plan.weights, 1)
    V.same_device(ref_name, ref, **{"plan.weights": plan.weights})
    V.dim_size("plan.weights", plan.weights, 0, tok.shape[0], "len(plan.token_indices)")
    V.tensor("plan.inverse", plan.inverse)
    V.dtype("plan.inverse", plan.inverse, V.INDEX_DTYPES)
    V.rank("plan.inverse", plan.inverse, 2)
    V.same_device(ref_name, ref, **{"plan.inverse": plan.inverse})
    return plan


def dispatch(x: torch.Tensor, plan: RoutingPlan, *, scale: bool = False) -> torch.Tensor:
    """Rows of x in the plan's expert-sorted order: the input of the grouped GEMMs.

    x: (T, D) float32/bf16/fp16 (may be strided). Returns (T*top_k, D) in x's dtype with
    ``out[p] = x[plan.token_indices[p]]`` (times ``plan.weights[p]`` in fp32 when ``scale``);
    tail rows (token index -1) are zero. Differentiable in x (and in ``plan.weights`` when
    ``scale``): the backward is an unweighted (weighted) ``combine``.
    """
    x = V.float_2d("x", x)
    plan = _check_plan(plan, "x", x)
    V.dim_size("x", x, 0, plan.inverse.shape[0], "T, the rows of plan.inverse")
    if not isinstance(scale, bool):
        raise TypeError(f"scale must be a bool, got {type(scale).__name__}")
    return dispatch_op.call(x, plan.token_indices, plan.weights, plan.inverse, scale)


def combine(
    y: torch.Tensor,
    plan: RoutingPlan,
    *,
    weighted: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sum each token's expert outputs back into token order.

    y: (T*top_k, D) float32/bf16/fp16 in the plan's sorted order. Returns (T, D) in ``out_dtype``
    (default y's dtype; float32/bf16/fp16) with ``out[t] = sum_j weights[inv[t, j]] * y[inv[t, j]]``
    (``inv = plan.inverse``; unweighted when ``weighted=False``; entries -1 skipped), accumulated
    in fp32 in j order (product, then sum: no fused multiply-add), bitwise reproducible.
    Differentiable in y and ``plan.weights`` (backward: a scaled ``dispatch`` and one dot per
    row).
    """
    y = V.float_2d("y", y)
    plan = _check_plan(plan, "y", y)
    V.dim_size("y", y, 0, plan.token_indices.shape[0], "T*top_k, the length of the plan")
    if not isinstance(weighted, bool):
        raise TypeError(f"weighted must be a bool, got {type(weighted).__name__}")
    if out_dtype is None:
        out_dtype = y.dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    if out_dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype}")
    return combine_op.call(y, plan.inverse, plan.token_indices, plan.weights, weighted, out_dtype)
