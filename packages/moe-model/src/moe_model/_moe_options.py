"""MoELayer's argument checks, its routing and balancing options: the Switch load-balancing loss
and DeepSeek-V3's expert-bias update (on device tensors, without host syncs)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_size(name: str, value: object) -> None:
    """ValueError unless ``value`` is a positive int (a bool is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_bool(name: str, value: object) -> None:
    """TypeError unless ``value`` is a bool (a truthy string or int is not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


class RoutingArgs(NamedTuple):
    """The checked options: ``topk_groups`` resolved (None -> n_groups), floats as floats."""

    n_groups: int
    topk_groups: int
    routed_scaling_factor: float
    n_shared_experts: int
    aux_loss_coef: float


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_routing_args(
    n_experts: int,
    top_k: int,
    *,
    n_groups: object,
    topk_groups: object,
    routed_scaling_factor: object,
    n_shared_experts: object,
    aux_loss_coef: object,
) -> RoutingArgs:
    """TypeError / ValueError (naming the argument) unless: ``n_groups`` a positive int dividing
    ``n_experts``; ``topk_groups`` None or an int in [1, n_groups], with ``top_k <= topk_groups *
    n_experts // n_groups``; ``routed_scaling_factor`` a finite float; ``n_shared_experts`` an
    int >= 0; ``aux_loss_coef`` a finite float >= 0."""
    n_groups = _int("n_groups", n_groups)
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(
            f"n_groups must be a positive divisor of n_experts={n_experts}, got {n_groups}"
        )
    if topk_groups is None:
        topk_groups = n_groups
    topk_groups = _int("topk_groups", topk_groups)
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    per_group = n_experts // n_groups
    if top_k > topk_groups * per_group:
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_groups * per_group} experts of topk_groups="
            f"{topk_groups} groups of {per_group} (n_experts={n_experts}, n_groups={n_groups})"
        )
    scale = _float("routed_scaling_factor", routed_scaling_factor)
    n_shared = _int("n_shared_experts", n_shared_experts)
    if n_shared < 0:
        raise ValueError(f"n_shared_experts must be >= 0, got {n_shared}")
    coef = _float("aux_loss_coef", aux_loss_coef)
    if coef < 0:
        raise ValueError(f"aux_loss_coef must be >= 0, got {coef}")
    return RoutingArgs(n_groups, topk_groups, scale, n_shared, coef)


def check_rate(rate: object) -> float:
    """The expert-bias update rate: a finite float >= 0."""
    rate = _float("rate", rate)
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    return rate


def switch_aux_loss(
    scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, coef: float
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss ``coef * E * sum_e f_e * P_e``, a 0-d fp32
    tensor: f_e = counts_E[e] / (T * top_k), the fraction of routed pairs sent to e (a constant
    for autograd), P_e = the mean over the T tokens of ``scores_TE[:, e]`` (differentiable).
    ``scores_TE`` (T, E): the score function's output; ``counts_E`` (E,) int."""
    T, E = scores_TE.shape
    f_E = counts_E.detach().float() / max(T * top_k, 1)
    p_E = scores_TE.float().sum(0) / max(T, 1)
    return (f_E * p_E).sum() * (coef * E)


def expert_bias_step(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: ``bias_e += rate * sign(mean -
    count_e)`` with mean the fp32 mean of ``counts_E``: underloaded experts rise, overloaded
    ones fall."""
    c_E = counts_E.float()
    bias_E.add_(torch.sign(c_E.mean() - c_E).to(bias_E.dtype), alpha=rate)
