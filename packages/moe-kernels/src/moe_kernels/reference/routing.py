"""Pure-torch routing: the CPU path and the oracle of the Triton kernels in ``_triton/routing/``.

Everything stays on the input's device and never syncs (no ``.item()``, no data-dependent shapes),
so it also runs under ``torch.compile(fullgraph=True)`` and CUDA-graph capture.
"""

from __future__ import annotations

import torch

from .._routing_outputs import RoutingPlan, ShuffledIndices
from ..selection import topk_choices


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

    Top-k per token and their weights by ``moe_kernels.selection.topk_choices``; rows
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
    w_TK, choice_TK = topk_choices(
        scores_TE,
        top_k,
        bias=bias_E,
        n_groups=n_groups,
        topk_groups=topk_groups,
        scale=scale,
        renormalize=renormalize,
    )

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


def route_backward_reference(
    grad_P: torch.Tensor,
    inverse_TK: torch.Tensor,
    expert_indices_P: torch.Tensor,
    scores_TE: torch.Tensor,
    start: int,
    end: int,
    scale: float,
    renormalize: bool,
    bias_E: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
) -> torch.Tensor:
    """``route``'s backward: d scores (T, E) in the scores' dtype from the gradient of the plan's
    weights grad_P (P,). d scores[t, e] = ``scale`` times the gradient of the pair (t, e) (zero
    where no pair); with ``renormalize`` the quotient rule over the token's k choices,
    ``(g_j - sum_i g_i w_i) / S`` for w_j = s_j / S, S and the sum in choice order (the forward's
    order). The bias only selects: no gradient. Sync-free, no atomics: a token's choices are
    distinct experts, written by one scatter (unrouted choices go to spare columns)."""
    T, E = scores_TE.shape
    k = inverse_TK.shape[1]
    ok_TK = inverse_TK >= 0
    safe_TK = torch.where(ok_TK, inverse_TK, 0).long()
    g_TK = torch.where(ok_TK, grad_P.float()[safe_TK], 0.0)
    if scale != 1.0:
        g_TK = g_TK * scale
    spare_TK = torch.arange(E, E + k, device=scores_TE.device).expand(T, k)
    e_TK = torch.where(ok_TK, expert_indices_P.long()[safe_TK] + start, spare_TK)
    if renormalize:
        if start != 0 or end != E:  # unrouted choices count in the sum: recompute them
            e_TK = topk_choices(
                scores_TE, k, bias=bias_E, n_groups=n_groups, topk_groups=topk_groups
            ).experts
        s_TK = scores_TE.float().gather(1, e_TK.clamp(max=E - 1))
        sum_T = s_TK[:, 0]
        for j in range(1, k):  # the forward's sequential order
            sum_T = sum_T + s_TK[:, j]
        w_TK = s_TK / sum_T[:, None]
        gw_TK = g_TK * w_TK
        dot_T = gw_TK[:, 0]
        for j in range(1, k):
            dot_T = dot_T + gw_TK[:, j]
        d_TK = (g_TK - dot_T[:, None]) / sum_T[:, None]
        d_TK = torch.where(ok_TK.any(dim=1, keepdim=True), d_TK, 0.0)
    else:
        d_TK = g_TK
    grad = scores_TE.new_zeros((T, E + k), dtype=torch.float32).scatter(1, e_TK, d_TK)
    return grad[:, :E].to(scores_TE.dtype).contiguous()


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
