"""Pure-torch references for the token-movement ops (the CPU path and the tests' oracle).

Each function computes exactly what its Triton twin in ``moe_kernels._triton.tokens`` computes,
rounding step for rounding step, so the two agree bit for bit on the GPU. Inputs are assumed
checked by ``moe_kernels.tokens``. Only ``scatter_add_dense_tokens`` reads a value back to the
host (the longest run of contributions to one row, to bound its loop); the others are sync-free.
"""

from __future__ import annotations

import torch


def row_mask(
    token_indices_N: torch.Tensor, num_tokens: int, valid_token_count: torch.Tensor | None
) -> torch.Tensor:
    """(N,) bool: row i is live when 0 <= token_indices[i] < T and i < valid_token_count."""
    tok_N = token_indices_N.long()
    live_N = (tok_N >= 0) & (tok_N < num_tokens)
    if valid_token_count is not None:
        rows_N = torch.arange(tok_N.shape[0], device=tok_N.device)
        live_N &= rows_N < valid_token_count.reshape(()).long()
    return live_N


def gather_rows(
    x_TD: torch.Tensor,
    token_indices_N: torch.Tensor,
    row_scale_N: torch.Tensor | None,
    live_N: torch.Tensor,
) -> torch.Tensor:
    """out[i] = x[token_indices[i]] (* row_scale[i] in fp32) where live, else 0; x's dtype.
    ``live`` must be False where the index is outside [0, T) (``row_mask``)."""
    if x_TD.shape[0] == 0:  # nothing to read: every row is dead (index_select would raise)
        return x_TD.new_zeros((token_indices_N.shape[0], x_TD.shape[1]))
    safe_N = torch.where(live_N, token_indices_N.long(), 0)
    rows_ND = x_TD.index_select(0, safe_N)
    if row_scale_N is not None:
        rows_ND = (rows_ND.float() * row_scale_N.float()[:, None]).to(x_TD.dtype)
    return torch.where(live_N[:, None], rows_ND, rows_ND.new_zeros(()))


def gather_scale_dense_tokens(
    x_TD: torch.Tensor,
    token_indices_N: torch.Tensor,
    expert_indices_N: torch.Tensor,
    scores_TE: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, D) in x's dtype: x[tok[i]] * scores[tok[i], exp[i]] in fp32; dead rows are zero.

    A row is dead when its token index is -1 (or out of range), its expert index is outside
    [0, E), or i >= valid_token_count.
    """
    num_tokens, num_experts = scores_TE.shape
    exp_N = expert_indices_N.long()
    live_N = row_mask(token_indices_N, num_tokens, valid_token_count)
    live_N &= (exp_N >= 0) & (exp_N < num_experts)
    safe_tok_N = torch.where(live_N, token_indices_N.long(), 0)
    safe_exp_N = torch.where(live_N, exp_N, 0)
    if num_tokens == 0 or num_experts == 0:  # every row is dead (nothing to index)
        return x_TD.new_zeros((token_indices_N.shape[0], x_TD.shape[1]))
    scale_N = scores_TE[safe_tok_N, safe_exp_N].float()
    return gather_rows(x_TD, token_indices_N, scale_N, live_N)


def dispatch(
    x_TD: torch.Tensor, token_indices_N: torch.Tensor, weights_N: torch.Tensor, scale: bool
) -> torch.Tensor:
    """(N, D): x[token_indices[p]] (times weights[p] in fp32 when scale); tail rows (-1) zero."""
    live_N = row_mask(token_indices_N, x_TD.shape[0], None)
    if x_TD.shape[0] == 0:
        return x_TD.new_zeros((token_indices_N.shape[0], x_TD.shape[1]))
    return gather_rows(x_TD, token_indices_N, weights_N if scale else None, live_N)


def scatter_order(
    token_indices_N: torch.Tensor, num_tokens: int, valid_token_count: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, bounds): the live entries i grouped by destination row, ascending i inside a row
    (a stable device-side sort of the destinations, no host sync); row t's sources are
    ``src[bounds[t]:bounds[t+1]]``. Shared by the reference and the Triton path."""
    num_rows = token_indices_N.shape[0]
    small = max(num_rows, num_tokens) < 2**31 - 1
    key_dtype = torch.int32 if small else torch.int64
    live_N = row_mask(token_indices_N, num_tokens, valid_token_count)
    key_N = torch.where(live_N, token_indices_N, num_tokens).to(key_dtype)
    key_sorted_N, src_N = torch.sort(key_N, stable=True)
    queries = torch.arange(num_tokens + 1, device=key_N.device, dtype=key_dtype)
    bounds_T1 = torch.searchsorted(key_sorted_N, queries, out_int32=small)
    return src_N, bounds_T1


def scatter_add_dense_tokens(
    out_TD: torch.Tensor,
    in_ND: torch.Tensor,
    token_indices_N: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> None:
    """In place: out[tok[i]] += in[i], sequentially in ascending i for each destination row.

    Each add is done in fp32 and rounded to out's dtype (the order and rounding of a Python loop
    ``for i in range(N): out[tok[i]] = (out[tok[i]].float() + in[i].float()).to(out.dtype)``);
    for an integer out, exactly in out's dtype (wrapping). Entries with token index -1 (or out of
    range) or i >= valid_token_count are skipped.
    """
    num_tokens = out_TD.shape[0]
    src_N, bounds_T1 = scatter_order(token_indices_N, num_tokens, valid_token_count)
    start_T, count_T = bounds_T1[:-1].long(), (bounds_T1[1:] - bounds_T1[:-1]).long()
    rows_T = torch.arange(num_tokens, device=out_TD.device)
    longest = int(count_T.max()) if num_tokens > 0 else 0  # the one host read (loop bound)
    for r in range(longest):  # r-th contribution of every row that has one: no duplicates
        has_R = count_T > r
        dst_R = rows_T[has_R]
        src_R = src_N[start_T[has_R] + r]
        if out_TD.dtype.is_floating_point:
            out_TD[dst_R] = (out_TD[dst_R].float() + in_ND[src_R].float()).to(out_TD.dtype)
        else:
            out_TD[dst_R] = out_TD[dst_R] + in_ND[src_R].to(out_TD.dtype)


def combine(
    y_ND: torch.Tensor,
    inverse_TK: torch.Tensor,
    weights_N: torch.Tensor,
    weighted: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(T, D): sum over j of weights[inverse[t, j]] * y[inverse[t, j]], in fp32 in j order.

    ``acc = 0; for j: acc = acc + w * y`` (product rounded to fp32, then the sum: no fused
    multiply-add), entries with inverse -1 (or out of range) skipped, then cast to out_dtype.
    """
    num_rows, dim = y_ND.shape
    num_tokens, top_k = inverse_TK.shape
    acc_TD = torch.zeros((num_tokens, dim), dtype=torch.float32, device=y_ND.device)
    if num_rows == 0:
        return acc_TD.to(out_dtype)
    for j in range(top_k):
        pos_T = inverse_TK[:, j].long()
        ok_T = (pos_T >= 0) & (pos_T < num_rows)
        safe_T = torch.where(ok_T, pos_T, 0)
        term_TD = y_ND.index_select(0, safe_T).float()
        if weighted:
            term_TD = weights_N.float().index_select(0, safe_T)[:, None] * term_TD
        acc_TD = torch.where(ok_T[:, None], acc_TD + term_TD, acc_TD)
    return acc_TD.to(out_dtype)


def gather_dots(
    a_PD: torch.Tensor | None,
    b_TD: torch.Tensor,
    tok_P: torch.Tensor,
    w_P: torch.Tensor | None,
    rows_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows, dots): ``rows[p] = w[p] * b[tok[p]]`` in fp32 cast to ``rows_dtype`` (unscaled
    without w; None without rows_dtype), ``dots[p] = sum_d a[p, d] * b[tok[p], d]`` in fp32 (None
    without a); zero where tok[p] is outside [0, T)."""
    live_P = row_mask(tok_P, b_TD.shape[0], None)
    b_PD = gather_rows(b_TD, tok_P, None, live_P).float()
    rows = dots = None
    if rows_dtype is not None:
        rows = (b_PD if w_P is None else b_PD * w_P.float()[:, None]).to(rows_dtype)
    if a_PD is not None:
        dots = (a_PD.float() * b_PD).sum(dim=1)
    return rows, dots
