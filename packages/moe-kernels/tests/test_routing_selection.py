"""route's selection options (bias, expert groups, weight scale) against a naive Python oracle,
on the reference path (TRITON_INTERPRET=0) and on kernel A 'grouped' in the interpreter
(TRITON_INTERPRET=1); plus their gradient, determinism, compile and bad input."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.routing import route
from moe_kernels.testing import (
    check_plan,
    make_scores,
    oracle_selection_grad,
    oracle_selection_plan,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# (T, E, top_k, n_groups, topk_groups, bias, scale, renormalize, start, end, valid, kind)
CASES = [
    (37, 16, 3, 4, 2, True, 2.5, True, 0, None, None, "randn"),
    (37, 16, 3, 4, 2, True, 1.0, False, 0, None, None, "ties"),
    (29, 12, 4, 3, 2, True, 1.0, True, 2, 9, 20, "randn"),  # 4 experts a group (padded tile)
    (24, 24, 5, 4, 3, False, 2.0, False, 0, None, None, "ties"),  # 6 a group (padded)
    (20, 8, 2, 8, 3, True, 1.0, True, 0, None, None, "randn"),  # one expert a group
    (18, 10, 3, 1, None, True, 1.0, False, 0, None, 7, "special"),  # bias alone
    (18, 10, 3, 5, 2, True, 1.0, False, 0, None, None, "special"),
    (20, 6, 2, 1, None, False, 0.5, True, 1, 4, None, "randn"),  # scale alone
    (40, 64, 8, 8, 4, True, 2.5, True, 0, None, None, "randn"),  # DeepSeek-V3's shape, small T
    (6, 32, 4, 2, 1, True, 1.0, False, 0, None, None, "ties"),
    (30, 32, 10, 4, 2, True, 1.0, True, 3, 30, None, "ties"),  # top_k > 8: the tile kernel
    (12, 128, 4, 64, 8, True, 2.5, False, 0, None, None, "randn"),  # 64 groups: the tile
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_route_selection_matches_oracle(case, dtype):
    T, E, k, G, TG, has_bias, scale, renorm, start, end, valid, kind = case
    scores = make_scores(T, E, dtype, kind, seed=T + E)
    g = torch.Generator().manual_seed(E)
    bias = (torch.randn(E, generator=g) * 0.3).to(dtype) if has_bias else None
    if kind == "ties" and bias is not None:  # keep ties after the bias
        bias = torch.randint(-1, 2, (E,), generator=g).to(dtype) * 0.5
    vtc = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    plan = route(scores, k, bias=bias, n_groups=G, topk_groups=TG, scale=scale,
                 renormalize=renorm, valid_token_count=vtc, expert_index_start=start,
                 expert_index_end=end)  # fmt: skip
    want = oracle_selection_plan(scores, k, bias, G, TG, scale, renorm, start, end, valid)
    check_plan(plan, want)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(map(str, c)))
def test_tile_variant_matches_oracle(case):
    """Kernel A's rounds over a tile, forced by Constraints.block_t (the interpreter runs it;
    the reference path has no variants)."""
    from moe_kernels._dispatch import INTERPRET

    if not INTERPRET:
        pytest.skip("kernel variants run in the interpreter")
    from moe_kernels._routing_outputs import Selection
    from moe_kernels._triton.routing import launch
    from moe_kernels._triton.routing.plan import Constraints

    T, E, k, G, TG, has_bias, scale, renorm, start, end, valid, kind = case
    scores = make_scores(T, E, torch.bfloat16, kind, seed=T)
    bias = torch.linspace(-0.3, 0.4, E) if has_bias else None
    end = E if end is None else end
    plan = launch.run(scores, k, None, start, end, renorm, True, Constraints(block_t=4, sub=2),
                      selection=Selection(bias, G, TG or G, scale))  # fmt: skip
    check_plan(plan, oracle_selection_plan(scores, k, bias, G, TG, scale, renorm, start, end))


def test_group_limit_is_strict():
    """Experts of unchosen groups are never picked, not even over the -inf (and NaN) scores of
    the chosen groups. Token 0: every group scores -inf (group 3 holds 5.0 and -inf), so groups
    0 and 1 win the tie and its 5.0 is not chosen. Token 1: NaN counts as -inf."""
    x = torch.full((2, 8), float("-inf"))
    x[0, 6] = 5.0
    x[1, :4] = float("nan")
    x[1, 4:] = 1.0
    plan = route(x, 3, n_groups=4, topk_groups=2)
    check_plan(plan, oracle_selection_plan(x, 3, None, 4, 2))
    picked = plan.expert_indices[plan.inverse.long()]
    assert picked.tolist() == [[0, 1, 2], [4, 5, 6]]


def test_inverse_orders_by_biased_score():
    x = torch.tensor([[0.9, 0.1, 0.5, 0.3]])
    bias = torch.tensor([0.0, 1.0, 0.0, 0.0])
    plan = route(x, 2, bias=bias)
    chosen = plan.expert_indices[plan.inverse[0].long()]
    assert chosen.tolist() == [1, 0]  # 1.1 before 0.9
    w = plan.weights[plan.inverse[0].long()]
    assert w.tolist() == [pytest.approx(0.1), pytest.approx(0.9)]  # unbiased weights


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("rng", [(0, 16), (4, 12)])
def test_route_selection_gradient(renorm, rng):
    T, E, k, G, TG = 23, 16, 3, 4, 2
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(T, E, generator=gen).requires_grad_()
    bias = torch.randn(E, generator=gen) * 0.2
    plan = route(scores, k, bias=bias, n_groups=G, topk_groups=TG, scale=2.5,
                 renormalize=renorm, expert_index_start=rng[0],
                 expert_index_end=rng[1])  # fmt: skip
    g_P = torch.randn(T * k, generator=gen)
    (plan.weights * g_P).sum().backward()
    # the pair gradients in choice order (zero for unrouted choices)
    ok = plan.inverse >= 0
    g_TK = torch.where(ok, g_P[plan.inverse.clamp(min=0).long()], 0.0)
    want, _ = oracle_selection_grad(scores, k, bias, G, TG, 2.5, renorm, g_TK)
    torch.testing.assert_close(scores.grad, want, rtol=1e-5, atol=1e-6)


def test_selection_deterministic_and_compiled():
    import os

    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    x = make_scores(64, 32, torch.bfloat16, "ties", seed=5)
    bias = torch.linspace(-0.5, 0.5, 32)

    def fn(x):
        return tuple(route(x, 4, bias=bias, n_groups=4, topk_groups=2, scale=2.5))

    a, b = fn(x), fn(x)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    torch._dynamo.reset()
    c = torch.compile(fn, fullgraph=True)(x)
    assert all(torch.equal(u, v) for u, v in zip(a, c, strict=True))


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(n_groups=3), ValueError, "n_groups"),  # 8 experts
        (dict(n_groups=0), ValueError, "n_groups"),
        (dict(n_groups=16), ValueError, "n_groups"),
        (dict(n_groups=2.0), TypeError, "n_groups"),
        (dict(n_groups=4, topk_groups=5), ValueError, "topk_groups"),
        (dict(n_groups=4, topk_groups=0), ValueError, "topk_groups"),
        (dict(n_groups=4, topk_groups=1), ValueError, "top_k"),  # 3 > 1 * 2
        (dict(bias=torch.zeros(7)), ValueError, "bias"),
        (dict(bias=torch.zeros(8, 1)), ValueError, "bias"),
        (dict(bias=torch.zeros(8, dtype=torch.int32)), TypeError, "bias"),
        (dict(bias=[0.0] * 8), TypeError, "bias"),
        (dict(bias=torch.zeros(8, device="meta")), ValueError, "bias"),
        (dict(scale="2"), TypeError, "scale"),
        (dict(scale=True), TypeError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(scale=float("inf")), ValueError, "scale"),
    ],
)
def test_bad_selection(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        route(torch.rand(4, 8), 3, **kwargs)


def test_selection_expert_limit():
    with pytest.raises(ValueError, match="bias"):
        route(torch.rand(2, 8200), 1, bias=torch.zeros(8200))
