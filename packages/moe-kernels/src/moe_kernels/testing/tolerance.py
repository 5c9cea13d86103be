"""The tolerance rules shared by the tests and ``moe-bench verify`` (one rule per comparison).

* ``ULP``: one step of a float dtype relative to a value (the unit the bounds are written in);
  ``E4M3_STEP`` the same for float8 e4m3's three mantissa bits.
* ``bound_violations(got, exact, bound)``: a result against a float64 oracle that carries a
  bound of its roundings (``oracle_expert_mlp_rows``): every ``|got - exact| <= bound``.
* ``reference_bound(bound)``: how far a kernel may sit from its torch reference where the two
  round an intermediate differently (the interpreter truncates bf16 stores; the reference rounds
  to nearest). Both lie within ``bound`` of the exact value, so they differ by at most twice it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
E4M3_STEP = 2.0**-3


class BoundCheck(NamedTuple):
    """``bad`` of ``total`` elements outside their bound (NaN counts as outside); the largest
    error, and the largest excess over the bound (<= 0 when none is outside)."""

    bad: int
    total: int
    largest_error: float
    largest_excess: float


def bound_violations(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> BoundCheck:
    """``got`` (any float dtype, any device) against float64 ``exact`` +- ``bound`` (same shape)."""
    if tuple(got.shape) != tuple(exact.shape) or exact.shape != bound.shape:
        raise ValueError(f"shapes differ: got {tuple(got.shape)}, exact {tuple(exact.shape)}, "
                         f"bound {tuple(bound.shape)}")  # fmt: skip
    err = (got.detach().cpu().double() - exact.cpu().double()).abs()
    bad = ~(err <= bound.cpu())  # NaN is outside
    excess = (err - bound.cpu()).nan_to_num(nan=float("inf"))
    return BoundCheck(
        int(bad.sum()),
        bad.numel(),
        float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0,
        float(excess.max()) if excess.numel() else 0.0,
    )


def reference_bound(bound: torch.Tensor) -> torch.Tensor:
    """The bound of ``|kernel - reference|`` from the oracle's bound of each: twice it."""
    return 2.0 * bound
