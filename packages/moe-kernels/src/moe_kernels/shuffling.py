"""Expert-parallel token reshuffles with FBGEMM gen_ai's names and call forms:
``combine_shuffling`` / ``split_shuffling`` (``fbgemm_gpu.experimental.gen_ai.moe``, 1.6.0).

After an all-to-all, a rank holds the rows every rank sent it, rank by rank; ``combine_shuffling``
regroups them expert by expert (the input of the grouped GEMMs), ``split_shuffling`` puts the
experts' outputs back in rank order for the return all-to-all.

Layouts, for ``token_counts`` (EP, E) (rows of rank r for expert e) and the local experts
``[expert_start, expert_end)`` (EG of them):

* rank-first: chunk (r, e) starts after every chunk of the ranks before r and the chunks of rank r
  for the experts before e, over ALL E columns (so non-local columns take room too). With
  ``is_padded``, rank r's chunks start at ``r * (T // EP)`` instead (each rank owns a padded block
  of T // EP rows).
* expert-first: the local experts' chunks, expert by expert and rank by rank inside an expert,
  compact from row 0.

Both ops are ``torch.library`` custom ops (``moe_kernels::combine_shuffling``,
``moe_kernels::split_shuffling``) with fake kernels: one kernel launch each on CUDA, counts read
on the device (no host sync), output shapes from the input shapes alone; safe under
``torch.compile(fullgraph=True)`` and CUDA-graph capture; deterministic (every output row is one
input row or zero; with ``zero_unowned=False`` the rows no chunk holds are not determined).

Differences from FBGEMM: rows FBGEMM leaves unwritten (``torch.empty_like``) are zero here
unless ``zero_unowned=False`` asks for FBGEMM's contract (then they are left unwritten, and a
program whose rows all lie past the last owned row does no more than read the counts);
tokens of any 1/2/4/8-byte dtype (a bit copy) and strided tokens / counts are accepted; counts
that break the contract (negative, summing past T, or past a rank's padded block) are undefined
by contract but memory-safe: counts are clamped into [0, T] (negative counts count as zero, huge
ones cannot overflow the offsets), rows that would fall outside the tensor or outside their
rank's padded block are not copied. No autograd: backward through an
output raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import shuffling as _ref

__all__ = ["CombinedTokens", "combine_shuffling", "split_shuffling"]


class CombinedTokens(NamedTuple):
    """``combine_shuffling``'s result; a tuple, so ``tokens, counts = combine_shuffling(...)``
    works as with FBGEMM."""

    tokens: torch.Tensor  # (T, D) tokens' dtype: expert-first rows, zero past the total
    token_counts: torch.Tensor  # (EG + 1,) counts' dtype: rows per local expert, then the total


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _run(tokens, token_counts, expert_start, expert_end, is_padded, combine, zero):
    if use_triton(tokens.device):
        return triton_kernels("shuffling").shuffle(
            tokens, token_counts, expert_start, expert_end, is_padded, combine, zero=zero
        )
    bits = _BITS[tokens.element_size()]  # the reference moves bits too (fp8, bool, ... on CPU)
    if combine:
        out, counts = _ref.combine_shuffling(
            tokens.view(bits), token_counts, expert_start, expert_end, is_padded
        )
        return out.view(tokens.dtype), counts
    out = _ref.split_shuffling(tokens.view(bits), token_counts, expert_start, expert_end, is_padded)
    return out.view(tokens.dtype), None


def _combine_impl(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int,
    expert_end: int,
    is_padded: bool,
    zero_unowned: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(tokens, token_counts, expert_start, expert_end, is_padded, True, zero_unowned)


def _combine_fake(tokens, token_counts, expert_start, expert_end, is_padded, zero_unowned):
    counts = token_counts.new_empty(expert_end - expert_start + 1)
    return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device), counts


combine_shuffling_op = register_op("combine_shuffling", _combine_impl, _combine_fake)


def _split_impl(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int,
    expert_end: int,
    is_padded: bool,
    zero_unowned: bool,
) -> torch.Tensor:
    return _run(tokens, token_counts, expert_start, expert_end, is_padded, False, zero_unowned)[0]


def _split_fake(tokens, token_counts, expert_start, expert_end, is_padded, zero_unowned):
    return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)


split_shuffling_op = register_op("split_shuffling", _split_impl, _split_fake)


def _check(
    tokens: object,
    token_counts: object,
    expert_start: object,
    expert_end: object,
    is_padded: object,
    is_balanced: object,
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    tokens = V.tensor("tokens", tokens)
    V.rank("tokens", tokens, 2)
    if tokens.element_size() not in _BITS:
        raise TypeError(f"tokens must have a dtype of 1, 2, 4 or 8 bytes, got {tokens.dtype}")
    token_counts = V.tensor("token_counts", token_counts)
    V.dtype("token_counts", token_counts, V.INDEX_DTYPES)
    V.rank("token_counts", token_counts, 2)
    V.same_device("tokens", tokens, token_counts=token_counts)
    num_ranks, num_experts = token_counts.shape
    if num_ranks < 1:
        raise ValueError(f"token_counts must have at least one rank (row), got shape "
                         f"{tuple(token_counts.shape)}")  # fmt: skip
    start = 0 if expert_start is None else V.int_arg("expert_start", expert_start, 0, num_experts)
    end = num_experts if expert_end is None else V.int_arg("expert_end", expert_end, 0, num_experts)
    if end < start:
        raise ValueError(f"expert_end must be >= expert_start ({start}), got {end}")
    if not isinstance(is_padded, bool):
        raise TypeError(f"is_padded must be a bool, got {type(is_padded).__name__}")
    if is_balanced is not None:
        if not isinstance(is_balanced, bool):
            raise TypeError(f"is_balanced must be a bool, got {type(is_balanced).__name__}")
        if is_padded and not is_balanced:
            raise ValueError("is_balanced (an alias of is_padded) contradicts is_padded=True")
        is_padded = is_balanced
    if is_padded and tokens.shape[0] % num_ranks != 0:
        raise ValueError(
            f"tokens must have a number of rows divisible by EP={num_ranks} when is_padded "
            f"(each rank owns T // EP rows), got shape {tuple(tokens.shape)}"
        )
    return tokens, token_counts, start, end, is_padded


def combine_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int | None = None,
    expert_end: int | None = None,
    is_padded: bool = False,
    *,
    is_balanced: bool | None = None,
    zero_unowned: bool = True,
) -> CombinedTokens:
    """Regroup rank-first rows into expert-first order, for the local experts only.

    tokens: (T, D), any dtype of 1, 2, 4 or 8 bytes (bf16 in FBGEMM's tests; copied bit for bit),
    may be strided; token_counts: (EP, E) int32/int64, rows of rank r for expert e;
    expert_start / expert_end: the local experts [start, end) (default: all E); is_padded: rank r's
    rows start at ``r * (T // EP)`` (T must be divisible by EP). ``is_balanced`` (keyword only,
    the name of some FBGEMM versions) is an alias of ``is_padded``: for truly balanced counts
    (every rank holding T // EP rows) the two layouts coincide.

    Returns ``CombinedTokens(tokens, token_counts)``: tokens (T, D), where output chunk (e, r)
    (local experts in order, ranks in order inside an expert, compact from row 0) is input chunk
    (r, e) of the rank-first layout; rows past the total are zero, or with ``zero_unowned=False``
    unspecified (FBGEMM's contract: left unwritten, and skipped, on CUDA). token_counts (EG + 1,)
    in the counts' dtype: for each local expert the sum over ranks, then the sum of those.
    """
    tokens, token_counts, start, end, padded = _check(
        tokens, token_counts, expert_start, expert_end, is_padded, is_balanced
    )
    _check_flag("zero_unowned", zero_unowned)
    out, counts = combine_shuffling_op.call(tokens, token_counts, start, end, padded, zero_unowned)
    return CombinedTokens(out, counts)


def split_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int | None = None,
    expert_end: int | None = None,
    is_padded: bool = False,
    init_with_zeros: bool = False,
    *,
    is_balanced: bool | None = None,
    zero_unowned: bool = True,
) -> torch.Tensor:
    """The inverse of ``combine_shuffling``: expert-first rows back into rank-first order.

    Arguments as in ``combine_shuffling``; tokens hold the local experts' chunks expert-first
    (compact from row 0). Returns (T, D) in tokens' dtype where output chunk (r, e) of the
    rank-first layout over all E columns (padded blocks with ``is_padded``) is input chunk (e, r);
    every other row (non-local experts' chunks, padding, rows past the total) is zero, or with
    ``zero_unowned=False`` unspecified (FBGEMM's contract: left unwritten on CUDA).
    ``init_with_zeros`` (FBGEMM's name) zeroes them whatever ``zero_unowned`` says: FBGEMM leaves
    them as garbage unless it is set; here they are zero unless ``zero_unowned=False`` is asked.
    """
    _check_flag("init_with_zeros", init_with_zeros)
    _check_flag("zero_unowned", zero_unowned)
    tokens, token_counts, start, end, padded = _check(
        tokens, token_counts, expert_start, expert_end, is_padded, is_balanced
    )
    zero = zero_unowned or init_with_zeros
    return split_shuffling_op.call(tokens, token_counts, start, end, padded, zero)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
