"""index_shuffling and route against a naive Python oracle, on the reference path
(TRITON_INTERPRET=0) and on the Triton kernels in the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels.routing import index_shuffling, route
from moe_kernels.testing import check_plan, check_shuffling, make_scores, oracle_route_plan

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# the naive oracle (moe_kernels.testing.oracle_route_plan): Python loops over tokens, pairs
# sorted by Python's sort; check_plan / check_shuffling compare bit for bit

# (T, E, top_k, start, end, valid, kind, layout)
CASES = [
    (0, 8, 2, None, None, None, "randn", "row"),
    (1, 8, 2, None, None, None, "randn", "row"),
    (1, 1, 1, None, None, None, "randn", "row"),
    (13, 1, 1, None, None, None, "special", "row"),
    (19, 5, 5, None, None, None, "ties", "row"),
    (40, 7, 3, 2, 6, None, "special", "col"),
    (37, 33, 4, 0, 33, 30, "ties", "row"),
    (64, 16, 8, 4, 12, 100, "randn", "strided"),
    (50, 9, 2, 3, 3, None, "randn", "row"),
    (45, 12, 12, 0, 12, 0, "ties", "col"),
    (150, 64, 8, 0, 32, 123, "randn", "row"),
    (30, 130, 6, 65, 130, None, "special", "row"),
]


def _vtc(valid, dtype=torch.int32):
    return None if valid is None else torch.tensor([valid], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_route_matches_oracle(case, dtype):
    T, E, k, start, end, valid, kind, layout = case
    x = make_scores(T, E, dtype, kind, seed=T + E, layout=layout)
    renorm = (T + E) % 2 == 0  # half the cases renormalize
    plan = route(
        x,
        k,
        valid_token_count=_vtc(valid),
        expert_index_start=start,
        expert_index_end=end,
        renormalize=renorm,
    )
    check_plan(plan, oracle_route_plan(x, k, start, end, valid, renorm))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: "-".join(map(str, c)))
def test_index_shuffling_matches_oracle(case, dtype):
    T, E, k, start, end, valid, kind, layout = case
    x = make_scores(T, E, dtype, kind, seed=2 * T + E, layout=layout)
    out = index_shuffling(x, start, end, _vtc(valid, torch.int64), k)
    check_shuffling(out, oracle_route_plan(x, k, start, end, valid))


def test_route_renormalize_and_consistency():
    x = torch.softmax(make_scores(70, 10, torch.float32, seed=3), dim=-1)
    vtc = torch.tensor([60])
    plain = route(x, 3, valid_token_count=vtc, expert_index_start=1, expert_index_end=9)
    renorm = route(
        x, 3, valid_token_count=vtc, expert_index_start=1, expert_index_end=9, renormalize=True
    )
    check_plan(renorm, oracle_route_plan(x, 3, 1, 9, 60, renormalize=True))
    tcpe, expert, token = index_shuffling(x, 1, 9, vtc, 3)
    # the plan and index_shuffling agree, and the plan's pieces agree with each other
    for a, b in ((plain.expert_indices, expert), (plain.token_indices, token)):
        assert torch.equal(a, b)
    assert torch.equal(renorm.inverse, plain.inverse)
    assert torch.equal(tcpe[1:9], plain.counts)
    n = int(plain.offsets[-1])
    assert n == int(tcpe[-1]) == int(plain.counts.sum())
    assert torch.equal(plain.offsets[1:], torch.cumsum(plain.counts, 0).int())
    routed = plain.inverse >= 0
    pos = plain.inverse[routed].long()
    assert torch.equal(torch.sort(pos).values, torch.arange(n))
    t_idx = torch.arange(70)[:, None].expand(70, 3)[routed]
    assert torch.equal(plain.token_indices[pos].long(), t_idx)
    # a routed weight is the token's score at that expert, divided by the sum of its top-3
    e_idx = plain.expert_indices[pos].long() + 1
    assert torch.equal(plain.weights[pos], x[t_idx, e_idx])
    top3 = torch.topk(x, 3, dim=1).values
    s = top3[:, 0] + top3[:, 1] + top3[:, 2]
    assert torch.equal(renorm.weights[pos], x[t_idx, e_idx] / s[t_idx])


def test_all_minus_inf_rows_pick_distinct_experts():
    x = torch.full((6, 5), float("-inf"), dtype=torch.bfloat16)
    x[3] = float("nan")
    plan = route(x, 4)
    want = oracle_route_plan(x, 4)
    check_plan(plan, want)
    # every token has experts 0..3 once
    for t in range(6):
        exps = sorted(plan.expert_indices[plan.inverse[t].long()].tolist())
        assert exps == [0, 1, 2, 3]


@pytest.mark.parametrize("valid", [0, 1, 5, 40, 10**6, -3])
def test_valid_token_count(valid):
    x = make_scores(40, 6, torch.float16, "ties", seed=valid % 7)
    vtc = torch.tensor([valid], dtype=torch.int64)
    check_plan(route(x, 2, valid_token_count=vtc), oracle_route_plan(x, 2, valid=valid))


def test_more_than_65536_experts():
    x = make_scores(3, 70001, torch.bfloat16, "ties", seed=2)
    check_plan(
        route(x, 2, expert_index_start=5, renormalize=True),
        oracle_route_plan(x, 2, 5, None, None, True),
    )


def test_empty_tokens():
    x = torch.empty(0, 6)
    tcpe, expert, token = index_shuffling(x, 1, 4, None, 3)
    assert tcpe.tolist() == [0] * 8
    assert expert.shape == token.shape == (0,)
    plan = route(x, 3, expert_index_start=1, expert_index_end=4)
    assert plan.counts.tolist() == [0, 0, 0] and plan.offsets.tolist() == [0, 0, 0, 0]
    assert plan.inverse.shape == (0, 3) and plan.weights.shape == (0,)


def test_deterministic():
    x = make_scores(120, 24, torch.bfloat16, "ties", seed=5)
    a = route(x, 5, renormalize=True)
    b = route(x, 5, renormalize=True)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u.view(torch.int32), v.view(torch.int32))


@settings(max_examples=15, deadline=None)
@given(
    T=st.integers(0, 48),
    E=st.integers(1, 20),
    data=st.data(),
)
def test_property_random_shapes(T, E, data):
    k = data.draw(st.integers(1, E), label="top_k")
    start = data.draw(st.integers(0, E), label="start")
    end = data.draw(st.integers(start, E), label="end")
    valid = data.draw(st.one_of(st.none(), st.integers(-2, T + 2)), label="valid")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    kind = data.draw(st.sampled_from(["randn", "ties", "special"]), label="kind")
    layout = data.draw(st.sampled_from(["row", "col"]), label="layout")
    renorm = data.draw(st.booleans(), label="renormalize")
    x = make_scores(T, E, dtype, kind, seed=T * 31 + E, layout=layout) if T else torch.empty(0, E)
    want = oracle_route_plan(x, k, start, end, valid, renorm)
    plan = route(
        x,
        k,
        valid_token_count=_vtc(valid),
        expert_index_start=start,
        expert_index_end=end,
        renormalize=renorm,
    )
    check_plan(plan, want)
    check_shuffling(index_shuffling(x, start, end, _vtc(valid), k), want)


# ---------------------------------------------------------------------------------------------
# custom ops, compile


def test_opcheck():
    x = make_scores(20, 6, torch.float32, "ties", seed=1)
    vtc = torch.tensor([17], dtype=torch.int32)
    torch.library.opcheck(torch.ops.moe_kernels.index_shuffling.default, (x, 1, 5, vtc, 2))
    torch.library.opcheck(torch.ops.moe_kernels.index_shuffling.default, (x, 0, 6, None, 6))
    plain = (None, 1, 1, 1.0)
    torch.library.opcheck(torch.ops.moe_kernels.route.default, (x, 3, vtc, 2, 6, True, *plain))
    torch.library.opcheck(torch.ops.moe_kernels.route.default, (x, 1, None, 0, 6, False, *plain))
    bias = torch.linspace(-0.1, 0.2, 6)
    torch.library.opcheck(
        torch.ops.moe_kernels.route.default, (x, 2, vtc, 1, 5, True, bias, 3, 2, 2.5)
    )


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def fn(x, vtc):
        plan = route(x, 3, valid_token_count=vtc, expert_index_start=1, expert_index_end=7)
        tcpe, e, t = index_shuffling(x, 0, 8, vtc, 2)
        return (*plan, tcpe, e, t)

    x = make_scores(33, 8, torch.bfloat16, "ties", seed=9)
    vtc = torch.tensor([30])
    eager = fn(x, vtc)
    compiled = torch.compile(fn, fullgraph=True)(x, vtc)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(scores=[[1.0]]), TypeError, "scores"),
        (dict(scores=torch.zeros(4)), ValueError, "scores"),
        (dict(scores=torch.zeros(4, 3, dtype=torch.int32)), TypeError, "scores"),
        (dict(scores=torch.zeros(4, 3, dtype=torch.bool)), TypeError, "scores"),
        (dict(scores=torch.zeros(4, 0)), ValueError, "scores"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=4), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(top_k=True), TypeError, "top_k"),
        (dict(start=-1), ValueError, "expert_index_start"),
        (dict(start=4), ValueError, "expert_index_start"),
        (dict(start=2, end=1), ValueError, "expert_index_end"),
        (dict(end=5), ValueError, "expert_index_end"),
        (dict(end=2.5), TypeError, "expert_index_end"),
        (dict(vtc=torch.tensor([1.0])), TypeError, "valid_token_count"),
        (dict(vtc=torch.tensor([1, 2])), ValueError, "valid_token_count"),
        (dict(vtc=3), TypeError, "valid_token_count"),
        (dict(vtc=torch.tensor([1], device="meta")), ValueError, "valid_token_count"),
    ],
)
@pytest.mark.parametrize("op", ["route", "index_shuffling"])
def test_bad_input(op, kwargs, exc, name):
    scores = kwargs.get("scores", torch.zeros(4, 3))
    top_k = kwargs.get("top_k", 1)
    start, end, vtc = kwargs.get("start"), kwargs.get("end"), kwargs.get("vtc")
    if op == "index_shuffling":
        name = "routing_scores" if name == "scores" else name
        call = lambda: index_shuffling(scores, start, end, vtc, top_k)
    else:
        call = lambda: route(
            scores, top_k, valid_token_count=vtc, expert_index_start=start, expert_index_end=end
        )
    with pytest.raises(exc, match=name):
        call()


def test_bad_renormalize():
    with pytest.raises(TypeError, match="renormalize"):
        route(torch.zeros(2, 3), 1, renormalize=1)
