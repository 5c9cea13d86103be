"""Inputs of the expert-parallel token ops, FBGEMM's test forms, shared by the GPU tests and the
timing scripts: random rows, random count splits, the padded scatter-add's problems, and the
reshuffle reference run on bit views (any token dtype)."""

from __future__ import annotations

import torch

from moe_kernels.reference import shuffling as ref_sh

__all__ = ["gen", "ref_shuffle", "scatter_problem", "split_counts", "tokens_of"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gen(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator on ``device`` (default the CPU) seeded with ``seed``."""
    return torch.Generator(device or "cpu").manual_seed(seed)


def tokens_of(rows: int, dim: int, dtype: torch.dtype, seed: int, *, device) -> torch.Tensor:
    """(rows, dim) random non-zero rows of ``dtype``, made on ``device`` (big buffers would take
    minutes on a CPU); fp8 and integer tokens scaled by 8 so most are non-zero."""
    x = torch.randn(rows, dim, generator=gen(seed, device), device=device) + 0.25
    if dtype in (torch.float8_e4m3fn, torch.int64, torch.int32):
        x = x * 8
    return x.to(dtype)


def split_counts(rows, ranks, cols, seed, dtype=torch.int32, cap=None, *, device) -> torch.Tensor:
    """(ranks, cols) counts, FBGEMM's test form: a random split of ``rows`` into chunks (many
    zeros); ``cap``: each rank's own split of at most ``cap`` rows (the padded layout)."""
    if cap is not None:
        per = [split_counts(cap - (r * 7) % (cap // 2 + 1), 1, cols, seed + r, device="cpu")
               for r in range(ranks)]  # fmt: skip
        return torch.cat(per).to(dtype).to(device)
    cuts = torch.sort(torch.randint(0, rows + 1, (ranks * cols + 1,), generator=gen(seed)))[0]
    cuts[0], cuts[-1] = 0, rows
    return (cuts[1:] - cuts[:-1]).reshape(ranks, cols).to(dtype).to(device)


def ref_shuffle(tokens, counts, start, end, padded, combine, device="cpu"):
    """(out, counts_out or None): ``moe_kernels.reference.shuffling`` on ``device`` (default the
    CPU: the oracle), on bit views of the tokens (any dtype)."""
    x = tokens.to(device).view(_BITS[tokens.element_size()])
    c = counts.to(device)
    if combine:
        out, cnt = ref_sh.combine_shuffling(x, c, start, end, padded)
        return out.view(tokens.dtype), cnt
    return ref_sh.split_shuffling(x, c, start, end, padded).view(tokens.dtype), None


def scatter_problem(ep, positions, dim, experts, rows, seed, *, device, in_dtype=torch.bfloat16,
                    out_dtype=torch.bfloat16, counts="bincount", top_k=1):  # fmt: skip
    """(in (EP, T_K, D), counts (E,), indices (T_K,), out (T, D)) on ``device``: FBGEMM's forms
    of ``scatter_add_padded_tokens``' arguments. ``counts``: "balanced" (int32, T_K / E each),
    "bincount" (int64, random experts) or a tensor; ``top_k`` > 1 or rows < positions: indices
    repeat (several positions add into one row)."""
    g = gen(seed, device)
    if isinstance(counts, torch.Tensor):
        cnt = counts.to(device)
    elif counts == "balanced":
        cnt = torch.full((experts,), positions // experts, dtype=torch.int32, device=device)
    else:
        choices = torch.randint(0, experts, (positions,), generator=g, device=device)
        cnt = torch.bincount(choices, minlength=experts)
    perm = torch.randperm(positions, generator=g, device=device)
    idx = (perm if top_k == 1 and rows == positions else perm % rows).int()
    x = torch.randn(ep, positions, dim, generator=g, device=device, dtype=torch.bfloat16) + 0.25
    out = torch.randn(rows, dim, generator=g, device=device) + 0.25
    if not out_dtype.is_floating_point:
        x, out = x * 1000, out * 1000
    return x.to(in_dtype), cnt, idx, out.to(out_dtype)
