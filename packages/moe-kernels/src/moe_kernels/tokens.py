"""Token movement for MoE layers: gather/scatter (FBGEMM-compatible), dispatch and combine.

* ``gather_scale_dense_tokens`` / ``scatter_add_dense_tokens``: same names, arguments and results
  as ``fbgemm_gpu.experimental.gen_ai.moe``, but dead rows are zero, the scatter declares its
  mutation (so ``torch.compile`` sees it) and is bitwise reproducible.
* ``dispatch(x, plan)`` / ``combine(y, plan)``: the arrows around the grouped GEMMs, driven by a
  ``moe_kernels.routing.RoutingPlan``.

All four are ``torch.library`` custom ops (``moe_kernels::<name>``) with fake implementations:
no host syncs on CUDA, safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no
float atomics. Index tensors may be int32 or int64; float inputs may be non-contiguous (the kernels
take strides). Indices must lie in [-1, rows): an out-of-range index is treated as -1 by the
kernels (memory-safe) and is undefined behaviour by contract.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import (
    eager_direct,
    pick,
    register_autograd,
    register_op,
    triton_kernels,
    use_triton,
)
from moe_kernels.reference import tokens as _ref
from moe_kernels.routing import RoutingPlan

__all__ = ["combine", "dispatch", "gather_scale_dense_tokens", "scatter_add_dense_tokens"]


def _triton():
    return triton_kernels("tokens")  # imported on first use: triton only when a kernel runs


# --------------------------------------------------------------------------------------------
# gather_scale_dense_tokens


def _gather_scale_impl(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> torch.Tensor:
    if not use_triton(x.device):
        return _ref.gather_scale_dense_tokens(
            x, token_indices, expert_indices, scores, valid_token_count
        )
    return _triton().gather_rows(
        x,
        token_indices.contiguous(),
        mode=_triton().SCALE_SCORES,
        scale=scores,
        expert_indices_N=expert_indices.contiguous(),
        valid_token_count=valid_token_count,
    )


def _gather_scale_fake(x, token_indices, expert_indices, scores, valid_token_count):
    return x.new_empty((token_indices.shape[0], x.shape[1]))


_gather_scale_op = register_op("gather_scale_dense_tokens", _gather_scale_impl, _gather_scale_fake)


def _gather_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gather_scale_backward(ctx, grad_ND):
    """dx[t] = sum over live rows i of token t of grad[i] * s_i, dscores[t, e] = the sum over
    live rows of the pair (t, e) of grad[i] . x[t]: both through ``scatter_add_dense_tokens``
    into fp32 (ascending i, no atomics), then cast."""
    x, tok, exp, scores, vtc = ctx.saved_tensors
    T, E = scores.shape
    if T == 0 or E == 0:  # every row is dead (and there is nothing to index)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_s = torch.zeros_like(scores) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_s, None
    live = _ref.row_mask(tok, T, vtc) & (exp >= 0) & (exp < E)
    dead = torch.full_like(tok, -1)
    safe_tok = torch.where(live, tok, 0).long()
    grad32 = grad_ND.float()
    grad_x = grad_s = None
    if ctx.needs_input_grad[0]:
        scale = scores.float()[safe_tok, torch.where(live, exp, 0).long()]
        grad_x = x.new_zeros(x.shape, dtype=torch.float32)
        _scatter_add_op(grad_x, grad32 * scale[:, None], torch.where(live, tok, dead), None)
        grad_x = grad_x.to(x.dtype)
    if ctx.needs_input_grad[3]:
        dots = (grad32 * x.float()[safe_tok]).sum(dim=1, keepdim=True)
        flat = torch.where(live, tok.long() * E + exp.long(), -1)
        grad_s = scores.new_zeros((T * E, 1), dtype=torch.float32)
        _scatter_add_op(grad_s, dots, flat, None)
        grad_s = grad_s.view(T, E).to(scores.dtype)
    return grad_x, None, None, grad_s, None


_gather_scale_op.register_autograd(_gather_scale_backward, setup_context=_gather_scale_setup)


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather token rows into the shuffled (expert-sorted) order, scaled by their router score.

    x: (T, D) float32/bf16/fp16; token_indices, expert_indices: (N,) int32/int64; scores: (T, E)
    float; valid_token_count: optional one-element int tensor (the number of valid rows of the
    shuffled list, read on the device). Returns (N, D) in x's dtype with
    ``out[i] = x[tok[i]] * scores[tok[i], exp[i]]`` computed in fp32; rows with token index -1,
    expert index -1, or i >= valid_token_count are zero.

    Differentiable in x and scores (deterministic: the per-token sums run in ascending i through
    the scatter below, in fp32).
    """
    x = V.float_2d("x", x)
    token_indices = V.index_1d("token_indices", token_indices, "x", x)
    expert_indices = V.index_1d("expert_indices", expert_indices, "x", x)
    scores = V.float_2d("scores", scores)
    V.same_device("x", x, scores=scores)
    V.dim_size("scores", scores, 0, x.shape[0], "T, the rows of x")
    V.dim_size("expert_indices", expert_indices, 0, token_indices.shape[0], "len(token_indices)")
    V.valid_token_count(valid_token_count, "x", x)
    op = _gather_scale_impl if eager_direct(x, scores, valid_token_count) else _gather_scale_op
    return op(x, token_indices, expert_indices, scores, valid_token_count)


# --------------------------------------------------------------------------------------------
# scatter_add_dense_tokens


def _scatter_add_impl(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> None:
    if not use_triton(out_tokens.device):
        _ref.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)
        return
    if out_tokens.numel() == 0 or in_tokens.shape[0] == 0:
        return
    src_N, bounds_T1 = _ref.scatter_order(token_indices, out_tokens.shape[0], valid_token_count)
    _triton().scatter_add_sorted(out_tokens, in_tokens, src_N, bounds_T1)


def _scatter_add_fake(out_tokens, in_tokens, token_indices, valid_token_count):
    return None


_scatter_add_op = register_op(
    "scatter_add_dense_tokens", _scatter_add_impl, _scatter_add_fake, mutates_args=("out_tokens",)
)


def _scatter_added_impl(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> torch.Tensor:
    new = out_tokens.clone()
    _scatter_add_impl(new, in_tokens, token_indices, valid_token_count)
    return new


def _scatter_added_fake(out_tokens, in_tokens, token_indices, valid_token_count):
    return torch.empty_like(out_tokens)


# The functional form autograd differentiates (torch.library registers no autograd formula on an
# op that mutates its inputs): ``scatter_add_dense_tokens`` runs it, then copies the result into
# out_tokens, when a gradient is needed.
_scatter_added_op = register_op(
    "scatter_added_dense_tokens", _scatter_added_impl, _scatter_added_fake
)


def _scatter_added_setup(ctx, inputs, output):
    _, in_tokens, token_indices, vtc = inputs
    ctx.save_for_backward(token_indices, vtc)
    ctx.in_dtype = in_tokens.dtype


def _scatter_added_backward(ctx, grad_TD):
    """d out_tokens = grad; d in_tokens[i] = grad[tok[i]] (zero for skipped entries)."""
    tok, vtc = ctx.saved_tensors
    live = _ref.row_mask(tok, grad_TD.shape[0], vtc)
    grad_in = _ref.gather_rows(grad_TD, tok, None, live).to(ctx.in_dtype)
    return grad_TD, grad_in, None, None


_scatter_added_op.register_autograd(_scatter_added_backward, setup_context=_scatter_added_setup)


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> None:
    """In place ``out_tokens[token_indices[i]] += in_tokens[i]``, deterministically.

    out_tokens: (T, D) float32/bf16/fp16, or int32/int64 (may be a strided view); in_tokens:
    (N, D), float (any of the three, may differ from out's) for a float out, int32/int64 for an
    integer out; token_indices: (N,) int32/int64; valid_token_count: as in
    ``gather_scale_dense_tokens``. Entries with index -1 or i >= valid_token_count are skipped.

    Ordering: the contributions to one destination row are added in ascending i, each add done in
    fp32 and rounded to out's dtype, i.e. exactly the sequential loop
    ``for i in range(N): out[tok[i]] = (out[tok[i]].float() + in[i].float()).to(out.dtype)``.
    Integer adds are exact in out's dtype (two's complement, wrapping on overflow like FBGEMM's
    integer atomics), so their order does not matter. Bitwise reproducible on every backend (a
    stable sort of the destinations, then one program per destination row; no atomics).

    Differentiable (float out) in out_tokens and in_tokens when autograd records: the sum is
    then computed out of place and copied into out_tokens (one extra copy of out_tokens).
    """
    out_tokens = V.tensor("out_tokens", out_tokens)
    V.dtype("out_tokens", out_tokens, V.FLOAT_DTYPES + V.INDEX_DTYPES)
    V.rank("out_tokens", out_tokens, 2)
    int_add = not out_tokens.dtype.is_floating_point
    in_tokens = V.tensor("in_tokens", in_tokens)
    V.dtype("in_tokens", in_tokens, V.INDEX_DTYPES if int_add else V.FLOAT_DTYPES)
    V.rank("in_tokens", in_tokens, 2)
    token_indices = V.index_1d("token_indices", token_indices, "out_tokens", out_tokens)
    V.same_device("out_tokens", out_tokens, in_tokens=in_tokens)
    V.dim_size("in_tokens", in_tokens, 1, out_tokens.shape[1], "D of out_tokens")
    V.dim_size("in_tokens", in_tokens, 0, token_indices.shape[0], "len(token_indices)")
    V.valid_token_count(valid_token_count, "out_tokens", out_tokens)
    if int_add or not torch.is_grad_enabled():
        needs_grad = False
    else:
        needs_grad = out_tokens.requires_grad or in_tokens.requires_grad
    if needs_grad:
        new = _scatter_added_op(out_tokens, in_tokens, token_indices, valid_token_count)
        out_tokens.copy_(new)
    elif eager_direct(out_tokens, in_tokens, valid_token_count):
        _scatter_add_impl(out_tokens, in_tokens, token_indices, valid_token_count)
        torch.autograd.graph.increment_version(out_tokens)  # what the custom op does for us
    else:
        _scatter_add_op(out_tokens, in_tokens, token_indices, valid_token_count)


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


_dispatch_op = register_op("dispatch", _dispatch_impl, _dispatch_fake)


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
        grad_x = _combine_op(grad_PD, inverse, tok, weights, ctx.scale, x.dtype)
    if ctx.scale and ctx.needs_input_grad[2]:
        grad_w = _gather_dots_op(grad_PD, x, tok, None, None)[1]
    return grad_x, None, grad_w, None, None


_dispatch_eager = register_autograd(
    _dispatch_op, _dispatch_impl, _dispatch_backward, _dispatch_setup
)


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
_gather_dots_op = register_op("gather_dots", _gather_dots_impl, _gather_dots_fake)


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


_combine_op = register_op("combine", _combine_impl, _combine_fake)


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
    rows, dots = _gather_dots_op(
        y if want_w else None, grad_TD, tok, weights if ctx.weighted else None, rows_dtype
    )
    grad_y = rows if ctx.needs_input_grad[0] else None
    grad_w = dots if want_w else None
    return grad_y, None, None, grad_w, None, None


_combine_eager = register_autograd(_combine_op, _combine_impl, _combine_backward, _combine_setup)


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
    op = pick(_dispatch_op, _dispatch_impl, _dispatch_eager, x, plan.weights if scale else None)
    return op(x, plan.token_indices, plan.weights, plan.inverse, scale)


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
    op = pick(_combine_op, _combine_impl, _combine_eager, y, plan.weights if weighted else None)
    return op(y, plan.inverse, plan.token_indices, plan.weights, weighted, out_dtype)
