"""The routing ops' named outputs (shared by the public ops, the reference and the kernels)."""

from __future__ import annotations

from typing import NamedTuple

import torch


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


class ShuffledIndices(NamedTuple):
    """``index_shuffling``'s outputs (FBGEMM's order), for T tokens, top_k choices, E experts.

    token_count_per_expert: (E+2,) int32: [e] pairs routed to e (0 outside the expert range),
                            [E] = T, [E+1] = n, the number of routed pairs.
    expert_indices:         (T*top_k,) int32: expert - start of each sorted pair, -1 past n.
    token_indices:          (T*top_k,) int32: token of each sorted pair, -1 past n.
    """

    token_count_per_expert: torch.Tensor
    expert_indices: torch.Tensor
    token_indices: torch.Tensor


class Selection(NamedTuple):
    """route's selection arguments, validated: ``bias`` (E,) float or None, ``n_groups`` and
    ``topk_groups`` (<= n_groups) of contiguous expert groups, ``scale`` of the weights."""

    bias: torch.Tensor | None = None
    n_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    @property
    def plain(self) -> bool:
        """Whether the selection is plain top-k of the scores with unscaled weights."""
        return self.bias is None and self.topk_groups == self.n_groups and self.scale == 1.0
