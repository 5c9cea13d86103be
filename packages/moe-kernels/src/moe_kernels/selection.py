"""The torch formula of route's selection: each token's top-k experts and their weights.

``topk_choices`` is the one definition, in plain torch, of the routing options (selection bias,
expert groups, renormalisation, weight scale): ``route``'s reference path and its backward
compute with it, and so do moe_model's ``torch`` and ``baseline`` MoE implementations; the
Triton kernels of ``_triton/routing/`` are held to it bit for bit by the tests. Sorts, gathers
and scatters only: no host sync, no data-dependent shape (``torch.compile(fullgraph=True)`` and
CUDA-graph capture take it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from moe_kernels import _validate as V

__all__ = ["TopkChoices", "topk_choices"]

SCORE_DTYPES = (*V.FLOAT_DTYPES, torch.float64)


class TopkChoices(NamedTuple):
    """Each of T tokens' k choices, by descending selection value.

    weights: (T, k) float32: the weight of each choice.
    experts: (T, k) int64: the expert of each choice (distinct within a token).
    """

    weights: torch.Tensor
    experts: torch.Tensor


def _rank_values(x_TE: torch.Tensor) -> torch.Tensor:
    """fp32 values in the kernels' order: NaN as -inf, -0.0 as +0.0."""
    x_TE = torch.where(torch.isnan(x_TE), float("-inf"), x_TE)
    return torch.where(x_TE == 0, 0.0, x_TE)


def _descending(rank_TE: torch.Tensor) -> torch.Tensor:
    """Column order by descending value, ties to the lower column (a stable sort)."""
    return torch.sort(rank_TE, dim=1, descending=True, stable=True).indices


def _allowed_groups(rank_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
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


def _check(
    scores: object,
    top_k: object,
    bias: object,
    n_groups: object,
    topk_groups: object,
    scale: object,
    renormalize: object,
) -> tuple[torch.Tensor, int, int, int, float]:
    """TypeError / ValueError naming the argument (route's rules); returns (scores, top_k,
    n_groups, topk_groups, scale) with topk_groups resolved."""
    scores = V.tensor("scores", scores)
    V.rank("scores", scores, 2)
    V.dtype("scores", scores, SCORE_DTYPES)
    E = scores.shape[1]
    if E < 1:
        raise ValueError(f"scores must have at least one expert (dim 1), got {tuple(scores.shape)}")
    top_k = V.int_arg("top_k", top_k, 1, E)
    if bias is not None:
        V.dtype("bias", V.tensor("bias", bias), SCORE_DTYPES)
        V.rank("bias", bias, 1)
        V.dim_size("bias", bias, 0, E, "the experts of scores")
        V.same_device("scores", scores, bias=bias)
    n_groups = V.int_arg("n_groups", n_groups, 1, E)
    if E % n_groups:
        raise ValueError(f"n_groups={n_groups} must divide the {E} experts of scores")
    if topk_groups is None:
        topk_groups = n_groups
    topk_groups = V.int_arg("topk_groups", topk_groups, 1, n_groups)
    if top_k > topk_groups * (E // n_groups):
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_groups * (E // n_groups)} experts of "
            f"topk_groups={topk_groups} groups of {E // n_groups}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not -math.inf < scale < math.inf:  # (not math.isfinite: dynamo would break the graph)
        raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    return scores, top_k, n_groups, topk_groups, float(scale)


def topk_choices(
    scores: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
    scale: float = 1.0,
    renormalize: bool = False,
) -> TopkChoices:
    """Each token's ``top_k`` experts of ``scores`` (T, E) and their weights (``route``'s rule).

    Selection: by descending ``scores + bias`` in fp32 (``bias`` (E,) or None; NaN counts as
    -inf, -0.0 equals +0.0, ties go to the lower expert). With ``topk_groups < n_groups`` the E
    experts form ``n_groups`` contiguous equal groups, a group's score is the sum of its two
    largest selection values (its one value for one-expert groups), and a token chooses only
    among the experts of its ``topk_groups`` best groups (ties to the lower group).

    Weights: the unbiased scores of the choices in fp32 (NaN and -0.0 kept), divided by their
    sum (added in choice order) when ``renormalize``, then multiplied by ``scale``.

    Arguments as ``route`` takes them (float16/bfloat16/float32/float64 scores and bias):
    TypeError / ValueError naming the argument otherwise. Differentiable in ``scores`` through
    the weights (torch autograd); the bias only selects.
    """
    scores, top_k, n_groups, topk_groups, scale = _check(
        scores, top_k, bias, n_groups, topk_groups, scale, renormalize
    )
    x_TE = scores.float()
    if bias is not None:
        x_TE = x_TE + bias.float()
    rank_TE = _rank_values(x_TE)
    order_TE = _descending(rank_TE)
    if topk_groups < n_groups:
        allowed_TG = _allowed_groups(rank_TE, n_groups, topk_groups)
        allowed_TE = allowed_TG.repeat_interleave(rank_TE.shape[1] // n_groups, dim=1)
        # then by group admission (stable): allowed experts first, each part in value order
        first_TE = _descending(allowed_TE.gather(1, order_TE).to(torch.int8))
        order_TE = order_TE.gather(1, first_TE)
    experts_TK = order_TE[:, :top_k]
    w_TK = scores.float().gather(1, experts_TK)
    if renormalize:
        s_T = w_TK[:, 0]
        for j in range(1, top_k):  # sequential sum: the kernels add in this order
            s_T = s_T + w_TK[:, j]
        w_TK = w_TK / s_T[:, None]
    if scale != 1.0:
        w_TK = w_TK * scale
    return TopkChoices(w_TK, experts_TK)
