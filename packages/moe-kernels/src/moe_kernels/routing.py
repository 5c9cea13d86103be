"""MoE token routing: FBGEMM-compatible ``index_shuffling`` and the deterministic routing plan.

Both ops pick each token's ``top_k`` experts by score (NaN counts as -inf, ties go to the lower
expert, so a row of all -inf still picks ``top_k`` distinct experts 0..k-1) and sort the
(expert, token) pairs whose expert lies in ``[expert_index_start, expert_index_end)`` by expert,
then token. Rows at or past ``valid_token_count`` (a one-element device tensor, clamped to [0, T],
never read on the host) are not routed. CUDA runs the Triton kernels of ``_triton/routing/``
(one to four launches of the plan ``_triton/routing/plan.py`` chooses; no sync), CPU the torch
reference of ``reference/routing.py``. Eager CUDA calls of a kind seen before take the fast lane
of ``_triton/routing/eager.py`` before anything else: one allocation and the launches.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _validate as V
from ._dispatch import (
    plain_eager,
    register_op,
    triton_kernels,
    use_triton,
)
from ._routing_outputs import RoutingPlan, Selection, ShuffledIndices
from .reference.routing import (
    index_shuffling_reference,
    route_backward_reference,
    route_reference,
)

__all__ = ["RoutingPlan", "ShuffledIndices", "index_shuffling", "route"]


_LANE_ON_CPU = False  # tests: CPU tensors through the lane, with stand-in kernels
SELECTION_MAX_EXPERTS = 8192  # bias / groups: a token's whole row is one tile of kernel A


@functools.cache
def _triton():
    """The Triton launcher and its eager fast lane (imported on first use: triton only when a
    call needs it)."""
    return triton_kernels("routing.launch"), triton_kernels("routing.eager")


def _fast(
    x: object, vtc: object, top_k: object, start: object, end: object, renormalize: object,
    route: bool,
) -> tuple[tuple | None, RoutingPlan | ShuffledIndices | None]:  # fmt: skip
    """(key, outputs) of the eager fast lane (``_triton/routing/eager.py``): the outputs where
    the call's key is bound, else None; the key None where the lane does not apply."""
    if type(x) is not torch.Tensor or not (x.is_cuda or _LANE_ON_CPU):
        return None, None
    if not plain_eager():  # before the lane's import: nothing for dynamo to trace there
        return None, None
    lane = _triton()[1]
    key = lane.lane_key(x, vtc, top_k, start, end, renormalize, route)
    return key, (None if key is None else lane.bound_call(key, x, vtc))


def _check(
    scores: object,
    name: str,
    top_k: object,
    start: object,
    end: object,
    valid_token_count: object,
) -> tuple[torch.Tensor, int, int, int]:
    """Validate everything before any launch; returns (scores, top_k, start, end)."""
    scores = V.tensor(name, scores)
    V.rank(name, scores, 2)
    V.dtype(name, scores, V.FLOAT_DTYPES)
    T, E = scores.shape
    if E < 1:
        raise ValueError(
            f"{name} must have at least one expert (dim 1), got shape {tuple(scores.shape)}"
        )
    top_k = V.int_arg("top_k", top_k, 1, E)
    start = 0 if start is None else V.int_arg("expert_index_start", start, 0, E)
    end = E if end is None else V.int_arg("expert_index_end", end, start, E)
    if valid_token_count is not None:
        V.valid_token_count(V.tensor("valid_token_count", valid_token_count), name, scores)
    if T * top_k >= 2**31 or T * E >= 2**31:
        raise ValueError(f"{name} is too large for int32 indices: shape {tuple(scores.shape)}")
    return scores, top_k, start, end


def _check_selection(
    scores: torch.Tensor,
    top_k: int,
    bias: object,
    n_groups: object,
    topk_groups: object,
    scale: object,
    renormalize: object,
) -> Selection:
    """Validate route's selection arguments (after ``_check``); returns them normalised."""
    T, E = scores.shape
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if bias is not None:
        bias = V.tensor("bias", bias)
        V.rank("bias", bias, 1)
        V.dtype("bias", bias, V.FLOAT_DTYPES)
        V.dim_size("bias", bias, 0, E, "the experts of scores")
        V.same_device("scores", scores, bias=bias)
    n_groups = V.int_arg("n_groups", n_groups, 1, E)
    if E % n_groups:
        raise ValueError(f"n_groups={n_groups} must divide the {E} experts of scores")
    topk_groups = n_groups if topk_groups is None else topk_groups
    topk_groups = V.int_arg("topk_groups", topk_groups, 1, n_groups)
    if top_k > topk_groups * (E // n_groups):
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_groups * (E // n_groups)} experts of "
            f"topk_groups={topk_groups} groups of {E // n_groups}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    if not -math.inf < scale < math.inf:  # (not math.isfinite: dynamo would break the graph)
        raise ValueError(f"scale must be finite, got {scale}")
    if (bias is not None or n_groups > 1) and E > SELECTION_MAX_EXPERTS:
        raise ValueError(f"bias and n_groups take at most {SELECTION_MAX_EXPERTS} experts, got {E}")
    return Selection(bias, n_groups, topk_groups, scale)


# ---------------------------------------------------------------------------------------------
# index_shuffling


def _index_shuffling_run(
    routing_scores: torch.Tensor,
    expert_index_start: int,
    expert_index_end: int,
    valid_token_count: torch.Tensor | None,
    top_k: int,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
) -> ShuffledIndices:
    T, E = routing_scores.shape
    if T == 0 or not use_triton(routing_scores.device):
        return index_shuffling_reference(
            routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
        )
    return _triton()[0].run(
        routing_scores, top_k, valid_token_count, expert_index_start, expert_index_end, False,
        False, one_buffer=one_buffer, eager_key=eager_key,
    )  # fmt: skip


def _index_shuffling_impl(
    routing_scores: torch.Tensor,
    expert_index_start: int,
    expert_index_end: int,
    valid_token_count: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(
        _index_shuffling_run(
            routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
        )
    )


def _index_shuffling_fake(routing_scores, expert_index_start, expert_index_end,
                          valid_token_count, top_k):  # fmt: skip
    T, E = routing_scores.shape
    new = routing_scores.new_empty
    return (
        new(E + 2, dtype=torch.int32),
        new(T * top_k, dtype=torch.int32),
        new(T * top_k, dtype=torch.int32),
    )


def _index_shuffling_traceable(routing_scores, expert_index_start, expert_index_end,
                               valid_token_count, top_k) -> bool:  # fmt: skip
    return _triton()[0].traceable(routing_scores, top_k, valid_token_count, expert_index_start,
                                  expert_index_end, False, False)  # fmt: skip


index_shuffling_op = register_op(
    "index_shuffling", _index_shuffling_impl, _index_shuffling_fake,
    traced=_index_shuffling_traceable,
)  # fmt: skip


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
    valid_token_count: torch.Tensor | None = None,
    top_k: int = 1,
) -> ShuffledIndices:
    """Top-k routing and a stable bucket sort of the (expert, token) pairs (FBGEMM's signature).

    Args:
        routing_scores: (T, E) float32/bfloat16/float16, any strides.
        expert_index_start, expert_index_end: the local expert range [start, end) (default [0, E)).
        valid_token_count: optional one-element int32/int64 tensor on the same device; rows at or
            past it (clamped to [0, T]) are not routed.
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        ``ShuffledIndices`` (a tuple in FBGEMM's order):
        token_count_per_expert: (E+2,) int32: [e] pairs routed to e (0 outside the range),
            [E] = T, [E+1] = n, the number of routed pairs.
        expert_indices: (T*top_k,) int32: expert - start of each sorted pair, -1 past n.
        token_indices: (T*top_k,) int32: token of each sorted pair, -1 past n.
    """
    key, out = _fast(
        routing_scores, valid_token_count, top_k, expert_index_start, expert_index_end, False,
        False,
    )  # fmt: skip
    if out is not None:
        return out
    scores, top_k, start, end = _check(
        routing_scores,
        "routing_scores",
        top_k,
        expert_index_start,
        expert_index_end,
        valid_token_count,
    )
    args = (scores, start, end, valid_token_count, top_k)
    if key is not None or index_shuffling_op.route(*args) == "impl":  # one allocation
        return _index_shuffling_run(*args, True, key)
    return ShuffledIndices(*index_shuffling_op.call(*args))


# ---------------------------------------------------------------------------------------------
# route


def _route_run(
    scores: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    expert_index_start: int,
    expert_index_end: int,
    renormalize: bool,
    sel: Selection,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
) -> RoutingPlan:
    T, _ = scores.shape
    if T == 0 or not use_triton(scores.device):
        return route_reference(
            scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize,
            *sel,
        )  # fmt: skip
    return _triton()[0].run(
        scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize,
        True, one_buffer=one_buffer, eager_key=eager_key, selection=sel,
    )  # fmt: skip


def _route_impl(
    scores: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    expert_index_start: int,
    expert_index_end: int,
    renormalize: bool,
    bias: torch.Tensor | None,
    n_groups: int,
    topk_groups: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    sel = Selection(bias, n_groups, topk_groups, scale)
    return tuple(
        _route_run(
            scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize,
            sel,
        )
    )  # fmt: skip


def _route_fake(scores, top_k, valid_token_count, expert_index_start, expert_index_end,
                renormalize, bias, n_groups, topk_groups, scale):  # fmt: skip
    T, _ = scores.shape
    L = expert_index_end - expert_index_start
    P = T * top_k
    i32 = torch.int32
    new = scores.new_empty
    return (
        new(L, dtype=i32),
        new(L + 1, dtype=i32),
        new(P, dtype=i32),
        new(P, dtype=i32),
        new(P, dtype=torch.float32),
        new(T, top_k, dtype=i32),
    )


def _route_traceable(scores, top_k, valid_token_count, expert_index_start, expert_index_end,
                     renormalize, bias, n_groups, topk_groups, scale) -> bool:  # fmt: skip
    sel = Selection(bias, n_groups, topk_groups, scale)
    return _triton()[0].traceable(scores, top_k, valid_token_count, expert_index_start,
                                  expert_index_end, renormalize, True, sel)  # fmt: skip


route_op = register_op("route", _route_impl, _route_fake, traced=_route_traceable)


def _route_setup_context(ctx, inputs, output):
    scores, top_k, valid_token_count, start, end, renormalize, bias, n_groups, tg, scale = inputs
    _, _, expert_indices, _, _, inverse = output
    ctx.save_for_backward(scores, expert_indices, inverse, bias)
    ctx.top_k, ctx.start, ctx.end, ctx.renormalize = top_k, start, end, renormalize
    ctx.n_groups, ctx.topk_groups, ctx.scale = n_groups, tg, scale


def _route_backward_impl(
    grad_P: torch.Tensor,
    inverse_TK: torch.Tensor,
    expert_indices_P: torch.Tensor,
    scores_TE: torch.Tensor,
    start: int,
    end: int,
    scale: float,
    renormalize: bool,
    bias_E: torch.Tensor | None,
    n_groups: int,
    topk_groups: int,
) -> torch.Tensor:
    E = scores_TE.shape[1]
    partial = start != 0 or end != E  # then renormalize recomputes the unrouted choices
    if use_triton(scores_TE.device) and not (renormalize and partial):
        return triton_kernels("routing.backward").route_backward(
            grad_P, inverse_TK, expert_indices_P, scores_TE, start, scale, renormalize
        )
    return route_backward_reference(
        grad_P, inverse_TK, expert_indices_P, scores_TE, start, end, scale, renormalize, bias_E,
        n_groups, topk_groups,
    )  # fmt: skip


def _route_backward_fake(grad_P, inverse_TK, expert_indices_P, scores_TE, start, end, scale,
                         renormalize, bias_E, n_groups, topk_groups):  # fmt: skip
    return torch.empty_like(scores_TE, memory_format=torch.contiguous_format)


route_backward_op = register_op("route_backward", _route_backward_impl, _route_backward_fake)


def _route_backward(ctx, *grads):
    """d scores (``route_backward_reference``; one Triton kernel on CUDA and in the interpreter).
    The bias only selects: no gradient."""
    scores, expert_indices, inverse, bias = ctx.saved_tensors
    grad_P = grads[4]
    if grad_P is None or not ctx.needs_input_grad[0]:
        return (None,) * 10
    grad = route_backward_op.call(grad_P, inverse, expert_indices, scores, ctx.start, ctx.end,
                                  ctx.scale, ctx.renormalize, bias, ctx.n_groups,
                                  ctx.topk_groups)  # fmt: skip
    return (grad,) + (None,) * 9


route_op.register_autograd(_route_backward, _route_setup_context)


def route(
    scores: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
    scale: float = 1.0,
    renormalize: bool = False,
    valid_token_count: torch.Tensor | None = None,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
) -> RoutingPlan:
    """The routing plan of ``scores`` (T, E) for ``top_k`` experts per token (see ``RoutingPlan``).

    ``scores`` are the router weights (e.g. softmax or sigmoid probabilities, computed by the
    caller), float32/bfloat16/float16 with any strides.

    Selection: experts are chosen by ``scores + bias`` (fp32; ``bias`` (E,) float on the scores'
    device, e.g. DeepSeek-V3's load-balancing correction; NaN counts as -inf, ties go to the
    lower expert). With ``n_groups > 1`` the E experts form that many contiguous equal groups (E
    divisible), a group's score is the sum of its two largest biased scores (its one score for
    one-expert groups) and each token chooses only among its ``topk_groups`` best groups (ties to
    the lower group; default all); ``top_k <= topk_groups * E // n_groups``. At most
    ``SELECTION_MAX_EXPERTS`` experts with a bias or groups.

    Weights: a pair's weight is its unbiased score as float32, divided by the sum of the token's
    top_k scores when ``renormalize`` (the sum runs over all k choices, also those outside the
    expert range, in choice order), then multiplied by ``scale``. ``inverse[t, j]`` orders the
    token's choices by descending selection score. The other arguments are those of
    ``index_shuffling``; L = expert_index_end - expert_index_start.

    ``plan.weights`` is differentiable with respect to ``scores`` (the other fields are
    integers, the bias only selects): d scores[t, e] is ``scale`` times the gradient of the pair
    (t, e)'s weight, through the quotient rule over the token's k choices with ``renormalize``;
    zero for experts not chosen.
    """
    plain = bias is None and n_groups == 1 and topk_groups is None and scale == 1.0
    key, out = None, None
    if plain:
        key, out = _fast(
            scores, valid_token_count, top_k, expert_index_start, expert_index_end, renormalize,
            True,
        )  # fmt: skip
    if out is not None:
        return out
    scores, top_k, start, end = _check(
        scores, "scores", top_k, expert_index_start, expert_index_end, valid_token_count
    )
    sel = _check_selection(scores, top_k, bias, n_groups, topk_groups, scale, renormalize)
    args = (scores, top_k, valid_token_count, start, end, renormalize, *sel)
    if key is not None or route_op.route(*args) == "impl":  # one allocation
        return _route_run(scores, top_k, valid_token_count, start, end, renormalize, sel, True,
                          key)  # fmt: skip
    return RoutingPlan(*route_op.call(*args))
