"""Inputs several test files share: routing score patterns (``make_scores``) with ties, signed
zeros, NaN and infinities, in row-major, column-major and strided layouts."""

from __future__ import annotations

import torch

__all__ = ["make_scores"]


def make_scores(T, E, dtype, kind="randn", seed=0, layout="row"):
    """(T, E) scores of ``dtype``. ``kind``: "randn"; "ties" (few distinct values: many ties,
    -0.0 beside +0.0); "special" (NaN, +-inf, an all -inf row 0 and an all NaN row 1).
    ``layout``: "row", "col" (column-major), "strided" (every other column of a wider tensor),
    "pad" / "odd" (row stride E + 2 / E + 1)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(T, E, generator=g)
    elif kind == "ties":  # few distinct values: many ties, -0.0 beside +0.0
        x = torch.randint(-2, 3, (T, E), generator=g).float() * 0.5
        x = torch.where(torch.rand(T, E, generator=g) < 0.2, -0.0, x)
    elif kind == "special":  # NaN, +-inf, all -inf and all NaN rows
        x = torch.randn(T, E, generator=g)
        x[torch.rand(T, E, generator=g) < 0.2] = float("nan")
        x[torch.rand(T, E, generator=g) < 0.1] = float("-inf")
        x[torch.rand(T, E, generator=g) < 0.05] = float("inf")
        x[0] = float("-inf")
        if T > 1:
            x[1] = float("nan")
    else:
        raise ValueError(kind)
    x = x.to(dtype)
    if layout == "col":
        x = x.t().contiguous().t()
        assert x.stride(0) == 1 or T <= 1
    elif layout == "strided":
        x = torch.cat([x, x], dim=1)[:, ::2]
    elif layout in ("pad", "odd"):  # row stride E + 2 (pairs stay 4-byte aligned) or E + 1
        x = torch.cat([x, x[:, : 2 if layout == "pad" else 1]], dim=1)[:, :E]
    return x
