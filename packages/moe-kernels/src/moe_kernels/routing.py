"""MoE token routing: FBGEMM-compatible ``index_shuffling`` and the deterministic routing plan.

Both ops pick each token's ``top_k`` experts by score (NaN counts as -inf, ties go to the lower
expert, so a row of all -inf still picks ``top_k`` distinct experts 0..k-1) and sort the
(expert, token) pairs whose expert lies in ``[expert_index_start, expert_index_end)`` by expert,
then token. Rows at or past ``valid_token_count`` (a one-element device tensor, clamped to [0, T],
never read on the host) are not routed. CUDA runs the Triton kernels of ``_triton/routing.py``
(two to four launches; one for small eager calls; no sync), CPU the torch reference of
``_reference/routing.py``. Eager CUDA calls of a kind seen before take the fast lane of
``_triton/routing_eager.py`` before anything else: one allocation and the launches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import _validate as V
from ._dispatch import eager_direct, op_name, plain_eager, triton_kernels, use_triton
from ._reference.routing import index_shuffling_reference, route_reference

__all__ = ["RoutingPlan", "index_shuffling", "route"]


class RoutingPlan(NamedTuple):
    """Where every (token, expert) pair goes, for T tokens, top_k choices and L local experts.

    counts:         (L,) int32, pairs routed to each local expert.
    offsets:        (L+1,) int32, exclusive prefix sum of counts (offsets[0] = 0): group
                    boundaries for grouped GEMMs (``offsets[1:]`` are the end offsets
                    ``torch._grouped_mm`` takes).
    expert_indices: (T*top_k,) int32, local expert (expert - start) of each sorted pair; -1 in
                    the tail.
    token_indices:  (T*top_k,) int32, token of each sorted pair; -1 in the tail.
    weights:        (T*top_k,) float32, router weight of each sorted pair; 0 in the tail.
    inverse:        (T, top_k) int32, sorted position of token t's j-th choice (j by descending
                    score), -1 when that choice is not routed (outside the expert range or past the
                    valid token count).
    Pairs are sorted by expert, then by token: the plan is a pure function of its inputs.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    expert_indices: torch.Tensor
    token_indices: torch.Tensor
    weights: torch.Tensor
    inverse: torch.Tensor


_LANE_ON_CPU = False  # tests: CPU tensors through the lane, with stand-in kernels


@functools.cache
def _triton():
    """The Triton launcher and its eager fast lane (imported on first use: triton only when a
    call needs it)."""
    return triton_kernels("routing"), triton_kernels("routing_eager")


def _fast(
    x: object, vtc: object, top_k: object, start: object, end: object, flags: tuple
) -> tuple[tuple | None, tuple | None]:
    """(key, outputs) of the eager fast lane (``_triton/routing_eager.py``): the outputs where
    the call's key is bound, else None; the key None where the lane does not apply. ``flags``:
    (renormalize, with_weights, with_offsets, with_tcpe), plain bools."""
    if type(x) is not torch.Tensor or not (x.is_cuda or _LANE_ON_CPU):
        return None, None
    if not plain_eager():  # before the lane's import: nothing for dynamo to trace there
        return None, None
    lane = _triton()[1]
    key = lane.lane_key(x, vtc, top_k, start, end, *flags)
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


# ---------------------------------------------------------------------------------------------
# index_shuffling

_IS_FLAGS = (False, False, False, True)  # renormalize, with_weights, with_offsets, with_tcpe


def _index_shuffling_run(
    routing_scores: torch.Tensor,
    expert_index_start: int,
    expert_index_end: int,
    valid_token_count: torch.Tensor | None,
    top_k: int,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, E = routing_scores.shape
    if T == 0 or not use_triton(routing_scores.device):
        return index_shuffling_reference(
            routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
        )
    _, _, expert, token, _, _, tcpe = _triton()[0].routing_triton(
        routing_scores,
        top_k,
        valid_token_count,
        expert_index_start,
        expert_index_end,
        *_IS_FLAGS,
        one_buffer=one_buffer,
        eager_key=eager_key,
    )
    return tcpe, expert, token


def _index_shuffling_impl(
    routing_scores: torch.Tensor,
    expert_index_start: int,
    expert_index_end: int,
    valid_token_count: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _index_shuffling_run(
        routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
    )


_index_shuffling_op = torch.library.custom_op(op_name("index_shuffling"), mutates_args=())(
    _index_shuffling_impl
)


@_index_shuffling_op.register_fake
def _(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k):
    T, E = routing_scores.shape
    new = routing_scores.new_empty
    return (
        new(E + 2, dtype=torch.int32),
        new(T * top_k, dtype=torch.int32),
        new(T * top_k, dtype=torch.int32),
    )


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
    valid_token_count: torch.Tensor | None = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing and a stable bucket sort of the (expert, token) pairs (FBGEMM's signature).

    Args:
        routing_scores: (T, E) float32/bfloat16/float16, any strides.
        expert_index_start, expert_index_end: the local expert range [start, end) (default [0, E)).
        valid_token_count: optional one-element int32/int64 tensor on the same device; rows at or
            past it (clamped to [0, T]) are not routed.
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        token_count_per_expert: (E+2,) int32: [e] pairs routed to e (0 outside the range),
            [E] = T, [E+1] = n, the number of routed pairs.
        expert_indices: (T*top_k,) int32: expert - start of each sorted pair, -1 past n.
        token_indices: (T*top_k,) int32: token of each sorted pair, -1 past n.
    """
    key, out = _fast(
        routing_scores, valid_token_count, top_k, expert_index_start, expert_index_end, _IS_FLAGS
    )
    if out is not None:
        return out[6], out[2], out[3]
    scores, top_k, start, end = _check(
        routing_scores,
        "routing_scores",
        top_k,
        expert_index_start,
        expert_index_end,
        valid_token_count,
    )
    if key is not None or eager_direct(scores, valid_token_count):  # one allocation, no dispatcher
        return _index_shuffling_run(scores, start, end, valid_token_count, top_k, True, key)
    return _index_shuffling_op(scores, start, end, valid_token_count, top_k)


# ---------------------------------------------------------------------------------------------
# route

_ROUTE_FLAGS = (True, True, False)  # with_weights, with_offsets, with_tcpe


def _route_run(
    scores: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    expert_index_start: int,
    expert_index_end: int,
    renormalize: bool,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, _ = scores.shape
    if T == 0 or not use_triton(scores.device):
        return route_reference(
            scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize
        )
    return _triton()[0].routing_triton(
        scores,
        top_k,
        valid_token_count,
        expert_index_start,
        expert_index_end,
        renormalize,
        *_ROUTE_FLAGS,
        one_buffer=one_buffer,
        eager_key=eager_key,
    )[:6]


def _route_impl(
    scores: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    expert_index_start: int,
    expert_index_end: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _route_run(
        scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize
    )


_route_op = torch.library.custom_op(op_name("route"), mutates_args=())(_route_impl)


@_route_op.register_fake
def _(scores, top_k, valid_token_count, expert_index_start, expert_index_end, renormalize):
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


def route(
    scores: torch.Tensor,
    top_k: int,
    *,
    valid_token_count: torch.Tensor | None = None,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
    renormalize: bool = False,
) -> RoutingPlan:
    """The routing plan of ``scores`` (T, E) for ``top_k`` experts per token (see ``RoutingPlan``).

    ``scores`` are the router weights (e.g. softmax or sigmoid probabilities, computed by the
    caller), float32/bfloat16/float16 with any strides. A pair's weight is its score as float32,
    divided by the sum of the token's top_k scores when ``renormalize`` (the sum runs over all
    k choices, also those outside the expert range, in descending-score order). The other
    arguments are those of ``index_shuffling``; L = expert_index_end - expert_index_start.
    """
    key = None
    if type(renormalize) is bool:
        key, out = _fast(
            scores, valid_token_count, top_k, expert_index_start, expert_index_end,
            (renormalize, *_ROUTE_FLAGS),
        )  # fmt: skip
        if out is not None:
            return RoutingPlan(*out[:6])
    scores, top_k, start, end = _check(
        scores, "scores", top_k, expert_index_start, expert_index_end, valid_token_count
    )
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if key is not None or eager_direct(scores, valid_token_count):  # one allocation, no dispatcher
        return RoutingPlan(
            *_route_run(scores, top_k, valid_token_count, start, end, renormalize, True, key)
        )
    return RoutingPlan(*_route_op(scores, top_k, valid_token_count, start, end, renormalize))
