"""Bit-equality assertions for the tests: tensors bit for bit (NaN == NaN whatever its payload),
within a few codes (ulps) of each other, quantised rows (data bytes and fp32 scales), and the
routing ops' outputs against the dict of ``oracle_route_plan`` / ``oracle_selection_plan``.

numpy is imported where a function needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_kernels.routing import RoutingPlan

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "assert_int",
    "assert_quant",
    "assert_same_bits",
    "assert_weights",
    "assert_within_ulps",
    "check_plan",
    "check_shuffling",
    "int_bits",
]


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bits as int64 (of a 4-, 2- or 1-byte dtype)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).long()


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equal (NaN == NaN whatever its payload)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    nan = a.isnan() if a.dtype.is_floating_point and a.element_size() > 1 else None
    if nan is not None:
        assert torch.equal(nan, b.isnan())
        a, b = a[~nan], b[~nan]
    diff = int_bits(a) != int_bits(b)
    assert not diff.any(), (a[diff][:8], b[diff][:8])


def assert_within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int) -> None:
    """Equal bits, or finite values of one sign at most ``ulps`` codes apart (float8 too)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    fa, fb = a.float(), b.float()
    same = (int_bits(a) == int_bits(b)) | (fa.isnan() & fb.isnan())
    near = (int_bits(a) - int_bits(b)).abs() <= ulps
    close = (fa.signbit() == fb.signbit()) & fa.isfinite() & fb.isfinite() & near
    bad = ~(same | close)
    assert not bad.any(), (fa[bad][:8], fb[bad][:8])


def assert_quant(got, want_q: torch.Tensor, want_scale: torch.Tensor) -> None:
    """``got`` (data, scale) equal to (q bytes, scale) bit for bit."""
    assert isinstance(got, tuple) and len(got) == 2
    q, scale = got
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.is_contiguous() and q.shape == want_q.shape and scale.shape == want_scale.shape
    assert torch.equal(q.view(torch.uint8), want_q), (q.view(torch.uint8) != want_q).nonzero()[:8]
    assert_same_bits(scale, want_scale)


def assert_int(out: torch.Tensor, want: np.ndarray, name: str) -> None:
    """An int32 output equal to the int64 array ``want`` (shape included)."""
    import numpy as np

    assert out.dtype == torch.int32, name
    assert tuple(out.shape) == want.shape, (name, tuple(out.shape), want.shape)
    np.testing.assert_array_equal(out.numpy(), want, err_msg=name)


def assert_weights(out: torch.Tensor, want: np.ndarray) -> None:
    """Bitwise equal, NaN matching NaN (payloads may differ)."""
    import numpy as np

    assert out.dtype == torch.float32 and tuple(out.shape) == want.shape
    got = out.numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))


def check_plan(plan: RoutingPlan, want: dict) -> None:
    """A ``RoutingPlan`` bit for bit against an oracle plan's dict of arrays."""
    assert isinstance(plan, RoutingPlan)
    assert_int(plan.counts, want["counts"], "counts")
    assert_int(plan.offsets, want["offsets"], "offsets")
    assert_int(plan.expert_indices, want["expert"], "expert_indices")
    assert_int(plan.token_indices, want["token"], "token_indices")
    assert_weights(plan.weights, want["weights"])
    assert_int(plan.inverse, want["inverse"], "inverse")


def check_shuffling(out, want: dict) -> None:
    """``index_shuffling``'s outputs bit for bit against an oracle plan's dict of arrays."""
    tcpe, expert, token = out
    assert_int(tcpe, want["tcpe"], "token_count_per_expert")
    assert_int(expert, want["expert"], "expert_indices")
    assert_int(token, want["token"], "token_indices")
