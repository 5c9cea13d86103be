"""FBGEMM's dense-token ops: ``gather_scale_dense_tokens`` and ``scatter_add_dense_tokens``, with
the names, arguments and results of ``fbgemm_gpu.experimental.gen_ai.moe``, but dead rows are
zero, the scatter declares its mutation (so ``torch.compile`` sees it) and is bitwise
reproducible.

Both are ``torch.library`` custom ops (``moe_kernels::<name>``) with fake implementations: no
host syncs on CUDA, safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no float
atomics. Index tensors may be int32 or int64; float inputs may be non-contiguous (the kernels take
strides). An index outside [0, rows) counts as -1 (FBGEMM's padding), on every path: its row is
zero in the gather and skipped by the scatter (raising instead would need a host sync). Our
plan-driven ``dispatch`` / ``combine`` are in ``tokens.py``.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import tokens as _ref

__all__ = ["gather_scale_dense_tokens", "scatter_add_dense_tokens"]


def _triton():
    return triton_kernels("tokens")  # imported on first use: triton only when a kernel runs


# --------------------------------------------------------------------------------------------
# gather_scale_dense_tokens


def _gather_scale_impl(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> torch.Tensor:
    if not use_triton(x.device):
        return _ref.gather_scale_dense_tokens(
            x, token_indices, expert_indices, scores, valid_token_count
        )
    return _triton().gather_rows(
        x,
        token_indices.contiguous(),
        mode=_triton().SCALE_SCORES,
        scale=scores,
        expert_indices_N=expert_indices.contiguous(),
        valid_token_count=valid_token_count,
    )


def _gather_scale_fake(x, token_indices, expert_indices, scores, valid_token_count):
    return x.new_empty((token_indices.shape[0], x.shape[1]))


gather_scale_dense_tokens_op = register_op(
    "gather_scale_dense_tokens", _gather_scale_impl, _gather_scale_fake
)


def _gather_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gather_scale_backward(ctx, grad_ND):
    """dx[t] = sum over live rows i of token t of grad[i] * s_i, dscores[t, e] = the sum over
    live rows of the pair (t, e) of grad[i] . x[t]: both through ``scatter_add_dense_tokens``
    into fp32 (ascending i, no atomics), then cast."""
    x, tok, exp, scores, vtc = ctx.saved_tensors
    T, E = scores.shape
    if T == 0 or E == 0:  # every row is dead (and there is nothing to index)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_s = torch.zeros_like(scores) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_s, None
    live = _ref.row_mask(tok, T, vtc) & (exp >= 0) & (exp < E)
    dead = torch.full_like(tok, -1)
    safe_tok = torch.where(live, tok, 0).long()
    grad32 = grad_ND.float()
    grad_x = grad_s = None
    if ctx.needs_input_grad[0]:
        scale = scores.float()[safe_tok, torch.where(live, exp, 0).long()]
        grad_x = x.new_zeros(x.shape, dtype=torch.float32)
        rows = torch.where(live, tok, dead)
        scatter_add_dense_tokens_op.call(grad_x, grad32 * scale[:, None], rows, None)
        grad_x = grad_x.to(x.dtype)
    if ctx.needs_input_grad[3]:
        dots = (grad32 * x.float()[safe_tok]).sum(dim=1, keepdim=True)
        flat = torch.where(live, tok.long() * E + exp.long(), -1)
        grad_s = scores.new_zeros((T * E, 1), dtype=torch.float32)
        scatter_add_dense_tokens_op.call(grad_s, dots, flat, None)
        grad_s = grad_s.view(T, E).to(scores.dtype)
    return grad_x, None, None, grad_s, None


gather_scale_dense_tokens_op.register_autograd(_gather_scale_backward, _gather_scale_setup)


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather token rows into the shuffled (expert-sorted) order, scaled by their router score.

    x: (T, D) float32/bf16/fp16; token_indices, expert_indices: (N,) int32/int64; scores: (T, E)
    float; valid_token_count: optional one-element int tensor (the number of valid rows of the
    shuffled list, read on the device). Returns (N, D) in x's dtype with
    ``out[i] = x[tok[i]] * scores[tok[i], exp[i]]`` computed in fp32; rows whose token index is
    outside [0, T) (-1: padding), whose expert index is outside [0, E), or i >= valid_token_count
    are zero.

    Differentiable in x and scores (deterministic: the per-token sums run in ascending i through
    the scatter below, in fp32).
    """
    x, token_indices, expert_indices, scores = V.dense_gather(
        x, token_indices, expert_indices, scores
    )
    V.valid_token_count(valid_token_count, "x", x)
    args = (x, token_indices, expert_indices, scores, valid_token_count)
    return gather_scale_dense_tokens_op.call(*args)


# --------------------------------------------------------------------------------------------
# scatter_add_dense_tokens


def _scatter_add_impl(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> None:
    if not use_triton(out_tokens.device):
        _ref.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)
        return
    if out_tokens.numel() == 0 or in_tokens.shape[0] == 0:
        return
    src_N, bounds_T1 = _ref.scatter_order(token_indices, out_tokens.shape[0], valid_token_count)
    _triton().scatter_add_sorted(out_tokens, in_tokens, src_N, bounds_T1)


def _scatter_add_fake(out_tokens, in_tokens, token_indices, valid_token_count):
    return None


scatter_add_dense_tokens_op = register_op(
    "scatter_add_dense_tokens", _scatter_add_impl, _scatter_add_fake, mutates_args=("out_tokens",)
)


def _scatter_added_impl(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None,
) -> torch.Tensor:
    new = out_tokens.clone()
    _scatter_add_impl(new, in_tokens, token_indices, valid_token_count)
    return new


def _scatter_added_fake(out_tokens, in_tokens, token_indices, valid_token_count):
    return torch.empty_like(out_tokens)


# The functional form autograd differentiates (torch.library registers no autograd formula on an
# op that mutates its inputs): ``scatter_add_dense_tokens`` runs it, then copies the result into
# out_tokens, when a gradient is needed.
scatter_added_dense_tokens_op = register_op(
    "scatter_added_dense_tokens", _scatter_added_impl, _scatter_added_fake
)


def _scatter_added_setup(ctx, inputs, output):
    _, in_tokens, token_indices, vtc = inputs
    ctx.save_for_backward(token_indices, vtc)
    ctx.in_dtype = in_tokens.dtype


def _scatter_added_backward(ctx, grad_TD):
    """d out_tokens = grad; d in_tokens[i] = grad[tok[i]] (zero for skipped entries)."""
    tok, vtc = ctx.saved_tensors
    live = _ref.row_mask(tok, grad_TD.shape[0], vtc)
    grad_in = _ref.gather_rows(grad_TD, tok, None, live).to(ctx.in_dtype)
    return grad_TD, grad_in, None, None


scatter_added_dense_tokens_op.register_autograd(_scatter_added_backward, _scatter_added_setup)


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> None:
    """In place ``out_tokens[token_indices[i]] += in_tokens[i]``, deterministically.

    out_tokens: (T, D) float32/bf16/fp16, or int32/int64 (may be a strided view); in_tokens:
    (N, D), float (any of the three, may differ from out's) for a float out, int32/int64 for an
    integer out; token_indices: (N,) int32/int64; valid_token_count: as in
    ``gather_scale_dense_tokens``. Entries whose index is outside [0, T) (-1: padding; any
    other, e.g. a stale index past T or below -1, likewise) or i >= valid_token_count are skipped.

    Ordering: the contributions to one destination row are added in ascending i, each add done in
    fp32 and rounded to out's dtype, i.e. exactly the sequential loop
    ``for i in range(N): out[tok[i]] = (out[tok[i]].float() + in[i].float()).to(out.dtype)``.
    Integer adds are exact in out's dtype (two's complement, wrapping on overflow like FBGEMM's
    integer atomics), so their order does not matter. Bitwise reproducible on every backend (a
    stable sort of the destinations, then one program per destination row; no atomics).

    Differentiable (float out) in out_tokens and in_tokens when autograd records: the sum is
    then computed out of place and copied into out_tokens (one extra copy of out_tokens).
    """
    out_tokens = V.tensor("out_tokens", out_tokens)
    V.dtype("out_tokens", out_tokens, V.FLOAT_DTYPES + V.INDEX_DTYPES)
    V.rank("out_tokens", out_tokens, 2)
    int_add = not out_tokens.dtype.is_floating_point
    in_tokens = V.tensor("in_tokens", in_tokens)
    V.dtype("in_tokens", in_tokens, V.INDEX_DTYPES if int_add else V.FLOAT_DTYPES)
    V.rank("in_tokens", in_tokens, 2)
    token_indices = V.index_1d("token_indices", token_indices, "out_tokens", out_tokens)
    V.same_device("out_tokens", out_tokens, in_tokens=in_tokens)
    V.dim_size("in_tokens", in_tokens, 1, out_tokens.shape[1], "D of out_tokens")
    V.dim_size("in_tokens", in_tokens, 0, token_indices.shape[0], "len(token_indices)")
    V.valid_token_count(valid_token_count, "out_tokens", out_tokens)
    if int_add or not torch.is_grad_enabled():
        needs_grad = False
    else:
        needs_grad = out_tokens.requires_grad or in_tokens.requires_grad
    args = (out_tokens, in_tokens, token_indices, valid_token_count)
    if needs_grad:
        out_tokens.copy_(scatter_added_dense_tokens_op.call(*args))
    else:
        scatter_add_dense_tokens_op.call(*args)
