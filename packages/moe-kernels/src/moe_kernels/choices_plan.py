"""``plan_from_choices``: the ``RoutingPlan`` of routing decisions made elsewhere.

For a framework that routes itself (a Hugging Face router, a checkpoint's own top-k): its
(T, k) expert indices and weights become the plan every expert op here reads, in plain torch,
without host syncs (torch.compile fullgraph, CUDA graphs) and deterministic (a stable sort).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels.routing import RoutingPlan

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(
    expert_indices: object, weights: object, n_experts: object, start: object, end: object
) -> tuple[int, int]:
    V.dtype("expert_indices", expert_indices, V.INDEX_DTYPES)
    V.rank("expert_indices", expert_indices, 2)
    V.dtype("weights", weights, WEIGHT_DTYPES)
    if weights.shape != expert_indices.shape:
        raise ValueError(
            f"weights must have expert_indices' shape {tuple(expert_indices.shape)}, got "
            f"{tuple(weights.shape)}"
        )
    V.same_device("expert_indices", expert_indices, weights=weights)
    n = V.int_arg("n_experts", n_experts, 1, 2**31 - 1)
    lo = V.int_arg("expert_index_start", 0 if start is None else start, 0, n - 1)
    hi = V.int_arg("expert_index_end", n if end is None else end, lo + 1, n)
    return lo, hi


def plan_from_choices(
    expert_indices: torch.Tensor,
    weights: torch.Tensor,
    n_experts: int,
    *,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
) -> RoutingPlan:
    """The plan of given choices: token t's j-th choice is expert ``expert_indices[t, j]`` with
    weight ``weights[t, j]``.

    expert_indices: (T, k) int32/int64, experts in [0, n_experts); weights: (T, k) float16 /
    bfloat16 / float32 / float64 on the same device. The local experts are
    [expert_index_start, expert_index_end) (default: all, L = end - start); a choice of any other
    expert (outside the range, negative, past ``n_experts``: an expert-parallel sentinel) is not
    routed: ``inverse`` -1, the pair in the -1 / 0 tail like ``route``'s.

    Returns a ``RoutingPlan`` with ``route``'s contract: int32 indices (``expert_indices`` local,
    expert - start), pairs sorted by expert then token, ``weights`` float32. The choices keep
    their given order (``inverse[t, j]`` is choice j's sorted position); nothing is re-ranked or
    renormalised. ``plan.weights`` is differentiable in ``weights`` (a gather). TypeError /
    ValueError naming the argument for a wrong dtype, rank, shape, device or range.
    """
    lo, hi = _check(expert_indices, weights, n_experts, expert_index_start, expert_index_end)
    T, k = expert_indices.shape
    L, P = hi - lo, T * k
    device = expert_indices.device
    local_P = expert_indices.reshape(-1).long() - lo
    routed_P = (local_P >= 0) & (local_P < L)
    key_P = torch.where(routed_P, local_P, L)  # unrouted pairs sort after every expert
    # Stable: one expert's pairs stay in (token, choice) order, i.e. sorted by token.
    sorted_key_P, order_P = torch.sort(key_P, stable=True)
    bounds = torch.arange(L + 1, device=device, dtype=sorted_key_P.dtype)
    offsets = torch.searchsorted(sorted_key_P, bounds).to(torch.int32)
    counts = offsets[1:] - offsets[:-1]
    kept_P = sorted_key_P < L
    position_P = torch.arange(P, device=device)
    inverse_P = torch.empty_like(order_P).scatter_(0, order_P, position_P)
    return RoutingPlan(
        counts=counts,
        offsets=offsets,
        expert_indices=torch.where(kept_P, sorted_key_P.int(), -1),
        token_indices=torch.where(kept_P, torch.div(order_P, k, rounding_mode="floor").int(), -1),
        weights=torch.where(kept_P, weights.reshape(-1)[order_P].float(), 0.0),
        inverse=torch.where(routed_P, inverse_P.int(), -1).view(T, k),
    )
