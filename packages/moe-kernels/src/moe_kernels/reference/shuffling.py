"""Pure-torch references for the expert-parallel reshuffles (the CPU path and the tests' oracle).

Both ops copy (rank, expert) chunks of rows between two layouts of the same (T, D) buffer:

* rank-first ("B"): rank by rank, and inside a rank its experts over ALL columns of
  ``token_counts`` (with ``padded``: rank r's chunks start at ``r * (T // EP)``);
* expert-first ("A"): the local experts ``[start, end)`` one by one, and inside an expert its
  ranks, compact from row 0.

``combine`` reads B and writes A, ``split`` reads A and writes B. Every output row is either the
copy of one input row or zero. Counts are clamped into [0, T] (negatives count as zero; a count
above T moves no row that stays inside the buffers, and no sum can overflow); a chunk's rows that
fall outside the input, or (padded side) past its rank's block of ``T // EP`` rows, are not
copied. So chunks never overlap in either layout and every output row has at most one source:
the result is defined (and deterministic) even for counts that break the contract.

The Triton kernel (``moe_kernels._triton.shuffling``) computes the same row map in registers.
Inputs are assumed checked by ``moe_kernels.shuffling``; nothing here reads a value back to the
host.
"""

from __future__ import annotations

import torch


def chunk_tables(
    counts_RE: torch.Tensor, start: int, end: int, num_rows: int, padded: bool, combine: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_start, src_start, n), each (C,) int64 over the C = EP * (end - start) local chunks in
    the order of the output layout (so out_start never decreases): the chunk's first output row,
    its first input row and how many of its rows are copied."""
    num_ranks = counts_RE.shape[0]
    k_RE = counts_RE.long().clamp(0, num_rows)
    k_RG = k_RE[:, start:end]
    zero_R1 = k_RE.new_zeros((num_ranks, 1))
    # B: rows of rank r before expert e (over all columns), and the rank's first row
    pre_RG = torch.cat([zero_R1, k_RE.cumsum(1)], 1)[:, start:end]
    if padded:
        block = num_rows // num_ranks
        rank_base_R1 = torch.arange(num_ranks, device=k_RE.device)[:, None] * block
        b_RG = rank_base_R1 + pre_RG.clamp_max(block)
        n_RG = torch.minimum(k_RG, (block - pre_RG).clamp_min(0))
    else:
        rows_R = k_RE.sum(1)
        b_RG = (rows_R.cumsum(0) - rows_R)[:, None] + pre_RG
        n_RG = k_RG
    # A: experts in order, ranks in order inside an expert (the transposed exclusive cumsum)
    a_GR = (k_RG.t().reshape(-1).cumsum(0) - k_RG.t().reshape(-1)).view(end - start, num_ranks)
    a_RG = a_GR.t()
    if combine:  # output order: expert-major
        return a_GR.reshape(-1), b_RG.t().reshape(-1), n_RG.t().reshape(-1)
    return b_RG.reshape(-1), a_RG.reshape(-1), n_RG.reshape(-1)  # rank-major


def row_sources(
    counts_RE: torch.Tensor, start: int, end: int, num_rows: int, padded: bool, combine: bool
) -> torch.Tensor:
    """(T,) int64: the input row copied into each output row, -1 where the row is zero."""
    out_start_C, src_start_C, n_C = chunk_tables(counts_RE, start, end, num_rows, padded, combine)
    rows_T = torch.arange(num_rows, device=counts_RE.device)
    if n_C.numel() == 0:
        return torch.full_like(rows_T, -1)
    # the last chunk starting at or before the row: the one holding it, if any holds it
    c_T = (torch.searchsorted(out_start_C, rows_T, right=True) - 1).clamp_min(0)
    rel_T = rows_T - out_start_C[c_T]
    src_T = src_start_C[c_T] + rel_T
    live_T = (rel_T >= 0) & (rel_T < n_C[c_T]) & (src_T >= 0) & (src_T < num_rows)
    return torch.where(live_T, src_T, -1)


def _copy_rows(tokens_TD: torch.Tensor, src_T: torch.Tensor) -> torch.Tensor:
    live_T = src_T >= 0
    if tokens_TD.shape[0] == 0:
        return tokens_TD.new_zeros(tokens_TD.shape)
    rows = tokens_TD.index_select(0, src_T.clamp_min(0))
    return torch.where(live_T[:, None], rows, rows.new_zeros(()))


def combine_shuffling(
    tokens_TD: torch.Tensor, counts_RE: torch.Tensor, start: int, end: int, padded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T, D), counts (end - start + 1,)): rank-first chunks of experts [start, end) copied
    into expert-first order; counts are the per-expert sums over ranks (in counts' dtype, raw
    values), then their total."""
    src_T = row_sources(counts_RE, start, end, tokens_TD.shape[0], padded, combine=True)
    per_expert = counts_RE[:, start:end].sum(0, dtype=torch.int64)
    counts_out = torch.cat([per_expert, per_expert.sum().reshape(1)]).to(counts_RE.dtype)
    return _copy_rows(tokens_TD, src_T), counts_out


def split_shuffling(
    tokens_TD: torch.Tensor, counts_RE: torch.Tensor, start: int, end: int, padded: bool
) -> torch.Tensor:
    """(T, D): expert-first chunks of experts [start, end) copied back into rank-first order;
    every other row is zero."""
    src_T = row_sources(counts_RE, start, end, tokens_TD.shape[0], padded, combine=False)
    return _copy_rows(tokens_TD, src_T)
