"""Pure-torch reference of the gathered grouped GEMM (the CPU path and the tests' oracle).

A loop over the groups with fp32 accumulation. It reads ``offsets`` on the host (one sync): it is
the CPU path; the Triton kernel is the sync-free one. Inputs are assumed checked by
``moe_kernels.grouped_mm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def group_bounds(offsets_E1: torch.Tensor, num_rows: int) -> list[int]:
    """The E+1 group boundaries the grouped GEMMs use, by the clamping rule every path shares
    (the Triton kernels' ``group_tiles``, the CUTLASS offsets of ``clamp_offsets``): offsets[0]
    reads as 0 and each later offset is clamped into [the previous clamped offset, num_rows],
    i.e. the running maximum of the offsets clamped into [0, num_rows]. Offsets keeping the
    contract (non-decreasing from 0, at most num_rows) are unchanged. One host read."""
    bounds, prev = [0], 0
    for b in offsets_E1.tolist()[1:]:
        prev = min(max(int(b), prev), num_rows)
        bounds.append(prev)
    return bounds


class RowGroup(NamedTuple):
    """One non-empty group's rows [start, end) of expert ``expert``: ``src`` (end - start,) int64
    their source rows (0 where not ``live``), ``live`` whether the source is in [0, T)."""

    expert: int
    start: int
    end: int
    src: torch.Tensor
    live: torch.Tensor


def row_groups(
    num_tokens: int, offsets_E1: torch.Tensor, row_indices_P: torch.Tensor | None, num_rows: int
) -> list[RowGroup]:
    """The non-empty groups of the grouped GEMMs' references, by ``group_bounds`` (the host
    read); rows read x[row_indices[p]] (x[p] without row indices); none when T = 0."""
    if num_tokens == 0:
        return []
    device = offsets_E1.device
    src_P = torch.arange(num_rows, device=device) if row_indices_P is None else row_indices_P
    src_P = src_P.long()
    live_P = (src_P >= 0) & (src_P < num_tokens)
    bounds = group_bounds(offsets_E1, num_rows)
    groups = []
    for e in range(len(bounds) - 1):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            live = live_P[start:end]
            groups.append(RowGroup(e, start, end, torch.where(live, src_P[start:end], 0), live))
    return groups


def clamp_group_ends(group_end_offsets: torch.Tensor, bound: int) -> torch.Tensor:
    """(G,) int64: each end offset clamped into [previous clamped end, bound] (0 before the
    first group), i.e. the running maximum of the offsets clamped into [0, bound]: groups stay
    non-decreasing and inside [0, bound] whatever the offsets hold (memory safety, no sync)."""
    return group_end_offsets.to(torch.int64).clamp(0, bound).cummax(0).values


def clamp_offsets(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(E,) int32: the end offsets ``offsets[1:]`` clamped by ``group_bounds``' rule on the
    device (``clamp_group_ends``, no sync), for ``torch._grouped_mm``, which reads its offsets
    unchecked (past the operands' rows, or a negative group size, would be out-of-bounds
    accesses or a device assert)."""
    return clamp_group_ends(offsets_E1[1:], num_rows).to(torch.int32)


def gather_grouped_mm(
    x_TD: torch.Tensor,
    w_END: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """(P, N) in x's dtype: ``y[p] = act(x[rows[p]] @ w[e].T)`` for offsets[e] <= p < offsets[e+1],
    computed in fp32 (product, sum and SiLU), cast once; rows past offsets[E] and rows whose index
    is outside [0, T) are zero. Offsets clamped by ``group_bounds``."""
    num_tokens, _ = x_TD.shape
    n = w_END.shape[1]
    num_rows = num_tokens if row_indices_P is None else row_indices_P.shape[0]
    y_PN = torch.zeros((num_rows, n), dtype=torch.float32, device=x_TD.device)
    for e, start, end, src, live in row_groups(num_tokens, offsets_E1, row_indices_P, num_rows):
        h = x_TD.index_select(0, src).float() @ w_END[e].float().T
        if activation == "silu":
            h = F.silu(h)
        y_PN[start:end] = torch.where(live[:, None], h, 0.0)
    return y_PN.to(x_TD.dtype)


def grouped_weight_grad(
    dy_PN: torch.Tensor,
    x_TD: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(E, N, D) in ``out_dtype``: ``out[e] = dy[rows of e].T @ x[src of those rows]`` in fp32
    (one host read of ``offsets``, like ``gather_grouped_mm``); rows whose source is outside
    [0, T) contribute nothing, an empty group gives zeros. Offsets clamped by ``group_bounds``."""
    num_rows, n = dy_PN.shape
    num_tokens, dim = x_TD.shape
    num_experts = offsets_E1.shape[0] - 1
    out = torch.zeros((num_experts, n, dim), dtype=torch.float32, device=dy_PN.device)
    for e, start, end, src, live in row_groups(num_tokens, offsets_E1, row_indices_P, num_rows):
        xs = torch.where(live[:, None], x_TD.index_select(0, src).float(), 0.0)
        out[e] = torch.where(live[:, None], dy_PN[start:end].float(), 0.0).T @ xs
    return out.to(out_dtype)
