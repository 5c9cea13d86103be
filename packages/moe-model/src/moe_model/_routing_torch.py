"""Plain-torch routing for the ``baseline`` and ``torch`` MoE implementations.

Same contract as ``moe_kernels.routing.route`` (ties to the lower expert, NaN counts as -inf,
pairs sorted by (expert, token)), written with torch ops that never read a value on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TorchPlan(NamedTuple):
    """Sorted routing of T tokens x k choices over E experts (all tensors on the scores' device).

    offsets:        (E+1,) int32 exclusive prefix sum of per-expert pair counts.
    expert_indices: (T*k,) int64 expert of each sorted pair (ascending).
    token_indices:  (T*k,) int64 token of each sorted pair (ascending inside an expert).
    weights:        (T*k,) fp32 combine weight of each sorted pair.
    inverse:        (T, k) int64 sorted position of token t's j-th choice.
    """

    offsets: torch.Tensor
    expert_indices: torch.Tensor
    token_indices: torch.Tensor
    weights: torch.Tensor
    inverse: torch.Tensor


def topk_choices(
    scores_TE: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row by descending score, ties to the lower expert, NaN treated as -inf.

    Returns ``(weights_Tk fp32, experts_Tk int64)``, choices ordered by descending score; weights
    are the chosen scores, divided by their sum over the k choices when ``renormalize``.
    """
    s_TE = scores_TE.float()
    s_TE = torch.where(torch.isnan(s_TE), torch.full_like(s_TE, float("-inf")), s_TE)
    # A stable descending sort keeps equal scores in expert order: ties go to the lower expert.
    vals_TE, idx_TE = torch.sort(s_TE, dim=-1, descending=True, stable=True)
    w_Tk, e_Tk = vals_TE[:, :top_k], idx_TE[:, :top_k]
    if renormalize:
        w_Tk = w_Tk / w_Tk.sum(dim=-1, keepdim=True)
    return w_Tk, e_Tk


def torch_plan(w_Tk: torch.Tensor, e_Tk: torch.Tensor, n_experts: int) -> TorchPlan:
    """Sort the (token, choice) pairs by expert then token, without host syncs."""
    T, k = e_Tk.shape
    e_P = e_Tk.reshape(-1)  # P = T*k pairs in (token, choice) order
    # Stable sort by expert keeps pairs of one expert in token order.
    order_P = torch.sort(e_P, stable=True).indices
    counts_E = (e_P.unsqueeze(1) == torch.arange(n_experts, device=e_P.device)).sum(
        0, dtype=torch.int32
    )
    offsets = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0, dtype=torch.int32)])
    inverse_P = torch.empty_like(order_P).scatter_(
        0, order_P, torch.arange(T * k, device=e_P.device)
    )
    return TorchPlan(
        offsets=offsets,
        expert_indices=e_P[order_P],
        token_indices=torch.div(order_P, k, rounding_mode="floor"),
        weights=w_Tk.reshape(-1)[order_P].float(),
        inverse=inverse_P.view(T, k),
    )
