"""Plain-torch routing for the ``baseline`` and ``torch`` MoE implementations.

Same contract as ``moe_kernels.routing.route`` (selection bias, expert groups, weight scale,
ties to the lower expert, NaN counts as -inf, pairs sorted by (expert, token)), written anew with
torch ops that never read a value on the host (the tests hold it bitwise to moe_kernels'
reference).
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


def _ranked(x_TE: torch.Tensor) -> torch.Tensor:
    """fp32 selection values as they rank: NaN as -inf, -0.0 as +0.0 (a radix sort, as CUDA's
    may be, would otherwise put -0.0 below +0.0)."""
    x_TE = torch.where(torch.isnan(x_TE), torch.full_like(x_TE, float("-inf")), x_TE)
    return torch.where(x_TE == 0, torch.zeros_like(x_TE), x_TE)


def _order(x_TC: torch.Tensor) -> torch.Tensor:
    """Columns by descending value; a stable sort keeps equal values in column order."""
    return torch.sort(x_TC, dim=-1, descending=True, stable=True).indices


def group_mask(sel_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """(T, E) bool: the experts of each token's ``topk_groups`` best groups.

    The E experts form ``n_groups`` contiguous groups of E // n_groups; a group's score is the
    sum of its two largest (ranked) selection values, its one value for one-expert groups (a NaN
    sum, inf + -inf, ranks as -inf); ties go to the lower group. ``sel_TE``: ranked fp32.
    """
    T, E = sel_TE.shape
    per_group = E // n_groups
    desc_TGP = torch.sort(sel_TE.view(T, n_groups, per_group), dim=-1, descending=True).values
    group_TG = desc_TGP[..., 0] + desc_TGP[..., 1] if per_group > 1 else desc_TGP[..., 0]
    best_TG = _order(_ranked(group_TG))[:, :topk_groups]
    chosen_TG = torch.zeros(T, n_groups, dtype=torch.bool, device=sel_TE.device)
    chosen_TG = chosen_TG.scatter(1, best_TG, True)
    return chosen_TG.repeat_interleave(per_group, dim=1)


def topk_choices(
    scores_TE: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts of ``scores_TE`` (T, E), and their weights.

    Selection: by descending fp32 ``scores + bias`` (``bias`` (E,) or None), NaN as -inf, ties to
    the lower expert; with ``topk_groups < n_groups`` only the experts of the token's
    ``topk_groups`` best groups (``group_mask``) can be chosen. Weights: the unbiased fp32 scores
    of the choices, divided by their sum (added in choice order) when ``renormalize``, then
    times ``scale``.

    Returns ``(weights_Tk fp32, experts_Tk int64)``, choices by descending selection value.
    """
    s_TE = scores_TE.float()
    sel_TE = _ranked(s_TE if bias is None else s_TE + bias.float())
    order_TE = _order(sel_TE)
    if n_groups > 1 and topk_groups is not None and topk_groups < n_groups:
        # A second stable sort, on admission: the admitted experts first, each part still in
        # value order (ties to the lower expert), so top_k <= admitted experts never leaves them.
        admitted_TE = group_mask(sel_TE, n_groups, topk_groups).gather(1, order_TE)
        order_TE = order_TE.gather(1, _order(admitted_TE.to(torch.int8)))
    e_Tk = order_TE[:, :top_k]
    w_Tk = s_TE.gather(1, e_Tk)
    if renormalize:
        sum_T = w_Tk[:, 0]
        for j in range(1, top_k):  # sequentially, in choice order: moe_kernels' sum
            sum_T = sum_T + w_Tk[:, j]
        w_Tk = w_Tk / sum_T[:, None]
    if scale != 1.0:
        w_Tk = w_Tk * scale
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
