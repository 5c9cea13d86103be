"""Registry entries of the routing ops: ``route``, ``index_shuffling``, ``topk_choices``,
``plan_from_choices``, ``router_scores``."""

from __future__ import annotations

import math
import random
from functools import partial

import torch
import torch.nn.functional as F

from moe_kernels.testing import oracle_pairs, oracle_router_scores, oracle_topk_choices
from moe_tools.ops.spec import (
    CheckFailed,
    OpSpec,
    Problem,
    Sizes,
    expect_equal,
    expect_within,
    randn,
    softmax_scores,
)

# ----------------------------------------------------------------------------------------------
# torch-native routing (the naive oracles: moe_kernels.testing)


def torch_route(scores_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """What the routing kernels replace: topk, a stable sort of the expert ids, bincount."""
    weights_TK, experts_TK = torch.topk(scores_TE, top_k, dim=1)
    flat_N = experts_TK.flatten()
    _, order_N = torch.sort(flat_N, stable=True)
    counts_E = torch.bincount(flat_N, minlength=scores_TE.shape[1])
    return counts_E, order_N, flat_N[order_N], weights_TK.flatten()[order_N]


# ----------------------------------------------------------------------------------------------
# route and index_shuffling

ROUTE_SIZES = {
    "quick": [dict(T=512, E=16, k=4), dict(T=1024, E=128, k=8)],
    "full": [
        dict(T=T, E=E, k=8) for T, E in ((4096, 16), (4096, 128), (65536, 128), (1048576, 128))
    ],
}


def _draw_route(rng: random.Random, large: bool) -> Sizes:
    E = rng.choice([4, 16, 33, 128] if large else [4, 8, 16])
    k = rng.choice([k for k in (1, 2, 4, 8) if k <= E])
    return dict(T=rng.randint(1, 2048 if large else 200), E=E, k=k)


def _make_route(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    scores = softmax_scores(s["T"], s["E"], gen, device)
    return Problem(f"T={s['T']} E={s['E']} k={s['k']}", s, (scores, s["k"]))


def _make_shuffling(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    p = _make_route(s, gen, device)
    return Problem(p.label, s, (p.args[0],), {"top_k": s["k"]})


def _route_bytes(p: Problem) -> int:
    T, E, k = p.sizes["T"], p.sizes["E"], p.sizes["k"]
    return T * E * p.args[0].element_size() + T * k * 4 * 5 + (2 * E + 1) * 4


def _shuffling_bytes(p: Problem) -> int:
    T, E, k = p.sizes["T"], p.sizes["E"], p.sizes["k"]
    return T * E * p.args[0].element_size() + T * k * 4 * 2 + (E + 2) * 4


def _route_reference(scores, top_k, **_):
    from moe_kernels.reference.routing import route_reference

    return route_reference(scores, top_k, None, 0, scores.shape[1], False)


def _shuffling_reference(scores, top_k=1, **_):
    from moe_kernels.reference.routing import index_shuffling_reference

    return index_shuffling_reference(scores, 0, scores.shape[1], None, top_k)


def _route_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    scores, k = p.args
    T, E = scores.shape
    counts, offsets, exp_P, tok_P, w_P, inv_TK = (t.cpu() for t in out)
    choice = oracle_topk_choices(scores, k)
    oe, ot = oracle_pairs(choice, E)
    expect_equal("oracle counts", counts.long(), torch.bincount(choice.flatten(), minlength=E))
    expect_equal("oracle offsets[1:]", offsets[1:].long(), torch.cumsum(counts.long(), 0))
    expect_equal("oracle experts", exp_P.long(), oe)
    expect_equal("oracle tokens", tok_P.long(), ot)
    expect_equal("oracle weights", w_P, scores.float().cpu()[ot, oe])
    expect_equal(
        "oracle inverse->token", tok_P.long()[inv_TK.long()], torch.arange(T)[:, None].expand(T, k)
    )
    expect_equal("oracle inverse->expert", exp_P.long()[inv_TK.long()], choice)
    return 0.0


def _shuffling_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    (scores,), k = p.args, p.kwargs["top_k"]
    T, E = scores.shape
    counts, exp_P, tok_P = (t.cpu().long() for t in out)
    choice = oracle_topk_choices(scores, k)
    oe, ot = oracle_pairs(choice, E)
    tail = torch.tensor([T, T * k])
    expect_equal(
        "oracle counts", counts, torch.cat([torch.bincount(choice.flatten(), minlength=E), tail])
    )
    expect_equal("oracle experts", exp_P, oe)
    expect_equal("oracle tokens", tok_P, ot)
    return 0.0


ROUTE = OpSpec(
    name="route",
    sizes=ROUTE_SIZES,
    draw=_draw_route,
    make=_make_route,
    reference=_route_reference,
    oracle=_route_oracle,
    bytes_moved=_route_bytes,
    native=lambda p: partial(torch_route, *p.args),
)

INDEX_SHUFFLING = OpSpec(
    name="index_shuffling",
    sizes=ROUTE_SIZES,
    draw=_draw_route,
    make=_make_shuffling,
    reference=_shuffling_reference,
    oracle=_shuffling_oracle,
    bytes_moved=_shuffling_bytes,
    native=lambda p: partial(torch_route, p.args[0], p.kwargs["top_k"]),
    fbgemm=lambda ops, p: partial(ops.index_shuffling, p.args[0], top_k=p.kwargs["top_k"]),
)


# ----------------------------------------------------------------------------------------------
# router_scores

U32 = 2.0**-24  # unit roundoff of fp32


def _draw_router(rng: random.Random, large: bool) -> Sizes:
    return dict(
        T=rng.randint(1, 4096 if large else 64),
        D=rng.choice([256, 2048, 2050] if large else [16, 64, 130]),
        E=rng.choice([1, 16, 33, 128] if large else [1, 4, 16, 33]),
        score_fn=rng.choice(["softmax", "sigmoid"]),
        dtype=rng.choice(["float32", "bfloat16"]),
    )


def _make_router(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    T, D, E = s["T"], s["D"], s["E"]
    x = randn((T, D), gen, device, getattr(torch, s.get("dtype", "bfloat16")))
    w = randn((E, D), gen, device, torch.float32) / math.sqrt(D)  # nn.Linear's scale
    label = f"T={T} D={D} E={E} {s['score_fn']} {str(x.dtype).removeprefix('torch.')}"
    return Problem(label, s, (x, w), {"score_fn": s["score_fn"]})


def _router_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """float64 scores with a rigorous bound: any fp32 summation order of D products moves a logit
    by at most gamma_D * sum |x w| (gamma_D = D u / (1 - D u)); a softmax score then by at most
    s_e (|dl_e| + max_j |dl_j|), a sigmoid by s |dl|; plus 8 ulps for exp and divide."""
    (x, w), score_fn = p.args, p.kwargs["score_fn"]
    exact, dl = oracle_router_scores(x.cpu(), w.cpu(), score_fn)
    if score_fn == "softmax":
        slack = dl + dl.amax(dim=1, keepdim=True) if dl.numel() else dl
    else:
        slack = dl
    return expect_within("vs oracle", out[0], exact, exact * (slack + 8 * U32) + 1e-30)


def _router_native(p: Problem):
    (x, w), fn = p.args, p.kwargs["score_fn"]
    score = torch.softmax if fn == "softmax" else (lambda z, dim: torch.sigmoid(z))
    return lambda: score(F.linear(x.float(), w.float()), dim=-1)


def _router_reference(x, w, score_fn="softmax"):
    from moe_kernels.reference.router import router_scores

    return router_scores(x, w, score_fn)


ROUTER_SCORES = OpSpec(
    name="router_scores",
    sizes={
        "quick": [dict(T=256, D=64, E=16, score_fn="softmax")],
        "full": [
            dict(T=T, D=2048, E=E, score_fn="softmax")
            for T, E in ((512, 16), (2048, 16), (16384, 16), (16384, 128))
        ],
    },
    draw=_draw_router,
    make=_make_router,
    reference=_router_reference,
    oracle=_router_oracle,
    bytes_moved=lambda p: (
        p.args[0].numel() * p.args[0].element_size()
        + p.args[1].numel() * 4
        + p.args[0].shape[0] * p.args[1].shape[0] * 4
    ),
    flops=lambda p: 2 * p.args[0].shape[0] * p.args[0].shape[1] * p.args[1].shape[0],
    native=_router_native,
    # summation order and exp: fp32 rounding, not bitwise; the "split" variant (E > 32, bf16 x)
    # accumulates on tensor cores: 6e-6 to 3e-5 of the largest value from float64 on the H200
    # at training sizes (benchmarks/gpu/router_train_gpu.py), the fp32 formula 5e-7 to 5e-6
    reference_tol=(1e-5, 3e-5),
)

# ----------------------------------------------------------------------------------------------
# topk_choices


def _draw_topk(rng: random.Random, large: bool) -> Sizes:
    E = rng.choice([4, 16, 33, 96, 128] if large else [4, 8, 12, 16])
    n_groups = rng.choice([g for g in (1, 2, 4, 8) if E % g == 0])
    topk_groups = rng.randint(1, n_groups)
    k = rng.choice([k for k in (1, 2, 4, 8) if k <= topk_groups * (E // n_groups)])
    return dict(
        T=rng.randint(1, 2048 if large else 200),
        E=E,
        k=k,
        n_groups=n_groups,
        topk_groups=topk_groups,
        bias=rng.choice([False, True]),
        renormalize=rng.choice([False, True]),
        scale=rng.choice([1.0, 2.5]),
        dtype=rng.choice(["float32", "bfloat16"]),
        score_fn=rng.choice(["softmax", "sigmoid"]),
    )


def _make_topk(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    """Router scores (softmax, or sigmoid of normal logits: many ties in bf16) and the options;
    ``bias``: a small fp32 selection bias (DeepSeek-V3's load balancing)."""
    T, E, k = s["T"], s["E"], s["k"]
    dtype = getattr(torch, s.get("dtype", "bfloat16"))
    if s.get("score_fn", "softmax") == "softmax":
        scores = softmax_scores(T, E, gen, device, dtype)
    else:
        scores = torch.sigmoid(randn((T, E), gen, device, torch.float32)).to(dtype)
    kwargs = dict(
        bias=randn((E,), gen, device, torch.float32) * 0.01 if s.get("bias") else None,
        n_groups=s.get("n_groups", 1),
        topk_groups=s.get("topk_groups", s.get("n_groups", 1)),
        scale=float(s.get("scale", 1.0)),
        renormalize=bool(s.get("renormalize", False)),
    )
    opts = (
        [f"groups={kwargs['topk_groups']}/{kwargs['n_groups']}"] if kwargs["n_groups"] > 1 else []
    )
    opts += ["bias"] if kwargs["bias"] is not None else []
    opts += ["renormalize"] if kwargs["renormalize"] else []
    opts += [f"scale={kwargs['scale']:g}"] if kwargs["scale"] != 1.0 else []
    label = " ".join([f"T={T} E={E} k={k} {str(dtype).removeprefix('torch.')}", *opts])
    return Problem(label, s, (scores, k), kwargs)


def _topk_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """The experts of ``oracle_topk_choices`` (a loop over the tokens: selection values ``scores +
    bias``, the contract's fp32 add, NaN as -inf; each group's score the fp32 sum of its two
    largest values, the ``topk_groups`` best groups, ties to the lower group; then the k best of
    their experts, ties to the lower expert). Weights: the choices' scores exactly without
    renormalize and scale, else their float64 value within (k + 4) fp32 roundings (sequential
    sum, division, scale)."""
    (scores, k), kw = p.args, p.kwargs
    weights, experts = out
    if weights.dtype != torch.float32 or experts.dtype != torch.int64:
        raise CheckFailed(f"dtypes {weights.dtype}, {experts.dtype}: float32, int64 expected")
    want = oracle_topk_choices(scores, k, kw["bias"], kw["n_groups"], kw["topk_groups"])
    expect_equal("experts vs oracle", experts.cpu(), want)
    raw = scores.double().cpu().gather(1, want)
    if not kw["renormalize"] and kw["scale"] == 1.0:
        return expect_equal("weights vs oracle", weights, raw)
    exact = raw / raw.sum(dim=1, keepdim=True) if kw["renormalize"] else raw
    exact = exact * kw["scale"]
    return expect_within("weights vs oracle", weights, exact, exact.abs() * (k + 4) * U32)


def _topk_native(p: Problem):
    """torch.topk of the (biased) fp32 scores, DeepSeek-V3's group limit (top-2 sums, the best
    groups' experts), a gather of the weights."""
    (scores, k), kw = p.args, p.kwargs
    T, E = scores.shape
    n_groups, topk_groups = kw["n_groups"], kw["topk_groups"]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = scores.float()
        sel = x + kw["bias"] if kw["bias"] is not None else x
        if topk_groups < n_groups:
            grouped = sel.view(T, n_groups, E // n_groups)
            group = grouped.topk(min(2, E // n_groups), dim=2).values.sum(dim=2)
            keep = torch.zeros_like(group, dtype=torch.bool)
            keep.scatter_(1, group.topk(topk_groups, dim=1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(E // n_groups, dim=1), float("-inf"))
        idx = sel.topk(k, dim=1).indices
        w = x.gather(1, idx)
        if kw["renormalize"]:
            w = w / w.sum(dim=1, keepdim=True)
        return w * kw["scale"], idx

    return run


def _topk_reference(scores, top_k, **options):
    """The op is itself route's torch formula (``reference.routing`` calls it): the same
    function, on every device."""
    from moe_kernels.selection import topk_choices

    return topk_choices(scores, top_k, **options)


TOPK_CHOICES = OpSpec(
    name="topk_choices",
    sizes={
        "quick": [dict(T=512, E=16, k=4)],
        "full": [
            dict(T=65536, E=128, k=8),
            dict(
                T=65536,
                E=256,
                k=8,
                n_groups=8,
                topk_groups=4,
                bias=True,
                renormalize=True,
                scale=2.5,
                score_fn="sigmoid",
            ),  # fmt: skip
        ],
    },
    draw=_draw_topk,
    make=_make_topk,
    reference=_topk_reference,
    oracle=_topk_oracle,
    bytes_moved=lambda p: (
        p.args[0].numel() * p.args[0].element_size()
        + (p.args[0].shape[1] * 4 if p.kwargs["bias"] is not None else 0)
        + p.args[0].shape[0] * p.args[1] * (4 + 8)
    ),
    native=_topk_native,
)


# ----------------------------------------------------------------------------------------------
# plan_from_choices


def _make_choices(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    """Each token's k distinct experts (a framework's own top-k) and their softmax weights."""
    T, E, k = s["T"], s["E"], s["k"]
    weights_TK, experts_TK = torch.topk(softmax_scores(T, E, gen, device), k, dim=1)
    return Problem(f"T={T} E={E} k={k}", s, (experts_TK, weights_TK, E))


def _choices_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    experts_TK, weights_TK, E = p.args
    counts, offsets, exp_P, tok_P, w_P, inv_TK = (t.cpu() for t in out)
    choice = experts_TK.cpu()
    oe, ot = oracle_pairs(choice, E)
    expect_equal("oracle counts", counts.long(), torch.bincount(choice.flatten(), minlength=E))
    expect_equal("oracle offsets[1:]", offsets[1:].long(), torch.cumsum(counts.long(), 0))
    expect_equal("oracle experts", exp_P.long(), oe)
    expect_equal("oracle tokens", tok_P.long(), ot)
    expect_equal("oracle inverse->expert", exp_P.long()[inv_TK.long()], choice)
    expect_equal("oracle weights", w_P[inv_TK.long()], weights_TK.float().cpu())
    return 0.0


def _choices_native(p: Problem):
    """What a framework does by hand (transformers' grouped_mm experts): a sort of the expert
    ids, the weights gathered, counts by bincount."""
    experts_TK, weights_TK, E = p.args

    def run() -> tuple[torch.Tensor, ...]:
        flat = experts_TK.flatten()
        sorted_P, order_P = torch.sort(flat, stable=True)
        return (
            torch.bincount(flat, minlength=E),
            order_P // experts_TK.shape[1],
            sorted_P,
            (weights_TK.flatten()[order_P]),
        )

    return run


def _choices_reference(experts, weights, n_experts, **options):
    """The op is plain torch on every device: the same function."""
    from moe_kernels.choices_plan import plan_from_choices

    return plan_from_choices(experts, weights, n_experts, **options)


PLAN_FROM_CHOICES = OpSpec(
    name="plan_from_choices",
    sizes={"quick": [dict(T=512, E=16, k=4)], "full": [dict(T=65536, E=128, k=8)]},
    draw=_draw_route,
    make=_make_choices,
    reference=_choices_reference,
    oracle=_choices_oracle,
    bytes_moved=lambda p: p.args[0].numel() * (8 + 4 + 4 * 4) + (2 * p.args[2] + 1) * 4,
    native=_choices_native,
)

ENTRIES = (ROUTE, INDEX_SHUFFLING, TOPK_CHOICES, PLAN_FROM_CHOICES, ROUTER_SCORES)
