"""Autograd of mxfp8_grouped_mm (torchao's MXFP8 training recipe, ``moe_kernels._mxfp8_train``).

* Against the unquantised grouped GEMM (fp32 autograd of per-group matmuls, same dY): the
  gradients' SQNR must be >= 25 dB. Measured on random normal a, b, dY (the shapes below, seeds
  0-3, bf16 and fp32 dY; also M=2048, K=N=256): 28.2-28.7 dB for dA and dB alike, as for the
  forward output: each product multiplies two e4m3 casts (3 mantissa bits).
* Against a hand-written emulation (to_mxfp8 on every group's rows, zero-padded in the 128-row
  layout of compute_per_group_blocked_scale_offsets, dequantised by hand, float64 products): equal
  up to fp32 accumulation and the one rounding to bf16 (here bitwise equal to the rounded exact
  value; under TRITON_INTERPRET=1 dB within the interpreter's truncating bf16 store).
* Bitwise-equal gradients from identical backward passes, torch.compile(fullgraph=True) equal to
  eager, opcheck with autograd registration and AOT dispatch, and what the backward saves.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch

from moe_kernels import mxfp8 as mx
from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import oracle_mxfp8_grouped_mm_grads

SQNR_MIN_DB = 25.0
# one rounding to bf16, relative: round to nearest even; Triton's interpreter truncates its
# kernels' fp32 -> bf16 stores (grouped_weight_grad's, for dB), one ulp
BF16_REL = 2.0**-7 if INTERPRET else 2.0**-8
SIZES = [37, 0, 45, 1, 31, 0]  # 114 routed rows: none a multiple of 32, empty groups
M_ROWS = 128  # 14 rows past offsets[-1]


def make_problem(
    M: int, K: int, N: int, sizes: list[int], seed: int, dy_dtype=torch.bfloat16, spread=False
):
    """Random normal a, b, dY; ``spread``: the rows of every other non-empty group (and the tail)
    of a and dY scaled by 2**-16, each row by a further 2**[-1, 1], so the column-wise (along the
    tokens) casts depend on which rows share a block: a block across two groups would take the
    larger group's scale."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g)
    b = torch.randn(len(sizes), K, N, generator=g).bfloat16()
    dy = torch.randn(M, N, generator=g)
    if spread:
        group = np.searchsorted(np.cumsum(sizes), np.arange(M), side="right")  # E: the tail
        odd = np.append(np.cumsum(np.array(sizes) > 0) % 2, 1)  # every other non-empty group
        small = torch.from_numpy(odd[group]).float()[:, None]
        for x in (a, dy):
            x *= torch.exp2(-16.0 * small + torch.randint(-1, 2, (M, 1), generator=g))
    a, dy = a.bfloat16(), dy.to(dy_dtype)
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    return a, b, ends, dy


def run(a, b, ends, dy, *, fn=None, out_dtype=None):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    fn = fn or (lambda a, b, ends: mx.mxfp8_grouped_mm(a, b, ends, out_dtype=out_dtype))
    y = fn(a, b, ends)
    y.backward(dy)
    return y.detach(), a.grad, b.grad


def plain_grads(a, b, ends, dy):
    """fp32 autograd of the unquantised grouped GEMM (rows past ends[-1] give zero)."""
    a, b = a.float().requires_grad_(), b.float().requires_grad_()
    bounds = [0, *ends.tolist()]
    parts = [a[s:e] @ b[i] for i, (s, e) in enumerate(pairwise(bounds))]
    y = torch.cat([*parts, a.new_zeros(a.shape[0] - bounds[-1], b.shape[2])])
    y.backward(dy.float())
    return y.detach(), a.grad, b.grad


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.mark.parametrize("dy_dtype, seed", [(torch.bfloat16, 0), (torch.float32, 1)])
def test_sqnr_against_unquantised(dy_dtype, seed) -> None:
    a, b, ends, dy = make_problem(M_ROWS, 64, 64, SIZES, seed, dy_dtype)
    y, da, db = run(a, b, ends, dy)
    y_ref, da_ref, db_ref = plain_grads(a, b, ends, dy)
    assert da.dtype == db.dtype == torch.bfloat16
    assert da.shape == a.shape and db.shape == b.shape
    for ref, got in ((y_ref, y), (da_ref, da), (db_ref, db)):
        assert SQNR_MIN_DB <= sqnr_db(ref, got) < 40.0  # >= 40 would mean nothing is quantised


# ---------------------------------------------------------------------------------------------
# the independent emulation: moe_kernels.testing's oracle_mxfp8_grouped_mm_grads


def assert_rounded_from(got: torch.Tensor, ref64: torch.Tensor, mag64: torch.Tensor, n: int):
    """got = bf16(fp32 sum of n products) of the exact ref64: one bf16 rounding plus fp32
    accumulation error (n * 2**-24 of the sum of |products|)."""
    acc = n * 2.0**-24 * mag64
    err = (got.double() - ref64).abs()
    assert (err <= BF16_REL * (ref64.abs() + acc) + acc + 1e-30).all(), float(err.max())


@pytest.mark.parametrize("N", [64, 40])  # 40: a partial last block along N for dA
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32])
def test_matches_emulation(N, dy_dtype) -> None:
    a, b, ends, dy = make_problem(M_ROWS, 64, N, SIZES, 2, dy_dtype, spread=True)
    _, da, db = run(a, b, ends, dy)
    da_ref, db_ref = oracle_mxfp8_grouped_mm_grads(a, b, ends, dy)
    # |q(x)| = q(|x|)
    da_mag, db_mag = oracle_mxfp8_grouped_mm_grads(a.abs(), b.abs(), ends, dy.abs())
    assert_rounded_from(da, da_ref, da_mag, N)
    assert_rounded_from(db, db_ref, db_mag, M_ROWS)
    # in fact (these sizes, this seed) every result is the exact value rounded to bf16
    assert torch.equal(da, da_ref.bfloat16())
    if not INTERPRET:
        assert torch.equal(db, db_ref.bfloat16())


def test_groups_tail_and_empty() -> None:
    sizes = [0, 33, 0, 31, 1, 0]  # 65 routed rows, 31 past offsets[-1]
    a, b, ends, dy = make_problem(96, 32, 32, sizes, 3)
    _, da, db = run(a, b, ends, dy)
    assert torch.equal(da[65:], torch.zeros_like(da[65:]))
    for e in (0, 2, 5):
        assert torch.equal(db[e], torch.zeros_like(db[e]))
    # the tail rows take no part in dB; a group's rows only in its own expert's dB
    a2, dy2 = a.clone(), dy.clone()
    a2[65:], dy2[65:] = 1e4, -3e3
    a2[33:64] *= 8  # group 3
    _, da2, db2 = run(a2, b, ends, dy2)
    assert torch.equal(db2[[0, 1, 2, 4, 5]], db[[0, 1, 2, 4, 5]])
    assert torch.equal(db2[3], 8 * db[3])  # a power of two: the casts' data unchanged
    assert torch.equal(da2, da)


def test_all_groups_empty() -> None:
    a, b, ends, dy = make_problem(40, 32, 32, [0, 0], 4)
    _, da, db = run(a, b, ends, dy)
    assert torch.equal(da, torch.zeros_like(da)) and torch.equal(db, torch.zeros_like(db))


def test_deterministic() -> None:
    a, b, ends, dy = make_problem(M_ROWS, 32, 32, SIZES, 5)
    first, second = run(a, b, ends, dy), run(a, b, ends, dy)
    for x, y in zip(first, second, strict=True):
        assert torch.equal(x, y)


def test_one_input_requires_grad() -> None:
    a, b, ends, dy = make_problem(M_ROWS, 32, 32, SIZES, 6)
    _, da, db = run(a, b, ends, dy)
    a1 = a.clone().requires_grad_()
    mx.mxfp8_grouped_mm(a1, b, ends).backward(dy)
    b1 = b.clone().requires_grad_()
    mx.mxfp8_grouped_mm(a, b1, ends).backward(dy)
    assert torch.equal(a1.grad, da) and torch.equal(b1.grad, db)


def test_expanded_grad() -> None:
    a, b, ends, _ = make_problem(M_ROWS, 32, 32, SIZES, 10)
    _, da, db = run(a, b, ends, torch.ones(M_ROWS, 32, dtype=torch.bfloat16))
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    mx.mxfp8_grouped_mm(a1, b1, ends).sum().backward()  # dY a stride-0 expand
    assert torch.equal(a1.grad, da) and torch.equal(b1.grad, db)


def test_saves_only_the_inputs() -> None:
    a, b, ends, _ = make_problem(M_ROWS, 32, 32, SIZES, 7)
    a, b = a.requires_grad_(), b.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mx.mxfp8_grouped_mm(a, b, ends)
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (a, b, ends))


def test_padded_rows_layout() -> None:
    from moe_kernels._mxfp8_train import padded_rows

    ends = torch.tensor([0, 33, 33, 64, 65], dtype=torch.int32)
    src, valid, starts = padded_rows(ends, 70)
    assert starts.tolist() == [0, 0, 64, 64, 96, 128]
    assert src.shape == ((70 + 31 * 5) // 32 * 32,)  # static: 224 rows
    rows = torch.arange(224)
    want = torch.full((224,), -1)
    want[:33], want[64:95], want[96] = rows[:33], rows[33:64], 64
    assert torch.equal(torch.where(valid, src, -1), want)


def test_opcheck() -> None:
    a, b, ends, _ = make_problem(72, 32, 32, [10, 0, 40], 8)
    torch.library.opcheck(
        torch.ops.moe_kernels.mxfp8_grouped_mm,
        (a.requires_grad_(), b.requires_grad_(), ends, torch.bfloat16),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend) -> None:
    a, b, ends, dy = make_problem(72, 32, 40, [10, 0, 40, 3], 9)

    def f(a, b, ends):
        return mx.mxfp8_grouped_mm(a, b, ends) * 2

    torch._dynamo.reset()
    eager = run(a, b, ends, dy, fn=f)
    compiled = run(a, b, ends, dy, fn=torch.compile(f, fullgraph=True, backend=backend))
    for x, y in zip(eager, compiled, strict=True):
        assert torch.equal(x, y)
