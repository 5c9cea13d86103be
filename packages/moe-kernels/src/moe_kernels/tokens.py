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
from moe_kernels._dispatch import eager_direct, register_op, triton_kernels, use_triton
from moe_kernels._reference import tokens as _ref
from moe_kernels.routing import RoutingPlan

__all__ = ["combine", "dispatch", "gather_scale_dense_tokens", "scatter_add_dense_tokens"]


def _triton():
    return triton_kernels("tokens")  # imported on first use: triton only when a kernel runs


def _index_1d(name: str, t: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    t = V.tensor(name, t)
    V.dtype(name, t, V.INDEX_DTYPES)
    V.rank(name, t, 1)
    V.same_device(ref_name, ref, **{name: t})
    return t


def _float_2d(name: str, t: object) -> torch.Tensor:
    t = V.tensor(name, t)
    V.dtype(name, t, V.FLOAT_DTYPES)
    V.rank(name, t, 2)
    return t


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
    """
    x = _float_2d("x", x)
    token_indices = _index_1d("token_indices", token_indices, "x", x)
    expert_indices = _index_1d("expert_indices", expert_indices, "x", x)
    scores = _float_2d("scores", scores)
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
    """
    out_tokens = V.tensor("out_tokens", out_tokens)
    V.dtype("out_tokens", out_tokens, V.FLOAT_DTYPES + V.INDEX_DTYPES)
    V.rank("out_tokens", out_tokens, 2)
    int_add = not out_tokens.dtype.is_floating_point
    in_tokens = V.tensor("in_tokens", in_tokens)
    V.dtype("in_tokens", in_tokens, V.INDEX_DTYPES if int_add else V.FLOAT_DTYPES)
    V.rank("in_tokens", in_tokens, 2)
    token_indices = _index_1d("token_indices", token_indices, "out_tokens", out_tokens)
    V.same_device("out_tokens", out_tokens, in_tokens=in_tokens)
    V.dim_size("in_tokens", in_tokens, 1, out_tokens.shape[1], "D of out_tokens")
    V.dim_size("in_tokens", in_tokens, 0, token_indices.shape[0], "len(token_indices)")
    V.valid_token_count(valid_token_count, "out_tokens", out_tokens)
    if eager_direct(out_tokens, in_tokens, valid_token_count):
        _scatter_add_impl(out_tokens, in_tokens, token_indices, valid_token_count)
        torch.autograd.graph.increment_version(out_tokens)  # what the custom op does for us
    else:
        _scatter_add_op(out_tokens, in_tokens, token_indices, valid_token_count)


# --------------------------------------------------------------------------------------------
# dispatch / combine (RoutingPlan driven)


def _dispatch_impl(
    x: torch.Tensor, token_indices: torch.Tensor, weights: torch.Tensor, scale: bool
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


def _dispatch_fake(x, token_indices, weights, scale):
    return x.new_empty((token_indices.shape[0], x.shape[1]))


_dispatch_op = register_op("dispatch", _dispatch_impl, _dispatch_fake)


def _combine_impl(
    y: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    weighted: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if not use_triton(y.device):
        return _ref.combine(y, inverse, weights, weighted, out_dtype)
    return _triton().combine(y, inverse, weights.contiguous() if weighted else None, out_dtype)


def _combine_fake(y, inverse, weights, weighted, out_dtype):
    return y.new_empty((inverse.shape[0], y.shape[1]), dtype=out_dtype)


_combine_op = register_op("combine", _combine_impl, _combine_fake)


def _check_plan(plan: object, ref_name: str, ref: torch.Tensor) -> RoutingPlan:
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be a RoutingPlan, got {type(plan).__name__}")
    tok = _index_1d("plan.token_indices", plan.token_indices, ref_name, ref)
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
    tail rows (token index -1) are zero.
    """
    x = _float_2d("x", x)
    plan = _check_plan(plan, "x", x)
    V.dim_size("x", x, 0, plan.inverse.shape[0], "T, the rows of plan.inverse")
    if not isinstance(scale, bool):
        raise TypeError(f"scale must be a bool, got {type(scale).__name__}")
    op = _dispatch_impl if eager_direct(x) else _dispatch_op
    return op(x, plan.token_indices, plan.weights, scale)


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
    """
    y = _float_2d("y", y)
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
    op = _combine_impl if eager_direct(y) else _combine_op
    return op(y, plan.inverse, plan.weights, weighted, out_dtype)
