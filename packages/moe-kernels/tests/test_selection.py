"""moe_kernels.selection.topk_choices, the torch formula of route's selection, bit for bit
against a naive Python oracle (per token: sorted lists, float32 sums in choice order); ties,
-0.0, NaN and infinities; no graph break; bad arguments."""

from __future__ import annotations

import pytest
import torch

from moe_kernels import TopkChoices, topk_choices
from moe_kernels.testing import make_scores, oracle_topk_choices, oracle_topk_weights

# (T, E, top_k, n_groups, topk_groups, bias, scale, renormalize, kind)
CASES = [
    (31, 16, 3, 1, None, False, 1.0, False, "randn"),
    (31, 16, 3, 1, None, False, 1.0, True, "ties"),
    (31, 16, 3, 4, 2, True, 2.5, True, "randn"),
    (31, 16, 4, 4, 2, True, -0.5, False, "ties"),
    (20, 12, 4, 3, 2, True, 1.0, True, "special"),
    (20, 8, 2, 8, 3, True, 1.0, False, "special"),  # one expert a group
    (9, 10, 3, 5, 2, False, 2.0, True, "ties"),
    (12, 64, 8, 8, 4, True, 2.5, True, "randn"),  # DeepSeek-V3's routing, small
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_topk_choices_match_naive_oracle(case, dtype):
    T, E, k, G, TG, has_bias, scale, renorm, kind = case
    scores = make_scores(T, E, torch.float32, kind, seed=T * E).to(dtype)
    g = torch.Generator().manual_seed(E)
    bias = torch.randint(-2, 3, (E,), generator=g).to(dtype) * 0.25 if has_bias else None
    got = topk_choices(
        scores, k, bias=bias, n_groups=G, topk_groups=TG, scale=scale, renormalize=renorm
    )
    assert isinstance(got, TopkChoices)
    x = scores.float().numpy()
    want = oracle_topk_choices(scores, k, bias, G, TG or G).tolist()
    assert got.experts.dtype == torch.int64 and got.experts.tolist() == want
    assert got.weights.dtype == torch.float32
    want_w = torch.from_numpy(oracle_topk_weights(x, want, renorm, scale))
    assert torch.equal(got.weights.nan_to_num(7.0), want_w.nan_to_num(7.0))


def test_ties_nan_and_groups_by_hand():
    s = torch.tensor([[0.2, 0.5, 0.5, 0.1], [float("nan"), 0.3, 0.3, -0.0]])
    assert topk_choices(s, 2).experts.tolist() == [[1, 2], [1, 2]]
    assert topk_choices(s, 4).experts[1].tolist() == [1, 2, 3, 0]  # NaN ranks last, as -inf
    # groups {0, 1}, {2, 3}: group scores 0.7 / 0.6 and NaN / 0.3; one group each
    both = topk_choices(s, 2, n_groups=2, topk_groups=1, renormalize=True, scale=2.0)
    assert both.experts.tolist() == [[1, 0], [2, 3]]
    w = both.weights[0].tolist()
    assert w == [pytest.approx(2 * 0.5 / 0.7), pytest.approx(2 * 0.2 / 0.7)]
    biased = topk_choices(s, 1, bias=torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert biased.experts.tolist() == [[3], [3]]
    assert biased.weights[:, 0].tolist() == [pytest.approx(0.1), 0.0]  # unbiased weights


def test_weights_differentiable_and_graph_whole():
    s = torch.rand(6, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    got = topk_choices(s, 3, renormalize=True)
    got.weights.sum().backward()  # each token's renormalised weights sum to 1
    torch.testing.assert_close(s.grad, torch.zeros_like(s), atol=1e-6, rtol=0)
    torch._dynamo.reset()
    opts = dict(bias=torch.linspace(-0.1, 0.1, 8), n_groups=4, topk_groups=2, scale=2.5)
    fn = torch.compile(lambda x: topk_choices(x, 3, **opts), fullgraph=True, backend="eager")
    eager = topk_choices(s.detach(), 3, **opts)
    compiled = fn(s.detach())
    assert torch.equal(compiled.experts, eager.experts)
    assert torch.equal(compiled.weights, eager.weights)
    torch._dynamo.reset()


S = torch.rand(4, 8)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: topk_choices(S.tolist(), 2), TypeError, "scores must be a torch.Tensor"),
        (lambda: topk_choices(S[0], 2), ValueError, "scores must be 2-D"),
        (lambda: topk_choices(S.int(), 2), TypeError, "scores must have dtype"),
        (lambda: topk_choices(S, 9), ValueError, r"top_k must be in \[1, 8\]"),
        (lambda: topk_choices(S, 2.0), TypeError, "top_k must be an int"),
        (lambda: topk_choices(S, 2, bias=torch.zeros(7)), ValueError, "bias must have size 8"),
        (lambda: topk_choices(S, 2, bias=torch.zeros(8).int()), TypeError, "bias must have"),
        (lambda: topk_choices(S, 2, n_groups=3), ValueError, "n_groups=3 must divide the 8"),
        (lambda: topk_choices(S, 2, n_groups=4, topk_groups=5), ValueError, "topk_groups"),
        (lambda: topk_choices(S, 3, n_groups=4, topk_groups=1), ValueError, "top_k=3 exceeds"),
        (lambda: topk_choices(S, 2, scale=float("inf")), ValueError, "scale must be finite"),
        (lambda: topk_choices(S, 2, scale="2"), TypeError, "scale must be a float"),
        (lambda: topk_choices(S, 2, renormalize=1), TypeError, "renormalize must be a bool"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
