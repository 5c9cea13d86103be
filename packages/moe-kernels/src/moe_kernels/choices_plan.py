"""``plan_from_choices``: the ``RoutingPlan`` of routing decisions made elsewhere.

For a framework that routes itself (a Hugging Face router, a checkpoint's own top-k): its
(T, k) expert indices and weights become the plan every expert op here reads, without host
syncs (torch.compile fullgraph, CUDA graphs) and deterministic (a stable sort). One custom op
(``moe_kernels::plan_from_choices``): up to ``MAX_PAIRS`` pairs one Triton program on CUDA (a
decode step's plan in one launch), else the torch reference (``reference.choices_plan``).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import choices_plan as _ref
from moe_kernels.routing import RoutingPlan

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_PAIRS = 4096  # the one-program kernel's limit (moe_kernels._triton.choices_plan)


def _impl(idx_TK: torch.Tensor, w_TK: torch.Tensor, lo: int, L: int) -> list[torch.Tensor]:
    if use_triton(idx_TK.device) and idx_TK.numel() <= MAX_PAIRS:
        kernels = triton_kernels("choices_plan")
        if kernels.RUNS:
            return list(kernels.plan_from_choices(idx_TK, w_TK, lo, L))
    return list(_ref.plan_from_choices(idx_TK, w_TK, lo, L))


def _fake(idx_TK, w_TK, lo, L):
    T, K = idx_TK.shape
    P, i32 = T * K, dict(dtype=torch.int32, device=idx_TK.device)
    f32 = dict(dtype=torch.float32, device=idx_TK.device)
    sizes = ((L,), (L + 1,), (P,), (P,), (T, K))
    return [*(torch.empty(n, **i32) for n in sizes), torch.empty(P, **f32), torch.empty(P, **i32)]


plan_from_choices_op = register_op("plan_from_choices", _impl, _fake)


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
    counts, offsets, expert, token, inverse, w_P, order = plan_from_choices_op.call(
        expert_indices, weights.detach(), lo, hi - lo
    )
    if weights.requires_grad and torch.is_grad_enabled():  # the weights as a gather: autograd
        w_P = torch.where(expert >= 0, weights.reshape(-1)[order.long()].float(), 0.0)
    return RoutingPlan(counts, offsets, expert, token, w_P, inverse)
