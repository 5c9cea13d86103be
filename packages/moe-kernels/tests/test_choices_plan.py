"""moe_kernels.plan_from_choices: the plan of given (T, k) choices against a Python-loop oracle
and against ``route``'s plan of the same choices; sentinels and expert ranges, the gradient to
the weights, no graph break, bad arguments."""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk


def oracle_plan(experts_TK: torch.Tensor, weights_TK: torch.Tensor, start: int, end: int):
    """Python loops: the routed pairs (local expert, token, choice) sorted as tuples."""
    T, K = experts_TK.shape
    pairs = sorted(
        (int(experts_TK[t, j]) - start, t, j)
        for t in range(T)
        for j in range(K)
        if start <= int(experts_TK[t, j]) < end
    )
    P, L = T * K, end - start
    expert, token, weight = [-1] * P, [-1] * P, [0.0] * P
    inverse = [[-1] * K for _ in range(T)]
    counts = [0] * L
    for pos, (e, t, j) in enumerate(pairs):
        expert[pos], token[pos], weight[pos] = e, t, float(weights_TK[t, j].float())
        inverse[t][j] = pos
        counts[e] += 1
    offsets = [sum(counts[:i]) for i in range(L + 1)]
    return counts, offsets, expert, token, weight, inverse


CASES = [  # (T, E, k, start, end, sentinels)
    (1, 1, 1, None, None, False),
    (37, 8, 3, None, None, False),
    (37, 8, 3, 2, 6, False),
    (64, 16, 4, None, None, True),  # -1 and >= E choices: expert-parallel sentinels
    (5, 128, 8, 64, 128, True),
    (512, 64, 8, None, None, True),  # 4096 pairs: the one-program kernel's largest
    (513, 64, 8, None, None, True),  # one token more: the sort of the reference path
]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_plan_matches_oracle(case, index_dtype):
    T, E, k, start, end, sentinels = case
    g = torch.Generator().manual_seed(T * E + k)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if sentinels:
        experts[::3, -1] = -1
        experts[1::4, 0] = E + 2
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    plan = mk.plan_from_choices(
        experts.to(index_dtype), weights, E, expert_index_start=start, expert_index_end=end
    )
    counts, offsets, expert, token, weight, inverse = oracle_plan(
        experts, weights, start or 0, E if end is None else end
    )
    assert isinstance(plan, mk.RoutingPlan)
    for name in ("counts", "offsets", "expert_indices", "token_indices", "inverse"):
        assert getattr(plan, name).dtype == torch.int32, name
    assert plan.counts.tolist() == counts and plan.offsets.tolist() == offsets
    assert plan.expert_indices.tolist() == expert and plan.token_indices.tolist() == token
    assert plan.inverse.tolist() == inverse
    assert plan.weights.dtype == torch.float32
    assert plan.weights.tolist() == torch.tensor(weight, dtype=torch.float32).tolist()


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("expert_range", [(None, None), (3, 13)])
def test_plan_of_route_choices_is_route_plan(renormalize, expert_range):
    """route's choices handed back give route's plan, field for field."""
    start, end = expert_range
    scores = torch.softmax(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)), -1)
    scores[7] = scores[8]  # duplicate rows
    w, e = mk.topk_choices(scores, 4, renormalize=renormalize)
    want = mk.route(
        scores, 4, renormalize=renormalize, expert_index_start=start, expert_index_end=end
    )
    got = mk.plan_from_choices(e, w, 16, expert_index_start=start, expert_index_end=end)
    for name in want._fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_repeated_expert_keeps_choice_order():
    plan = mk.plan_from_choices(torch.tensor([[2, 2], [0, 2]]), torch.tensor([[0.25, 0.5]] * 2), 3)
    assert plan.token_indices.tolist() == [1, 0, 0, 1]
    assert plan.weights.tolist() == [0.25, 0.25, 0.5, 0.5]
    assert plan.inverse.tolist() == [[1, 2], [0, 3]]


def test_weights_gradient_is_the_gather():
    e = torch.tensor([[1, 0], [1, 2], [5, 1]])  # 5: a sentinel, its gradient 0
    w = torch.rand(3, 2, dtype=torch.float64, requires_grad=True)
    plan = mk.plan_from_choices(e, w, 3)
    g = torch.arange(6, dtype=torch.float32) + 1
    (plan.weights * g).sum().backward()
    want = torch.zeros(3, 2, dtype=torch.float64)
    for t in range(3):
        for j in range(2):
            pos = int(plan.inverse[t, j])
            want[t, j] = g[pos] if pos >= 0 else 0
    assert torch.equal(w.grad, want)


def test_no_graph_break():
    torch._dynamo.reset()
    fn = torch.compile(lambda e, w: mk.plan_from_choices(e, w, 8), fullgraph=True, dynamic=False)
    e = torch.randint(0, 8, (16, 2))
    w = torch.rand(16, 2)
    got, want = fn(e, w), mk.plan_from_choices(e, w, 8)
    for name in want._fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_bad_arguments():
    e, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    with pytest.raises(TypeError, match="expert_indices"):
        mk.plan_from_choices(e.float(), w, 4)
    with pytest.raises(ValueError, match="expert_indices"):
        mk.plan_from_choices(e[0], w[0], 4)
    with pytest.raises(TypeError, match="weights"):
        mk.plan_from_choices(e, w.int(), 4)
    with pytest.raises(ValueError, match="weights"):
        mk.plan_from_choices(e, w[:3], 4)
    with pytest.raises(ValueError, match="n_experts"):
        mk.plan_from_choices(e, w, 0)
    with pytest.raises(TypeError, match="n_experts"):
        mk.plan_from_choices(e, w, 4.0)
    with pytest.raises(ValueError, match="expert_index_end"):
        mk.plan_from_choices(e, w, 4, expert_index_start=2, expert_index_end=2)
    with pytest.raises(ValueError, match="expert_index_start"):
        mk.plan_from_choices(e, w, 4, expert_index_start=4)
    with pytest.raises(ValueError, match="weights"):
        mk.plan_from_choices(e, w.to("meta"), 4)
