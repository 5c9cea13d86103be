"""mxfp8_grouped_mm against float64 grouped GEMMs written as python loops over groups: one on the
MX-quantised operands (float64 quantisation oracle: tight bound) and one on the bf16 operands
(within the fp8 error bound)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_kernels import mxfp8 as mx
from moe_kernels.testing import oracle_gather_grouped_mm, oracle_mxfp8_round_trip


def quantize_dequantize_rceil(x: np.ndarray, axis: int) -> np.ndarray:
    """float64 MX round trip, rceil scales, blocks of 32 along ``axis`` (finite inputs):
    ``oracle_mxfp8_round_trip``."""
    return oracle_mxfp8_round_trip(torch.from_numpy(x), axis).numpy()


def loop_grouped_mm(a: np.ndarray, b: np.ndarray, ends: list[int]) -> np.ndarray:
    """float64 a (M, K) @ b[e] (E, K, N) group by group, zero rows past the last group:
    ``oracle_gather_grouped_mm``."""
    w = torch.from_numpy(b).mT  # (E, N, K)
    return oracle_gather_grouped_mm(torch.from_numpy(a), w, torch.tensor([0, *ends])).numpy()


def make_problem(M: int, K: int, N: int, sizes: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g))
    b = torch.randn(len(sizes), K, N, generator=g) * 0.1
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    return a.bfloat16(), b.bfloat16(), ends


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_loop_oracle(out_dtype: torch.dtype) -> None:
    sizes = [5, 0, 40, 1, 18]  # 64 routed rows, then 16 tail rows past offsets[-1]
    a, b, ends = make_problem(80, 64, 24, sizes, seed=0)
    out = mx.mxfp8_grouped_mm(a, b, ends, out_dtype=out_dtype)
    assert out.shape == (80, 24) and out.dtype == out_dtype
    assert torch.equal(out[64:], torch.zeros(16, 24, dtype=out_dtype))  # the documented tail
    a64, b64, e = a.double().numpy(), b.double().numpy(), ends.tolist()
    # tight: the exact product of the quantised operands, up to fp32 accumulation + output rounding
    qa, qb = quantize_dequantize_rceil(a64, axis=1), quantize_dequantize_rceil(b64, axis=1)
    exact_q = loop_grouped_mm(qa, qb, e)
    mag = loop_grouped_mm(np.abs(qa), np.abs(qb), e)
    ulp = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    got = out.double().numpy()
    assert (np.abs(got - exact_q) <= ulp * np.abs(exact_q) + 1e-5 * mag + 1e-30).all()
    # loose: against the bf16 GEMM, within the two operands' e4m3 rounding (2**-4 relative each)
    ref = loop_grouped_mm(a64, b64, e)
    bound = ((1 + 2.0**-4) ** 2 - 1) * loop_grouped_mm(np.abs(a64), np.abs(b64), e)
    assert (np.abs(got - ref) <= bound + ulp * np.abs(ref) + 1e-6).all()
    assert np.abs(got - ref).max() > 0  # it really is quantised


def test_rows_of_each_group_use_their_expert() -> None:
    # a single non-zero group at a time: every other group's rows must be unaffected
    sizes = [32, 32, 32]
    a, b, ends = make_problem(96, 32, 8, sizes, seed=1)
    full = mx.mxfp8_grouped_mm(a, b, ends)
    b2 = b.clone()
    b2[1] = 0
    part = mx.mxfp8_grouped_mm(a, b2, ends)
    assert torch.equal(part[:32], full[:32]) and torch.equal(part[64:], full[64:])
    assert torch.equal(part[32:64], torch.zeros(32, 8, dtype=torch.bfloat16))


def test_deterministic() -> None:
    a, b, ends = make_problem(48, 32, 16, [20, 28], seed=2)
    assert torch.equal(mx.mxfp8_grouped_mm(a, b, ends), mx.mxfp8_grouped_mm(a, b, ends))


I32 = torch.int32


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda a, b, o: mx.mxfp8_grouped_mm(a.float(), b, o), TypeError, "a must"),
        (lambda a, b, o: mx.mxfp8_grouped_mm(a, b, o.long()), TypeError, "offsets must"),
        (lambda a, b, o: mx.mxfp8_grouped_mm(a, b, o.float()), TypeError, "offsets must"),
        (lambda a, b, o: mx.mxfp8_grouped_mm(a, b, o[1:]), ValueError, "offsets must have size 2"),
        (lambda a, b, o: mx.mxfp8_grouped_mm(a, b[:, :16], o), ValueError, "b must have size 32"),
        (
            lambda a, b, o: mx.mxfp8_grouped_mm(a[:, :16], b[:, :16], o),
            ValueError,
            "multiple of 32",
        ),
        (lambda a, b, o: mx.mxfp8_grouped_mm(a, b[0], o), ValueError, "b must be 3-D"),
        (
            lambda a, b, o: mx.mxfp8_grouped_mm(a, b, o, out_dtype=torch.int8),
            TypeError,
            "out_dtype",
        ),
    ],
)
def test_bad_input(call, exc, match) -> None:
    a, b = torch.randn(8, 32).bfloat16(), torch.randn(2, 32, 4).bfloat16()
    with pytest.raises(exc, match=match):
        call(a, b, torch.tensor([4, 8], dtype=I32))


def test_opcheck() -> None:
    a, b, ends = make_problem(40, 32, 8, [10, 0, 20], seed=3)
    torch.library.opcheck(torch.ops.moe_kernels.mxfp8_grouped_mm, (a, b, ends, torch.bfloat16))


def test_compile_fullgraph() -> None:
    a, b, ends = make_problem(40, 32, 8, [10, 0, 20], seed=4)

    def f(a, b, ends):
        return mx.mxfp8_grouped_mm(a, b, ends) * 2

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(a, b, ends), f(a, b, ends))
