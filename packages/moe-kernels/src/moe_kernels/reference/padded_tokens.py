"""Pure-torch reference for ``scatter_add_padded_tokens`` (the CPU path and the tests' oracle).

Position p of the padded buffers belongs to the expert whose cumulative-count range holds it and
to that expert's rank ``e // (E // EP)``; its row is ``in_tokens[rank, p]``. The positions are
mapped to rows of ``in_tokens`` seen as (EP * T_K, D) (``position_rows``), then added with the
dense scatter-add's reference (``moe_kernels.reference.tokens``: ascending p for each
destination row, each add in fp32 rounded to out's dtype, exact for integers). Like it, this
reads one value back to the host (its loop bound), on the CPU path only; ``position_rows`` is
sync-free and is shared with the Triton path.
"""

from __future__ import annotations

import torch

from moe_kernels.reference import tokens as _tokens


def position_rows(
    counts_E: torch.Tensor, num_ranks: int, num_positions: int, rank_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (T_K,) int64, total (1,) int64): position p's row ``rank(p) * rank_rows + p`` in the
    (EP * rank_rows, D) view of in_tokens, and the number of live positions (the sum of the
    counts, each clamped into [0, T_K]: negatives count as zero, and no sum overflows).
    Positions past the total get the last rank's row (dead anyway)."""
    num_experts = counts_E.shape[0]
    p_P = torch.arange(num_positions, device=counts_E.device)
    if num_experts == 0:
        return p_P, p_P.new_zeros(1)
    k_RG = counts_E.long().clamp(0, num_positions).view(num_ranks, num_experts // num_ranks)
    rank_end_R = k_RG.sum(1).cumsum(0)  # positions of the ranks <= r
    rank_P = torch.searchsorted(rank_end_R, p_P, right=True).clamp_max(num_ranks - 1)
    return rank_P * rank_rows + p_P, rank_end_R[-1:]


def scatter_add_padded_tokens(
    in_RPD: torch.Tensor,
    counts_E: torch.Tensor,
    token_indices_P: torch.Tensor,
    out_TD: torch.Tensor,
) -> None:
    """In place: ``out[idx[p]] += in[rank(p), p]`` for p < sum(counts), sequentially in ascending
    p for each destination row (fp32 adds rounded to out's dtype; exact integer adds); indices
    outside [0, T) are skipped."""
    num_ranks, num_positions, dim = in_RPD.shape
    if num_positions == 0 or counts_E.shape[0] == 0:
        return
    rows_P, total = position_rows(counts_E, num_ranks, num_positions, num_positions)
    in_PD = in_RPD.reshape(num_ranks * num_positions, dim).index_select(0, rows_P)
    _tokens.scatter_add_dense_tokens(out_TD, in_PD, token_indices_P, total)
