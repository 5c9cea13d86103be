"""Routing oracles: each token's choices by a Python sort (ties to the lower expert, NaN as
-inf, DeepSeek-V3's expert groups), the plans built from them by loops, the choices' weights one
float32 rounding at a time, and the router's scores in float64 with their logit error bound.

numpy is imported where a function needs it (``moe-bench verify`` runs the torch ones without
numpy).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from moe_kernels.routing import RoutingPlan

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "oracle_pairs",
    "oracle_route_plan",
    "oracle_router_scores",
    "oracle_selection_grad",
    "oracle_selection_plan",
    "oracle_token_plan",
    "oracle_topk_choices",
    "oracle_topk_weights",
]

U32 = 2.0**-24  # unit roundoff of fp32


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (a float64 sum of two fp32 values rounds to their fp32 sum)."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def oracle_topk_choices(
    scores_TE: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
) -> torch.Tensor:
    """(T, k) int64: each token's experts, a loop over the tokens. Selection values ``scores +
    bias`` (the contract's fp32 add; NaN as -inf); with ``topk_groups < n_groups`` each group's
    score the fp32 sum of its two largest values, the ``topk_groups`` best groups (ties to the
    lower group); then the k best of their experts (ties to the lower expert)."""
    T, E = scores_TE.shape
    topk_groups = n_groups if topk_groups is None else topk_groups
    size = E // n_groups
    sel = scores_TE.float().cpu()
    if bias is not None:
        sel = sel + bias.float().cpu()
    want = torch.empty(T, top_k, dtype=torch.int64)
    for t, row in enumerate(sel.tolist()):
        val = [float("-inf") if v != v else v for v in row]
        allowed = range(E)
        if topk_groups < n_groups:
            group_score = []
            for g in range(n_groups):
                top = sorted(val[g * size : (g + 1) * size], reverse=True)
                sc = _f32(top[0] + top[1]) if size > 1 else top[0]
                group_score.append(float("-inf") if sc != sc else sc)
            best = sorted(range(n_groups), key=lambda g, gs=group_score: (-gs[g], g))
            allowed = [
                e for g in sorted(best[:topk_groups]) for e in range(g * size, (g + 1) * size)
            ]
        want[t] = torch.tensor(sorted(allowed, key=lambda e, v=val: (-v[e], e))[:top_k])
    return want


def oracle_pairs(choice_TK: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every pair sorted by expert then token, via one scan per expert."""
    experts, tokens = [], []
    for e in range(E):
        toks = (choice_TK == e).any(dim=1).nonzero().flatten()
        experts.append(torch.full_like(toks, e))
        tokens.append(toks)
    return torch.cat(experts), torch.cat(tokens)


def oracle_route_plan(scores, top_k, start=None, end=None, valid=None, renormalize=False):
    """``route`` / ``index_shuffling`` of CPU ``scores`` (T, E) by Python loops over tokens, pairs
    sorted by Python's sort: a dict of numpy arrays counts, offsets, expert, token, weights,
    inverse (int64, weights float32; -1 / 0 past the pairs) and tcpe (index_shuffling's counts).
    Experts by descending fp32 score (NaN as -inf), ties to the lower expert; ``renormalize``:
    the weights over their fp32 sum added in choice order."""
    import numpy as np

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
            with np.errstate(all="ignore"):  # inf + -inf: NaN, as the kernels give
                s = np.float32(ws[0])
                for w in ws[1:]:
                    s = np.float32(s + np.float32(w))
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


def oracle_selection_plan(scores, top_k, bias=None, n_groups=1, topk_groups=None, scale=1.0,
                          renormalize=False, start=0, end=None, valid=None):  # fmt: skip
    """``route`` with its selection options (bias, expert groups, scale) of CPU ``scores``: the
    choices of ``oracle_topk_choices``, the unbiased fp32 weights (renormalised over their sum
    in choice order, then scaled, one fp32 rounding a step); the dict of ``oracle_route_plan``
    without tcpe."""
    import numpy as np

    x = scores.float().numpy()
    T, E = x.shape
    end = E if end is None else end
    L = end - start
    n_valid = T if valid is None else min(max(valid, 0), T)
    choices = oracle_topk_choices(scores, top_k, bias, n_groups, topk_groups or n_groups).tolist()
    pairs, where = [], {}
    weights = oracle_topk_weights(x, choices, renormalize, scale)
    for t, experts in enumerate(choices):
        for j, (e, w) in enumerate(zip(experts, weights[t], strict=True)):
            if t < n_valid and start <= e < end:
                pairs.append((e - start, t, w))
                where[(e - start, t)] = j
    pairs.sort(key=lambda p: (p[0], p[1]))
    P = T * top_k
    want = dict(
        expert=np.full(P, -1, np.int64), token=np.full(P, -1, np.int64),
        weights=np.zeros(P, np.float32), inverse=np.full((T, top_k), -1, np.int64),
        counts=np.zeros(L, np.int64),
    )  # fmt: skip
    for pos, (l, t, w) in enumerate(pairs):
        want["expert"][pos], want["token"][pos], want["weights"][pos] = l, t, w
        want["counts"][l] += 1
        want["inverse"][t, where[(l, t)]] = pos
    want["offsets"] = np.concatenate([[0], np.cumsum(want["counts"])]).astype(np.int64)
    return want


def oracle_topk_weights(x: np.ndarray, choices, renormalize: bool, scale: float) -> np.ndarray:
    """(T, k) float32: the choices' unbiased float32 scores ``x`` (T, E), divided by their sum
    (added in choice order), then times the scale, one float32 rounding per step."""
    import numpy as np

    out = []
    for t, experts in enumerate(choices):
        ws = [np.float32(x[t, e]) for e in experts]
        with np.errstate(all="ignore"):
            if renormalize:
                s = ws[0]
                for w in ws[1:]:
                    s = np.float32(s + w)
                ws = [np.float32(w / s) for w in ws]
            if scale != 1.0:
                ws = [np.float32(w * np.float32(scale)) for w in ws]
        out.append(ws)
    return np.array(out, dtype=np.float32).reshape(len(choices), -1)


def oracle_selection_grad(scores, k, bias, G, TG, scale, renorm, g_TK):
    """d sum(g * w) / d scores (T, E) fp32 by autograd of the naive weights (the choices of
    ``oracle_topk_choices``, their scores gathered, renormalised, scaled), and the (T, k)
    choices."""
    x = scores.detach().float().requires_grad_()
    choices = oracle_topk_choices(x.detach(), k, bias, G, TG or G)
    w = x.gather(1, choices)
    if renorm:
        w = w / w.sum(1, keepdim=True)
    (w * scale * g_TK).sum().backward()
    return x.grad, choices


def oracle_token_plan(scores_TE: torch.Tensor, k: int, start: int = 0, end: int | None = None):
    """A ``RoutingPlan`` by Python loops: top_k by descending score, ties to the lower expert;
    pairs with expert in [start, end) sorted by (expert, token), experts local (minus start);
    the tail of the P = T * k rows marked -1 (weight 0)."""
    num_tokens, num_experts = scores_TE.shape
    end = num_experts if end is None else end
    choices = []  # (expert, token, j, weight)
    for t in range(num_tokens):
        order = sorted(range(num_experts), key=lambda e, t=t: (-float(scores_TE[t, e]), e))
        for j, e in enumerate(order[:k]):
            choices.append((e, t, j, float(scores_TE[t, e])))
    n = num_tokens * k
    local = sorted(c for c in choices if start <= c[0] < end)
    tok, exp = torch.full((n,), -1, dtype=torch.int32), torch.full((n,), -1, dtype=torch.int32)
    w = torch.zeros(n)
    inv = torch.full((num_tokens, k), -1, dtype=torch.int32)
    counts = torch.zeros(end - start, dtype=torch.int32)
    for p, (e, t, j, wt) in enumerate(local):
        tok[p], exp[p], w[p], inv[t, j] = t, e - start, wt, p
        counts[e - start] += 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
    return RoutingPlan(counts, offsets, exp, tok, w, inv)


def oracle_router_scores(
    x: torch.Tensor, w: torch.Tensor, score_fn: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, logit error bound), float64 on the inputs' device: the logits ``x @ w.T`` of
    (T, D) x and (E, D) w, their softmax over the experts or sigmoid; any fp32 summation order of
    the D products moves a logit by at most the bound gamma_D * sum |x w| (gamma_D = D u /
    (1 - D u), u = 2**-24)."""
    x64, w64 = x.double(), w.double()
    logits = x64 @ w64.T
    D = x.shape[1]
    gamma = D * U32 / (1 - D * U32)
    bound = gamma * (x64.abs() @ w64.abs().T)
    exact = torch.softmax(logits, dim=-1) if score_fn == "softmax" else torch.sigmoid(logits)
    return exact, bound
