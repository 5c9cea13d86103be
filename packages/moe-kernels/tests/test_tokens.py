"""Token movement ops (gather/scatter, dispatch, combine) against naive loop oracles.

Runs on the torch reference path (TRITON_INTERPRET=0) and on the Triton kernels in the
interpreter (TRITON_INTERPRET=1). The interpreter truncates fp32 -> bf16 casts instead of rounding
to nearest even, so bf16 results computed in fp32 get a one-ulp-per-rounding tolerance there; all
other results are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels import _dispatch, routing
from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.dense_tokens import gather_scale_dense_tokens, scatter_add_dense_tokens
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens
from moe_kernels.routing import RoutingPlan
from moe_kernels.testing import (
    oracle_combine,
    oracle_dispatch,
    oracle_gather_scale,
    oracle_scatter_add,
    oracle_token_plan,
)
from moe_kernels.tokens import combine, dispatch

CPU = torch.device("cpu")
# bf16 rounding differs from the GPU only when the kernels run in the interpreter.
LOOSE_BF16 = INTERPRET and use_triton(CPU)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, roundings: int = 1) -> None:
    """Bitwise equal, except bf16 under the interpreter: ``roundings`` bf16 ulps of slack."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if LOOSE_BF16 and actual.dtype == torch.bfloat16:
        a, e = actual.float(), expected.float()
        ulp = 2.0 ** (torch.floor(torch.log2(e.abs().clamp_min(1e-30))) - 7)
        assert bool(((a - e).abs() <= roundings * ulp + 1e-30).all()), (a - e).abs().max()
        assert bool(((a == 0) == (e == 0)).all())  # zero rows stay exactly zero
    else:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 0.25).to(dtype)  # random, almost never zero


# the naive oracles (python loops): moe_kernels.testing's oracle_token_plan, oracle_gather_scale,
# oracle_scatter_add, oracle_dispatch, oracle_combine


# --------------------------------------------------------------------------------------------
# gather_scale_dense_tokens


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("num_tokens", "dim", "num_experts", "k"), [(1, 1, 1, 1), (5, 3, 4, 2), (23, 130, 6, 3)]
)
@pytest.mark.parametrize("vtc", [None, 0, "partial"])
def test_gather_scale_matches_oracle(dtype, num_tokens, dim, num_experts, k, vtc):
    scores = rand((num_tokens, num_experts), torch.float32, 1).softmax(-1)
    plan = oracle_token_plan(scores, k, 0, max(1, num_experts - 1))  # a tail of -1 rows
    x = rand((num_tokens, dim), dtype, 2)
    n = plan.token_indices.shape[0]
    count = None if vtc is None else torch.tensor([0 if vtc == 0 else n // 2 + 1])
    tok, exp = plan.token_indices, plan.expert_indices + 0  # local == global: start is 0
    got = gather_scale_dense_tokens(x, tok, exp, scores, count)
    assert_matches(got, oracle_gather_scale(x, tok, exp, scores, count))


def test_gather_scale_int64_bf16_scores_noncontiguous_x():
    x_full = rand((9, 70), torch.float32, 3)
    x = x_full[:, ::2]  # strided rows and columns: supported through strides
    scores = rand((5, 9), torch.bfloat16, 4).t()  # (9, 5), non-contiguous
    tok = torch.tensor([3, 3, -1, 0, 8, 2, -1], dtype=torch.int64)
    exp = torch.tensor([0, 4, 1, 2, 1, 3, 0], dtype=torch.int64)
    got = gather_scale_dense_tokens(x, tok, exp, scores, torch.tensor([6], dtype=torch.int32))
    assert_matches(got, oracle_gather_scale(x.contiguous(), tok, exp, scores, torch.tensor([6])))
    assert got[2].eq(0).all() and got[6].eq(0).all() and got[0].ne(0).any()


def test_gather_scale_empty():
    x = rand((4, 8), torch.bfloat16, 5)
    scores = torch.rand(4, 3)
    idx = torch.empty(0, dtype=torch.int32)
    assert gather_scale_dense_tokens(x, idx, idx, scores).shape == (0, 8)
    none_x = torch.empty(0, 8, dtype=torch.bfloat16)
    tail = torch.full((3,), -1, dtype=torch.int32)
    got = gather_scale_dense_tokens(none_x, tail, tail, torch.empty(0, 3))
    assert got.shape == (3, 8) and got.eq(0).all()


# --------------------------------------------------------------------------------------------
# scatter_add_dense_tokens


@pytest.mark.parametrize(
    ("out_dtype", "in_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize(("num_tokens", "dim", "n"), [(1, 1, 5), (7, 33, 40), (30, 130, 90)])
@pytest.mark.parametrize("vtc", [None, 0, "partial"])
def test_scatter_add_matches_sequential_oracle(out_dtype, in_dtype, num_tokens, dim, n, vtc):
    g = torch.Generator().manual_seed(n + dim)
    tok = torch.randint(-1, num_tokens, (n,), generator=g, dtype=torch.int32)  # duplicates, -1
    src = rand((n, dim), in_dtype, 6) * 3
    out = rand((num_tokens, dim), out_dtype, 7)
    count = None if vtc is None else torch.tensor([0 if vtc == 0 else n - n // 3])
    expected = oracle_scatter_add(out, src, tok, count)
    # |partial sums| <= |out| + sum |src|: the slack for truncating (interpreter) bf16 rounding.
    bound = oracle_scatter_add(out.float().abs(), src.float().abs(), tok, count)
    hits = oracle_scatter_add(torch.zeros(num_tokens, 1), torch.ones(n, 1), tok, count)
    scatter_add_dense_tokens(out, src, tok, count)
    if LOOSE_BF16 and out_dtype == torch.bfloat16:
        slack = 2.0**-7 * bound * (hits + 1)
        assert bool(((out.float() - expected.float()).abs() <= slack).all())
    else:
        assert_matches(out, expected)


@pytest.mark.parametrize(
    ("out_dtype", "in_dtype"),
    [(torch.int32, torch.int32), (torch.int32, torch.int64), (torch.int64, torch.int32),
     (torch.int64, torch.int64)],
)  # fmt: skip
@pytest.mark.parametrize("vtc", [None, "partial"])
def test_scatter_add_integer_tokens_are_exact(out_dtype, in_dtype, vtc):
    """FBGEMM's integer scatter-add (its tests compare integer tokens exactly): adds in out's
    dtype, wrapping on overflow (values span the whole range), against a numpy loop."""
    g = torch.Generator().manual_seed(11)
    num_tokens, dim, n = 9, 37, 50
    tok = torch.randint(-1, num_tokens, (n,), generator=g, dtype=torch.int32)

    def full_range(shape, dtype):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)

    src, out = full_range((n, dim), in_dtype), full_range((num_tokens, dim), out_dtype)
    limit = n if vtc is None else n - n // 3
    expected = out.numpy().copy()
    for i in range(limit):
        if tok[i] >= 0:  # numpy integer arrays wrap silently
            expected[tok[i]] = expected[tok[i]] + src[i].numpy().astype(expected.dtype)
    count = None if vtc is None else torch.tensor([limit], dtype=torch.int32)
    scatter_add_dense_tokens(out, src, tok, count)
    assert out.dtype == out_dtype
    assert np.array_equal(out.numpy(), expected)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    num_tokens=st.integers(1, 12),
    dim=st.integers(1, 40),
    n=st.integers(0, 40),
    vtc=st.one_of(st.none(), st.integers(-2, 45)),
    seed=st.integers(0, 2**16),
)
def test_gather_then_scatter_property(num_tokens, dim, n, vtc, seed):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(-1, num_tokens, (n,), generator=g, dtype=torch.int32)
    exp = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    x = torch.randn(num_tokens, dim, generator=g)
    scores = torch.rand(num_tokens, 3, generator=g)
    count = None if vtc is None else torch.tensor([vtc])
    rows = gather_scale_dense_tokens(x, tok, exp, scores, count)
    assert torch.equal(rows, oracle_gather_scale(x, tok, exp, scores, count))
    out = torch.randn(num_tokens, dim, generator=g)
    expected = oracle_scatter_add(out, rows, tok, count)
    scatter_add_dense_tokens(out, rows, tok, count)
    assert torch.equal(out, expected)


def test_scatter_add_order_is_ascending_i():
    # fp32 addition is not associative: in fp32 ((0 + 1e8) + 1) - 1e8 + 3 = 3 (the 1 is lost
    # next to 1e8), while adding the 1 after the cancellation would give 4.
    out = torch.zeros(2, 1)
    src = torch.tensor([[1e8], [1.0], [-1e8], [1.0], [3.0]])
    tok = torch.tensor([0, 0, 0, 1, 0], dtype=torch.int32)
    scatter_add_dense_tokens(out, src, tok)
    assert out[0, 0].item() == 3.0
    assert out[1, 0].item() == 1.0


def test_scatter_add_strided_out_and_int64_and_determinism():
    tok = torch.tensor([5, 0, 5, -1, 2, 5, 0], dtype=torch.int64)
    src = rand((7, 20), torch.bfloat16, 9)
    results = []
    for _ in range(2):
        base = rand((6, 40), torch.float32, 8)
        out = base[:, 1::2]  # an in-place update through a strided view
        expected = oracle_scatter_add(out, src, tok)
        untouched = base[:, 0::2].clone()
        scatter_add_dense_tokens(out, src, tok)
        assert_matches(out.contiguous(), expected)
        assert torch.equal(base[:, 0::2], untouched)
        results.append(base)
    assert torch.equal(results[0], results[1])  # bitwise reproducible


def test_out_of_range_indices_are_skipped():
    """The documented contract: an index outside [0, T) counts as -1 (no host sync to raise):
    the scatter skips its row, the gathers write zeros (an expert index outside [0, E) too)."""
    T, D, E = 4, 3, 2
    tok = torch.tensor([0, 4, -1, -5, 2**31 - 1, 3, 1], dtype=torch.int64)
    out = torch.zeros(T, D)
    scatter_add_dense_tokens(out, torch.arange(1.0, 8.0)[:, None].expand(7, D), tok)
    assert torch.equal(out[:, 0], torch.tensor([1.0, 7.0, 0.0, 6.0]))
    x = torch.arange(1.0, T * D + 1).reshape(T, D)
    exp = torch.tensor([0, 0, 1, 1, 0, 5, -3])
    rows = gather_scale_dense_tokens(x, tok, exp, torch.ones(T, E))
    live = torch.tensor([True, False, False, False, False, False, False])
    assert torch.equal(rows, torch.where(live[:, None], x[tok.clamp(0, T - 1)], 0.0))
    data, scale = gather_scale_quant_dense_tokens(x, tok, exp, torch.ones(T, E))
    assert not data.float()[~live].any() and not scale[~live].any() and scale[live].all()


def test_scatter_add_empty():
    out = rand((3, 4), torch.float32, 10)
    before = out.clone()
    scatter_add_dense_tokens(out, torch.empty(0, 4), torch.empty(0, dtype=torch.int32))
    assert torch.equal(out, before)
    scatter_add_dense_tokens(out, torch.ones(2, 4), torch.tensor([-1, -1]))
    assert torch.equal(out, before)
    empty = torch.empty(0, 4)
    scatter_add_dense_tokens(empty, torch.ones(2, 4), torch.tensor([-1, -1]))


# --------------------------------------------------------------------------------------------
# dispatch / combine


def plan_for(num_tokens, num_experts, k, seed, start=0, end=None):
    scores = rand((num_tokens, num_experts), torch.float32, seed).softmax(-1)
    return oracle_token_plan(scores, k, start, end)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("num_tokens", "dim", "k"), [(1, 1, 1), (9, 33, 2), (20, 130, 4)])
def test_dispatch_combine_match_oracle(dtype, num_tokens, dim, k):
    plan = plan_for(num_tokens, 6, k, 11, 1, 5)  # experts 0 and 5 are not local: a -1 tail
    x = rand((num_tokens, dim), dtype, 12)
    for scale in (False, True):
        xs = dispatch(x, plan, scale=scale)
        assert_matches(xs, oracle_dispatch(x, plan, scale))
    y = rand((num_tokens * k, dim), dtype, 13)
    assert_matches(combine(y, plan), oracle_combine(y, plan, True, dtype))
    got = combine(y, plan, weighted=False, out_dtype=torch.float32)
    assert_matches(got, oracle_combine(y, plan, False, torch.float32))


def test_dispatch_copy_is_exact_and_tail_zero():
    plan = plan_for(12, 4, 2, 14, 0, 3)
    x = rand((12, 20), torch.bfloat16, 15)
    xs = dispatch(x, plan)
    live = plan.token_indices >= 0
    assert not live.all()
    assert torch.equal(xs[live], x[plan.token_indices[live].long()])  # a copy: exact everywhere
    assert xs[~live].eq(0).all()


def test_combine_noncontiguous_and_out_dtypes_and_determinism():
    plan = plan_for(10, 5, 3, 16)
    y = rand((30, 64), torch.float32, 17)[:, ::2]
    for out_dtype in FLOATS:
        got = combine(y, plan, out_dtype=out_dtype)
        assert_matches(got, oracle_combine(y, plan, True, out_dtype))
        assert torch.equal(combine(y, plan, out_dtype=out_dtype), got)
    inv_t = plan.inverse.t().contiguous().t()  # a strided inverse
    plan2 = plan._replace(inverse=inv_t)
    assert torch.equal(combine(y, plan2), combine(y, plan))


def test_dispatch_combine_empty():
    plan = RoutingPlan(
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(5, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0),
        torch.empty(0, 2, dtype=torch.int32),
    )
    x = torch.empty(0, 16, dtype=torch.bfloat16)
    assert dispatch(x, plan).shape == (0, 16)
    assert combine(torch.empty(0, 16), plan).shape == (0, 16)


def test_with_route_if_available():
    route = getattr(routing, "route", None)
    if route is None:
        pytest.skip("moe_kernels.routing.route is not written yet")
    scores = rand((13, 6), torch.float32, 19).softmax(-1)
    plan = route(scores, 2, expert_index_start=1, expert_index_end=5)
    ref = oracle_token_plan(scores, 2, 1, 5)
    assert torch.equal(plan.token_indices, ref.token_indices)
    assert torch.equal(plan.inverse, ref.inverse)
    x = rand((13, 24), torch.float32, 20)
    xs = dispatch(x, plan, scale=True)
    assert_matches(xs, oracle_dispatch(x, plan, True))
    assert_matches(combine(xs, plan, weighted=False), oracle_combine(xs, plan, False, x.dtype))


# --------------------------------------------------------------------------------------------
# custom ops: opcheck and torch.compile


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_all_ops():
    plan = plan_for(6, 4, 2, 21, 0, 3)
    x = rand((6, 20), torch.bfloat16, 22)
    scores = torch.rand(6, 4)
    vtc = torch.tensor([7])
    ops = torch.ops.moe_kernels
    _opcheck(
        ops.gather_scale_dense_tokens.default,
        (x, plan.token_indices, plan.expert_indices, scores, vtc),
    )
    _opcheck(
        ops.gather_scale_dense_tokens.default,
        (x, plan.token_indices, plan.expert_indices, scores, None),
    )
    _opcheck(
        ops.scatter_add_dense_tokens.default,
        (torch.zeros(6, 20), rand((12, 20), torch.bfloat16, 23), plan.token_indices, vtc),
    )
    _opcheck(ops.dispatch.default, (x, plan.token_indices, plan.weights, plan.inverse, True))
    y = rand((12, 20), torch.bfloat16, 24)
    _opcheck(
        ops.combine.default,
        (y, plan.inverse, plan.token_indices, plan.weights, True, torch.float32),
    )


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    plan = plan_for(8, 4, 2, 25, 0, 3)
    x = rand((8, 24), torch.float32, 26)
    scores = torch.rand(8, 4)

    def step(x, scores, out, plan):
        xs = dispatch(x, plan, scale=True)
        g = gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, scores)
        scatter_add_dense_tokens(out, g * 2, plan.token_indices)  # in place, then read back
        return combine(xs + 1, plan, weighted=False), out * 2

    out_eager, out_comp = torch.zeros(8, 24), torch.zeros(8, 24)
    eager = step(x, scores, out_eager, plan)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(x, scores, out_comp, plan)
    assert torch.equal(out_eager, out_comp)
    assert out_comp.ne(0).any()
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


# --------------------------------------------------------------------------------------------
# bad input


def _bad_cases():
    plan = plan_for(4, 3, 2, 27)
    x = torch.rand(4, 8)
    tok, exp = plan.token_indices, plan.expert_indices
    scores = torch.rand(4, 3)
    y = torch.rand(8, 8)
    out = torch.zeros(4, 8)
    meta = torch.empty(4, 8, device="meta")
    return [
        ("x", TypeError, lambda: gather_scale_dense_tokens(x.int(), tok, exp, scores)),
        ("x", ValueError, lambda: gather_scale_dense_tokens(x[0], tok, exp, scores)),
        (
            "token_indices",
            TypeError,
            lambda: gather_scale_dense_tokens(x, tok.float(), exp, scores),
        ),
        ("token_indices", ValueError, lambda: gather_scale_dense_tokens(x, tok[None], exp, scores)),
        ("expert_indices", ValueError, lambda: gather_scale_dense_tokens(x, tok, exp[:3], scores)),
        ("scores", ValueError, lambda: gather_scale_dense_tokens(x, tok, exp, scores[:3])),
        ("scores", TypeError, lambda: gather_scale_dense_tokens(x, tok, exp, scores.long())),
        ("scores", TypeError, lambda: gather_scale_dense_tokens(x, tok, exp, [1.0])),
        (
            "valid_token_count",
            TypeError,
            lambda: gather_scale_dense_tokens(x, tok, exp, scores, torch.tensor([1.0])),
        ),
        (
            "valid_token_count",
            ValueError,
            lambda: gather_scale_dense_tokens(x, tok, exp, scores, torch.tensor([1, 2])),
        ),
        ("scores", ValueError, lambda: gather_scale_dense_tokens(x, tok, exp, scores.to("meta"))),
        ("in_tokens", ValueError, lambda: scatter_add_dense_tokens(out, y[:, :5], tok)),
        ("in_tokens", ValueError, lambda: scatter_add_dense_tokens(out, y[:7], tok)),
        ("out_tokens", TypeError, lambda: scatter_add_dense_tokens(out.short(), y, tok)),
        ("in_tokens", TypeError, lambda: scatter_add_dense_tokens(out.long(), y, tok)),
        ("in_tokens", TypeError, lambda: scatter_add_dense_tokens(out, y.int(), tok)),
        ("in_tokens", ValueError, lambda: scatter_add_dense_tokens(out, y.to("meta"), tok)),
        ("token_indices", ValueError, lambda: scatter_add_dense_tokens(meta, y.to("meta"), tok)),
        ("plan", TypeError, lambda: dispatch(x, tuple(plan))),
        ("x", ValueError, lambda: dispatch(x[:3], plan)),
        ("x", TypeError, lambda: dispatch(x.long(), plan)),
        (
            "plan.token_indices",
            TypeError,
            lambda: dispatch(x, plan._replace(token_indices=tok.float())),
        ),
        ("plan.weights", ValueError, lambda: dispatch(x, plan._replace(weights=plan.weights[:3]))),
        ("scale", TypeError, lambda: dispatch(x, plan, scale=1)),
        ("y", ValueError, lambda: combine(y[:7], plan)),
        ("y", ValueError, lambda: combine(y[0], plan)),
        ("plan.inverse", ValueError, lambda: combine(y, plan._replace(inverse=plan.inverse[0]))),
        ("out_dtype", TypeError, lambda: combine(y, plan, out_dtype=torch.int32)),
        ("out_dtype", TypeError, lambda: combine(y, plan, out_dtype="float32")),
        ("plan", TypeError, lambda: combine(y, None)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_argument(case):
    name, exc, fn = _bad_cases()[case]
    with pytest.raises(exc, match=name.replace(".", r"\.")):
        fn()


def test_direct_eager_path_matches_custom_op(monkeypatch):
    # On CUDA in eager mode the public functions skip the dispatcher and call the op bodies;
    # force that branch here so it runs on CPU too.

    plan = plan_for(7, 4, 2, 28, 0, 3)
    x = rand((7, 12), torch.float32, 29)
    scores = torch.rand(7, 4)
    src = rand((14, 12), torch.bfloat16, 30)
    expected = (
        dispatch(x, plan, scale=True),
        combine(src, plan),
        gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, scores),
    )
    out_op = torch.zeros(7, 12)
    scatter_add_dense_tokens(out_op, src, plan.token_indices)
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    got = (
        dispatch(x, plan, scale=True),
        combine(src, plan),
        gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, scores),
    )
    out = torch.zeros(7, 12)
    version = out._version
    scatter_add_dense_tokens(out, src, plan.token_indices)
    assert out._version > version  # in-place update visible to autograd's checks
    assert torch.equal(out, out_op) and out.ne(0).any()
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
