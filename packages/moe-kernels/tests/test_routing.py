"""index_shuffling and route against a naive Python oracle, on the reference path
(TRITON_INTERPRET=0) and on the Triton kernels in the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels.routing import RoutingPlan, index_shuffling, route

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# the naive oracle: Python loops over tokens, pairs sorted by Python's sort


def naive_plan(scores, top_k, start=None, end=None, valid=None, renormalize=False):
    """Returns dict of numpy arrays: counts, offsets, expert, token, weights, inverse, tcpe."""
    x = scores.float().numpy().astype(np.float32)
    T, E = x.shape
    start = 0 if start is None else start
    end = E if end is None else end
    L = end - start
    n_valid = T if valid is None else min(max(int(valid), 0), T)
    pairs = []  # (local expert, token, weight)
    inverse = np.full((T, top_k), -1, dtype=np.int64)
    chosen = {}
    for t in range(T):

        def sort_key(e, t=t):
            v = x[t, e]
            v = -math.inf if math.isnan(v) else float(v)
            return (-v, e)

        experts = sorted(range(E), key=sort_key)[:top_k]
        ws = [x[t, e] for e in experts]
        if renormalize:
            s = np.float32(ws[0])
            for w in ws[1:]:
                s = np.float32(s + np.float32(w))
            with np.errstate(all="ignore"):
                ws = [np.float32(np.float32(w) / s) for w in ws]
        for j, (e, w) in enumerate(zip(experts, ws, strict=True)):
            if t < n_valid and start <= e < end:
                pairs.append((e - start, t, w))
                chosen[(e - start, t)] = j
    pairs.sort(key=lambda p: (p[0], p[1]))
    P = T * top_k
    expert = np.full(P, -1, dtype=np.int64)
    token = np.full(P, -1, dtype=np.int64)
    weights = np.zeros(P, dtype=np.float32)
    counts = np.zeros(L, dtype=np.int64)
    for pos, (l, t, w) in enumerate(pairs):
        expert[pos], token[pos], weights[pos] = l, t, w
        counts[l] += 1
        inverse[t, chosen[(l, t)]] = pos
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tcpe = np.zeros(E + 2, dtype=np.int64)
    tcpe[start:end] = counts
    tcpe[E] = T
    tcpe[E + 1] = len(pairs)
    return dict(
        counts=counts,
        offsets=offsets,
        expert=expert,
        token=token,
        weights=weights,
        inverse=inverse,
        tcpe=tcpe,
    )


def assert_int(out: torch.Tensor, want: np.ndarray, name: str) -> None:
    assert out.dtype == torch.int32, name
    assert tuple(out.shape) == want.shape, (name, tuple(out.shape), want.shape)
    np.testing.assert_array_equal(out.numpy(), want, err_msg=name)


def assert_weights(out: torch.Tensor, want: np.ndarray) -> None:
    """Bitwise equal, NaN matching NaN (payloads may differ)."""
    assert out.dtype == torch.float32 and tuple(out.shape) == want.shape
    got = out.numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))


def check_plan(plan: RoutingPlan, want: dict) -> None:
    assert isinstance(plan, RoutingPlan)
    assert_int(plan.counts, want["counts"], "counts")
    assert_int(plan.offsets, want["offsets"], "offsets")
    assert_int(plan.expert_indices, want["expert"], "expert_indices")
    assert_int(plan.token_indices, want["token"], "token_indices")
    assert_weights(plan.weights, want["weights"])
    assert_int(plan.inverse, want["inverse"], "inverse")


def check_shuffling(out, want: dict) -> None:
    tcpe, expert, token = out
    assert_int(tcpe, want["tcpe"], "token_count_per_expert")
    assert_int(expert, want["expert"], "expert_indices")
    assert_int(token, want["token"], "token_indices")


def make_scores(T, E, dtype, kind="randn", seed=0, layout="row"):
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
    check_plan(plan, naive_plan(x, k, start, end, valid, renorm))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: "-".join(map(str, c)))
def test_index_shuffling_matches_oracle(case, dtype):
    T, E, k, start, end, valid, kind, layout = case
    x = make_scores(T, E, dtype, kind, seed=2 * T + E, layout=layout)
    out = index_shuffling(x, start, end, _vtc(valid, torch.int64), k)
    check_shuffling(out, naive_plan(x, k, start, end, valid))


def test_route_renormalize_and_consistency():
    x = torch.softmax(make_scores(70, 10, torch.float32, seed=3), dim=-1)
    vtc = torch.tensor([60])
    plain = route(x, 3, valid_token_count=vtc, expert_index_start=1, expert_index_end=9)
    renorm = route(
        x, 3, valid_token_count=vtc, expert_index_start=1, expert_index_end=9, renormalize=True
    )
    check_plan(renorm, naive_plan(x, 3, 1, 9, 60, renormalize=True))
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
    want = naive_plan(x, 4)
    check_plan(plan, want)
    # every token has experts 0..3 once
    for t in range(6):
        exps = sorted(plan.expert_indices[plan.inverse[t].long()].tolist())
        assert exps == [0, 1, 2, 3]


@pytest.mark.parametrize("valid", [0, 1, 5, 40, 10**6, -3])
def test_valid_token_count(valid):
    x = make_scores(40, 6, torch.float16, "ties", seed=valid % 7)
    vtc = torch.tensor([valid], dtype=torch.int64)
    check_plan(route(x, 2, valid_token_count=vtc), naive_plan(x, 2, valid=valid))


def test_more_than_65536_experts():
    x = make_scores(3, 70001, torch.bfloat16, "ties", seed=2)
    check_plan(
        route(x, 2, expert_index_start=5, renormalize=True), naive_plan(x, 2, 5, None, None, True)
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
    want = naive_plan(x, k, start, end, valid, renorm)
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
    torch.library.opcheck(torch.ops.moe_kernels.route.default, (x, 3, vtc, 2, 6, True))
    torch.library.opcheck(torch.ops.moe_kernels.route.default, (x, 1, None, 0, 6, False))


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


# ---------------------------------------------------------------------------------------------
# the kernels' other launch shapes (several blocks per program, the separate scan launch, both
# placements)


@pytest.mark.parametrize(
    "config",
    [
        # C sorts each program's pairs (the placement of large problems)
        {"BLOCK_T": 8, "SUB": 2, "FUSE_SCAN": False, "SORTED": True, "INSERT": False},
        {"BLOCK_T": 32, "SUB": 4, "FUSE_SCAN": True, "SORTED": True, "INSERT": False},
        {"BLOCK_T": 4, "SUB": 1, "FUSE_SCAN": False, "SORTED": True, "INSERT": False},
        {"BLOCK_T": 4, "SUB": 1, "FUSE_SCAN": False, "SORTED": True, "SCAN_CHUNK": 4},
        {"BLOCK_T": 16, "SUB": 2, "FUSE_SCAN": True, "SORTED": True, "KEY64": True},
        # ranks from bitmasks in kernel A and scattered stores in C (small problems)
        {"BLOCK_T": 8, "SUB": 2, "FUSE_SCAN": False, "SORTED": False},
        {"BLOCK_T": 32, "SUB": 4, "FUSE_SCAN": True, "SORTED": False},
        # top-k by per-thread insertion (sorted placement only)
        {"SORTED": True, "INSERT": True},
        {"BLOCK_T": 16, "SUB": 2, "SORTED": True, "INSERT": True, "FUSE_SCAN": False},
        # ranks from byte-packed per-expert counts in C instead of its sort
        {"BLOCK_T": 8, "SUB": 2, "FUSE_SCAN": False, "SORTED": True, "COUNT": True},
        {"SORTED": True, "INSERT": True, "COUNT": True},
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_launch_shapes(config, dtype):
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import routing_triton

    T, E, k, start, end, valid = 75, 11, 3, 2, 9, 70
    x = make_scores(T, E, dtype, "ties", seed=11, layout="col")
    want = naive_plan(x, k, start, end, valid, renormalize=True)
    for one_buffer in (False, True):
        got = routing_triton(
            x, k, _vtc(valid), start, end, True, True, True, True, config, one_buffer
        )
        check_plan(RoutingPlan(*got[:6]), want)
        assert_int(got[6], want["tcpe"], "token_count_per_expert")


@pytest.mark.parametrize(
    "config",
    [
        {"SORTED": True, "FKEY": True},  # fp32 keys, insertion
        {"SORTED": True, "MERGE": True},  # int keys, sort-8 + merge
        {"SORTED": True, "FKEY": True, "MERGE": True},
        {"BLOCK_T": 16, "SUB": 2, "SORTED": True, "FKEY": True, "MERGE": True, "FUSE_SCAN": False},
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "T,E,k,kind,layout",
    [
        (75, 11, 8, "ties", "col"),  # padded columns, -0.0 beside +0.0
        (66, 128, 8, "special", "row"),  # NaN, +-inf, an all -inf and an all NaN row
        (33, 20, 5, "randn", "strided"),  # top_k < K_PAD
        (9, 5, 5, "special", "row"),
    ],
)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_topk_variants(config, T, E, k, kind, layout, dtype):
    """The insertion top-k's fp32 keys and sort-and-merge network against the reference."""
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import routing_triton

    x = make_scores(T, E, dtype, kind, seed=T + E, layout=layout)
    want = naive_plan(x, k, 0, E, None, renormalize=False)
    got = routing_triton(x, k, None, 0, E, False, True, True, True, config)
    check_plan(RoutingPlan(*got[:6]), want)
    assert_int(got[6], want["tcpe"], "token_count_per_expert")


@pytest.mark.parametrize("rank", ("sort", "count"))
@pytest.mark.parametrize("pack_w", (True, False), ids=("pack_w", "scratch_w"))
@pytest.mark.parametrize(
    "T,E,k,start,end,valid,kind",
    [
        (70, 128, 8, 0, 128, None, "special"),  # 7 expert + 9 index bits: the full 32-bit key
        (45, 30, 6, 3, 25, 40, "special"),  # expert range, valid count
        (37, 9, 3, 2, 9, 0, "ties"),  # nothing routed
    ],
)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_packed_weights(rank, pack_w, T, E, k, start, end, valid, kind, dtype):
    """Sorted placement with the 16-bit weights carried in A's choices and C's sort keys
    (``PACK_W``, the default for route without renormalize) against the reference, and the fp32
    weight scratch it replaces; each with C ranking by sorting or by counting (``COUNT``)."""
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import _launch_plan, routing_triton

    config = {"SORTED": True, "PACK_W": pack_w, "COUNT": rank == "count"}
    kind_id = 1 if dtype == torch.bfloat16 else 2
    plan = _launch_plan(T, E, k, start, end, kind_id, False, valid is not None, True, True, True,
                        tuple(sorted(config.items())))  # fmt: skip
    assert plan.c["PACK_W"] == pack_w and plan.sizes[-1] == (0 if pack_w else T * k)
    assert plan.c["COUNT"] == (rank == "count")
    x = make_scores(T, E, dtype, kind, seed=T * E, layout="row")
    want = naive_plan(x, k, start, end, valid, renormalize=False)
    got = routing_triton(x, k, _vtc(valid), start, end, False, True, True, True, config)
    check_plan(RoutingPlan(*got[:6]), want)
    assert_int(got[6], want["tcpe"], "token_count_per_expert")


@pytest.mark.parametrize(
    "T,E,k,start,end,valid,config",
    [
        (130, 32, 8, 0, 32, None, {}),  # 32 experts: one 32-bit word a token, 3 programs
        (200, 64, 4, 16, 48, 150, {}),  # expert range, valid count
        (90, 16, 2, 0, 16, 77, {}),  # 16-bit words
        (40, 20, 16, 0, 20, None, {"BLOCK_T": 8, "SUB": 4, "INSERT": False}),  # k > 8
        pytest.param(  # 16 tokens
            70,
            300,
            8,
            4,
            36,
            None,
            {"BLOCK_T": 16, "SUB": 1, "FUSE_SCAN": False},
            marks=pytest.mark.slow,
        ),
        (66, 256, 8, 0, 256, None, {"CUMSUM": True}),  # 8 words a token
        (50, 8, 3, 0, 8, 20, {"CUMSUM": True}),  # 8 experts
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cumsum_ranks(T, E, k, start, end, valid, config, dtype):
    """index_shuffling's C ranking by prefix sums of one-hot rows (``CUMSUM``, the default for
    16-32 local experts) against the reference: 8 to 256 experts (8-, 16- and 32-bit one-hot
    words), 16 to 64 tokens a program, more than 8 choices a token, expert ranges."""
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import _KIND, _launch_plan, routing_triton

    config = {"SORTED": True, **config}
    plan = _launch_plan(T, E, k, start, end, _KIND[dtype], False, valid is not None, False, False,
                        True, tuple(sorted(config.items())))  # fmt: skip
    assert plan.c["CUMSUM"] and not plan.c["COUNT"]
    x = make_scores(T, E, dtype, "special", seed=T + E, layout="row")
    want = naive_plan(x, k, start, end, valid)
    for one_buffer in (False, True):
        got = routing_triton(
            x, k, _vtc(valid), start, end, False, False, False, True, config, one_buffer
        )
        check_shuffling((got[6], got[2], got[3]), want)


@pytest.mark.parametrize(
    "T,E,k,start,end,valid,kind,layout,config",
    [
        pytest.param(  # 3 programs of 64 tokens
            130, 128, 8, 0, 128, None, "ties", "row", {"COLS_T": 64}, marks=pytest.mark.slow
        ),
        pytest.param(  # 128-token programs
            130, 128, 8, 0, 128, None, "special", "pad", {}, marks=pytest.mark.slow
        ),
        (100, 64, 5, 3, 59, 70, "special", "row", {}),  # 64 experts, range, valid count
        (100, 128, 1, 40, 41, None, "randn", "pad", {}),  # k = 1, one expert
        (70, 128, 3, 10, 100, 0, "ties", "row", {}),  # nothing routed
        (90, 64, 8, 0, 64, None, "special", "pad", {"COLS_T": 128}),
        (70, 64, 8, 0, 64, None, "ties", "odd", {"COLS_T": 128}),  # odd stride: not as pairs
    ],
)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_token_columns(T, E, k, start, end, valid, kind, layout, config, dtype):
    """The token-column plan (``COLS``: kernel A takes each row's top-k by a threshold over
    packed 16-bit pairs, transposes the choices into per-expert token words and places each
    pair among its program's pairs in sorted order by their popcounts; C, or D after the scan's
    launch, writes them out; the default for 16-bit scores, 64 or 128 experts, k <= 8) against
    the oracle, index_shuffling and route: ties (and -0.0 beside +0.0), NaN / inf / -inf rows,
    k < 8, expert ranges, valid counts, padded rows. Rows with an odd stride are not read as
    pairs and take the other plan."""
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import _KIND, _launch_plan, routing_triton

    config = {"SORTED": True, **config}
    x = make_scores(T, E, dtype, kind, seed=T + E + k, layout=layout)
    words = layout != "odd"
    plan = _launch_plan(T, E, k, start, end, _KIND[dtype], False, valid is not None, False, False,
                        True, tuple(sorted(config.items())), False, words)  # fmt: skip
    assert ("MODE" in plan.a) == words and plan.c["COLS"] == words
    want = naive_plan(x, k, start, end, valid)
    # C writes the placed pairs out, or, after the scan's launch, D (``RUNS``, here with groups
    # of 2 programs); route on the same plan (``COLS_ROUTE``, its default there) too
    runs = {"FUSE_SCAN": 0, "RUNS_P": 2}
    for one_buffer, extra in ((False, {}), (True, runs)):
        cfg = {**config, **extra}
        got = routing_triton(
            x, k, _vtc(valid), start, end, False, False, False, True, cfg, one_buffer
        )
        check_shuffling((got[6], got[2], got[3]), want)
        cfg["COLS_ROUTE"] = True
        plan = _launch_plan(T, E, k, start, end, _KIND[dtype], False, valid is not None, True,
                            True, False, tuple(sorted(cfg.items())), False, words)  # fmt: skip
        assert ("MODE" in plan.a) == words and plan.c["COLS"] == words
        assert plan.c["RUNS"] == (words and bool(extra) and end > start)
        got = routing_triton(x, k, _vtc(valid), start, end, False, True, True, False, cfg)
        check_plan(RoutingPlan(*got[:6]), want)


@pytest.mark.slow
@pytest.mark.parametrize("fuse", (True, False), ids=("C", "D"))
def test_token_columns_256_token_programs(fuse):
    """The token-column plan with 256-token programs (8 bits of token, 11 of place in A's
    words), written out by C or by D (``RUNS``): route and index_shuffling against the oracle."""
    from moe_kernels._dispatch import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("the Triton launcher runs on CPU only under TRITON_INTERPRET=1")
    from moe_kernels._triton.routing import routing_triton

    T, E, k, start, end, valid = 600, 128, 8, 5, 120, 590
    x = make_scores(T, E, torch.bfloat16, "ties", seed=3, layout="row")
    cfg = {"SORTED": True, "COLS_T": 256, "FUSE_SCAN": int(fuse), "RUNS_P": 2}
    want = naive_plan(x, k, start, end, valid)
    got = routing_triton(x, k, _vtc(valid), start, end, False, True, True, True, cfg)
    check_plan(RoutingPlan(*got[:6]), want)
    check_shuffling((got[6], got[2], got[3]), want)
