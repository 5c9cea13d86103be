"""Reference of ``moe_kernels.plan_from_choices``: a stable sort of the pairs by local expert."""

from __future__ import annotations

import torch


def plan_from_choices(
    idx_TK: torch.Tensor, w_TK: torch.Tensor, lo: int, L: int
) -> tuple[torch.Tensor, ...]:
    """(counts (L,), offsets (L+1,), expert (P,), token (P,), inverse (T, K) int32, weights (P,)
    fp32, order (P,) int32): pairs sorted by (local expert, token, choice), the choices outside
    [lo, lo + L) after them (expert and token -1, weight 0, inverse -1); ``order[p]``: the pair
    (t * K + j) at sorted position p."""
    T, K = idx_TK.shape
    P, device = T * K, idx_TK.device
    local_P = idx_TK.reshape(-1).long() - lo
    routed_P = (local_P >= 0) & (local_P < L)
    key_P = torch.where(routed_P, local_P, L)  # unrouted pairs sort after every expert
    # Stable: one expert's pairs stay in (token, choice) order, i.e. sorted by token.
    sorted_key_P, order_P = torch.sort(key_P, stable=True)
    bounds = torch.arange(L + 1, device=device, dtype=sorted_key_P.dtype)
    offsets = torch.searchsorted(sorted_key_P, bounds).to(torch.int32)
    kept_P = sorted_key_P < L
    position_P = torch.arange(P, device=device)
    inverse_P = torch.empty_like(order_P).scatter_(0, order_P, position_P)
    return (
        offsets[1:] - offsets[:-1],
        offsets,
        torch.where(kept_P, sorted_key_P.int(), -1),
        torch.where(kept_P, torch.div(order_P, K, rounding_mode="floor").int(), -1),
        torch.where(routed_P, inverse_P.int(), -1).view(T, K),
        torch.where(kept_P, w_TK.reshape(-1)[order_P].float(), 0.0),
        order_P.int(),
    )
