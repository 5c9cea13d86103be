"""Pure-torch routing: the CPU path and the oracle of the Triton kernels in ``_triton/routing/``.

Everything stays on the input's device and never syncs (no ``.item()``, no data-dependent shapes),
so it also runs under ``torch.compile(fullgraph=True)`` and CUDA-graph capture.
"""

from __future__ import annotations

import torch

from .._routing_outputs import RoutingPlan, ShuffledIndices


def _rank_values(x_TE: torch.Tensor) -> torch.Tensor:
    """fp32 values in the kernels' order: NaN as -inf, -0.0 as +0.0."""
    x_TE = torch.where(torch.isnan(x_TE), float("-inf"), x_TE)
    return torch.where(x_TE == 0, 0.0, x_TE)


def _descending(rank_TE: torch.Tensor) -> torch.Tensor:
    """Column order by descending value, ties to the lower column (a stable sort)."""
    return torch.sort(rank_TE, dim=1, descending=True, stable=True).indices


def allowed_groups(rank_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """(T, n_groups) bool: each token's ``topk_groups`` best groups of E // n_groups contiguous
    experts. A group's score is the fp32 sum of its two largest selection values (its one value
    for one-expert groups; NaN sums rank as -inf); ties go to the lower group."""
    T, E = rank_TE.shape
    per_group = E // n_groups
    top_TG2 = rank_TE.view(T, n_groups, per_group).topk(min(2, per_group), dim=2).values
    score_TG = top_TG2[..., 0] + top_TG2[..., 1] if per_group > 1 else top_TG2[..., 0]
    best_TG = _descending(_rank_values(score_TG))[:, :topk_groups]
    return torch.zeros(T, n_groups, dtype=torch.bool, device=rank_TE.device).scatter(
        1, best_TG, True
    )


def topk_choices(
    scores_TE: torch.Tensor,
    top_k: int,
    bias_E: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
) -> torch.Tensor:
    """(T, top_k) int64: each token's experts by descending selection score, the kernels' rule.

    The selection score is ``scores + bias`` in fp32 (``scores`` without a bias); NaN counts as
    -inf, -0.0 equals +0.0, ties go to the lower expert. With ``n_groups > 1`` a token chooses
    only among the experts of its ``topk_groups`` best groups (``allowed_groups``), every one of
    which ranks above every expert outside them."""
    x_TE = scores_TE.float()
    if bias_E is not None:
        x_TE = x_TE + bias_E.float()
    rank_TE = _rank_values(x_TE)
    order_TE = _descending(rank_TE)
    if n_groups > 1 and (topk_groups or n_groups) < n_groups:
        allowed_TG = allowed_groups(rank_TE, n_groups, topk_groups)
        allowed_TE = allowed_TG.repeat_interleave(rank_TE.shape[1] // n_groups, dim=1)
        # then by group admission (stable): allowed experts first, each part in value order
        first_TE = _descending(allowed_TE.gather(1, order_TE).to(torch.int8))
        order_TE = order_TE.gather(1, first_TE)
    return order_TE[:, :top_k]


def choice_weights(
    scores_TE: torch.Tensor, choice_TK: torch.Tensor, renormalize: bool, scale: float
) -> torch.Tensor:
    """(T, k) fp32 weights of the choices: the unbiased scores (NaN and -0.0 kept), divided by
    their sum (added in choice order) when ``renormalize``, then multiplied by ``scale``."""
    w_TK = scores_TE.float().gather(1, choice_TK)
    if renormalize:
        s_T = w_TK[:, 0]
        for j in range(1, choice_TK.shape[1]):  # sequential sum: the kernels add in this order
            s_T = s_T + w_TK[:, j]
        w_TK = w_TK / s_T[:, None]
    if scale != 1.0:
        w_TK = w_TK * scale
    return w_TK


def route_reference(
    scores_TE: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    start: int,
    end: int,
    renormalize: bool,
    bias_E: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
    scale: float = 1.0,
) -> RoutingPlan:
    """The routing plan: ``RoutingPlan`` with L = end - start local experts and P = T * top_k
    pairs.

    Top-k per token by selection score (``topk_choices``), weights by ``choice_weights``; rows
    at or past ``valid_token_count`` (clamped to [0, T]) and experts outside [start, end) are
    not routed. Routed pairs are sorted by (expert, token).
    """
    T, E = scores_TE.shape
    L = end - start
    P = T * top_k
    dev = scores_TE.device
    i32 = torch.int32
    if T == 0:
        return RoutingPlan(
            torch.zeros(L, dtype=i32, device=dev),
            torch.zeros(L + 1, dtype=i32, device=dev),
            torch.empty(0, dtype=i32, device=dev),
            torch.empty(0, dtype=i32, device=dev),
            torch.empty(0, dtype=torch.float32, device=dev),
            torch.empty(0, top_k, dtype=i32, device=dev),
        )
    choice_TK = topk_choices(scores_TE, top_k, bias_E, n_groups, topk_groups)
    w_TK = choice_weights(scores_TE, choice_TK, renormalize, scale)

    t_T = torch.arange(T, device=dev)
    if valid_token_count is None:
        row_ok_T = torch.ones(T, dtype=torch.bool, device=dev)
    else:
        n_valid = valid_token_count.reshape(()).to(torch.int64).clamp(0, T)
        row_ok_T = t_T < n_valid
    routed_TK = row_ok_T[:, None] & (choice_TK >= start) & (choice_TK < end)
    local_TK = choice_TK - start
    # Unique keys: routed pairs by (expert, token), then the unrouted ones after all of them.
    flat_P = torch.arange(P, device=dev)
    key_P = torch.where(
        routed_TK, local_TK * T + t_T[:, None], L * T + flat_P.view(T, top_k)
    ).flatten()
    sorted_P, perm_P = torch.sort(key_P)
    n = routed_TK.sum()
    head_P = flat_P < n
    expert_P = torch.where(head_P, sorted_P // T, -1).to(i32)
    token_P = torch.where(head_P, sorted_P % T, -1).to(i32)
    weight_P = torch.where(head_P, w_TK.flatten()[perm_P], 0.0)
    inverse_P = torch.empty(P, dtype=torch.int64, device=dev).scatter_(0, perm_P, flat_P)
    inverse_TK = torch.where(routed_TK, inverse_P.view(T, top_k), -1).to(i32)
    bucket_P = torch.where(routed_TK, local_TK, L).flatten()
    counts = torch.zeros(L + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, bucket_P, torch.ones_like(bucket_P))[:L]
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return RoutingPlan(
        counts.to(i32),
        offsets.to(i32),
        expert_P,
        token_P,
        weight_P,
        inverse_TK,
    )


def index_shuffling_reference(
    scores_TE: torch.Tensor,
    start: int,
    end: int,
    valid_token_count: torch.Tensor | None,
    top_k: int,
) -> ShuffledIndices:
    """``ShuffledIndices``: token_count_per_expert (E+2,) ([e] pairs routed to expert e, 0
    outside [start, end); [E] = T, [E+1] = n), expert_indices and token_indices (T*top_k,)."""
    T, E = scores_TE.shape
    counts, offsets, expert_P, token_P, _, _ = route_reference(
        scores_TE, top_k, valid_token_count, start, end, False
    )
    tcpe = torch.zeros(E + 2, dtype=torch.int32, device=scores_TE.device)
    tcpe[start:end] = counts
    tcpe[E] = T
    tcpe[E + 1] = offsets[-1]
    return ShuffledIndices(tcpe, expert_P, token_P)
