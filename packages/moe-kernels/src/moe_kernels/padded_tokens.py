"""``scatter_add_padded_tokens`` with FBGEMM gen_ai's name and call form
(``fbgemm_gpu.experimental.gen_ai.moe``, 1.6.0): the expert-parallel combine's scatter-add of
padded per-rank buffers into token order, deterministic.

A ``torch.library`` custom op (``moe_kernels::scatter_add_padded_tokens``, mutating
``out_tokens``) with a fake kernel: no host sync on CUDA, safe under
``torch.compile(fullgraph=True)`` and CUDA-graph capture, no atomics (FBGEMM adds with float
atomics, in any order): the same bits run to run and on every backend.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import padded_tokens as _ref

__all__ = ["scatter_add_padded_tokens"]


def _impl(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> None:
    if use_triton(out_tokens.device):
        triton_kernels("padded_tokens").scatter_add_padded(
            out_tokens, in_tokens, token_counts, token_indices
        )
    else:
        _ref.scatter_add_padded_tokens(in_tokens, token_counts, token_indices, out_tokens)


def _fake(in_tokens, token_counts, token_indices, out_tokens):
    return None


scatter_add_padded_tokens_op = register_op(
    "scatter_add_padded_tokens", _impl, _fake, mutates_args=("out_tokens",)
)


def scatter_add_padded_tokens(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> None:
    """In place ``out_tokens[token_indices[p]] += in_tokens[rank(p), p]`` for every live p.

    in_tokens: (EP, T_K, D), rank r's padded buffer of T_K rows; token_counts: (E,) int32/int64,
    E divisible by EP, expert e's rows are the positions of its cumulative-count range, and
    ``rank(p) = e // (E // EP)`` for the expert e holding position p; token_indices: (T_K,)
    int32/int64, the destination row of each position; out_tokens: (T, D), updated in place (may be
    a strided view). Floats: out float32/bf16/fp16 and in any of the three; integers: out and in
    int32/int64. in_tokens, token_counts and token_indices may be strided.

    Live positions: p < sum(token_counts) (and < T_K); the others are skipped, as are indices
    outside [0, T) (memory-safe; undefined by contract, like counts outside [0, T_K], which are
    clamped into it: negative counts count as 0, and huge ones cannot overflow the sums).

    Ordering: the contributions to one destination row are added in ascending p, each add in fp32
    rounded to out's dtype: exactly ``for p in live: out[idx[p]] = (out[idx[p]].float() +
    in[rank(p), p].float()).to(out.dtype)``; integer adds are exact (wrapping), order-free.

    Differences from FBGEMM: deterministic (FBGEMM: float atomics); out_tokens may have any number
    of rows T (FBGEMM asserts T_K % T == 0); any D (FBGEMM: D divisible by its block of 512 or
    1024 columns); strided tensors and integer tokens accepted. Not differentiable: with grad mode
    on, an in_tokens or out_tokens that requires grad is a RuntimeError (autograd would not see
    the in-place add).
    """
    out_tokens = V.tensor("out_tokens", out_tokens)
    V.dtype("out_tokens", out_tokens, V.FLOAT_DTYPES + V.INDEX_DTYPES)
    V.rank("out_tokens", out_tokens, 2)
    int_add = not out_tokens.dtype.is_floating_point
    in_tokens = V.tensor("in_tokens", in_tokens)
    V.dtype("in_tokens", in_tokens, V.INDEX_DTYPES if int_add else V.FLOAT_DTYPES)
    V.rank("in_tokens", in_tokens, 3)
    V.same_device("out_tokens", out_tokens, in_tokens=in_tokens)
    V.dim_size("in_tokens", in_tokens, 2, out_tokens.shape[1], "D of out_tokens")
    num_ranks, num_positions = in_tokens.shape[:2]
    if num_ranks < 1:
        raise ValueError(f"in_tokens must have at least one rank (dim 0), got shape "
                         f"{tuple(in_tokens.shape)}")  # fmt: skip
    token_counts = V.tensor("token_counts", token_counts)
    V.dtype("token_counts", token_counts, V.INDEX_DTYPES)
    V.rank("token_counts", token_counts, 1)
    V.same_device("out_tokens", out_tokens, token_counts=token_counts)
    if token_counts.shape[0] % num_ranks != 0:
        raise ValueError(
            f"token_counts must hold a multiple of EP={num_ranks} experts (in_tokens.shape[0]), "
            f"got shape {tuple(token_counts.shape)}"
        )
    token_indices = V.tensor("token_indices", token_indices)
    V.dtype("token_indices", token_indices, V.INDEX_DTYPES)
    V.rank("token_indices", token_indices, 1)
    V.same_device("out_tokens", out_tokens, token_indices=token_indices)
    V.dim_size("token_indices", token_indices, 0, num_positions, "T_K, in_tokens.shape[1]")
    if torch.is_grad_enabled():  # an unrecorded in-place add would give silent wrong gradients
        for name, t in (("in_tokens", in_tokens), ("out_tokens", out_tokens)):
            if t.requires_grad:
                raise RuntimeError(
                    f"scatter_add_padded_tokens is not differentiable, and {name} requires grad: "
                    "detach it or call under torch.no_grad()"
                )
    scatter_add_padded_tokens_op.call(in_tokens, token_counts, token_indices, out_tokens)
