"""Pure-torch reference of ``gather_scale_quant_dense_tokens`` (the CPU path and the tests'
oracle): exact fp32 products, then the row-wise quantisation of ``reference.fp8_rowwise``, so
the Triton kernel (``moe_kernels._triton.gather_quant``) matches it bit for bit."""

from __future__ import annotations

import torch

from moe_kernels.reference.fp8_rowwise import FP8_DTYPE, quantize_rows
from moe_kernels.reference.tokens import row_mask


def gather_scale_quant_dense_tokens(
    x_TD: torch.Tensor,
    token_indices_N: torch.Tensor,
    expert_indices_N: torch.Tensor,
    scores_TE: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, D) float8_e4m3fn, scale (N,) fp32) of ``v_i = x[tok_i] * scores[tok_i, exp_i]``
    (fp32 product). A row is dead (q and scale zero) when its token index is outside [0, T), its
    expert index outside [0, E), or i >= valid_token_count."""
    num_tokens, num_experts = scores_TE.shape
    num_rows, dim = token_indices_N.shape[0], x_TD.shape[1]
    exp_N = expert_indices_N.long()
    live_N = row_mask(token_indices_N, num_tokens, valid_token_count)
    live_N &= (exp_N >= 0) & (exp_N < num_experts)
    if num_tokens == 0 or num_experts == 0:  # every row is dead
        q = torch.zeros((num_rows, dim), dtype=FP8_DTYPE, device=x_TD.device)
        return q, torch.zeros(num_rows, dtype=torch.float32, device=x_TD.device)
    safe_tok_N = torch.where(live_N, token_indices_N.long(), 0)
    safe_exp_N = torch.where(live_N, exp_N, 0)
    score_N = scores_TE[safe_tok_N, safe_exp_N].float()
    v_ND = x_TD.index_select(0, safe_tok_N).float() * score_N[:, None]
    return quantize_rows(v_ND, live_N, scale_ub)
