"""Expert-computation oracles: the grouped GEMMs (gathered or sorted rows, the K-grouped weight
gradient) in float64 one expert at a time, the expert MLP's rows in float64 with a bound of the
kernels' roundings, and the expert MLP / routed experts row by row (token by token) as torch
autograd formulas."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_kernels.testing.tolerance import ULP

__all__ = [
    "oracle_expert_mlp_formula",
    "oracle_expert_mlp_rows",
    "oracle_gather_grouped_mm",
    "oracle_grouped_weight_grad",
    "oracle_routed_experts_formula",
]


def _groups(offsets: torch.Tensor, rows: torch.Tensor | None, T: int):
    """Per expert e: (first, end, source rows (long, -1 where outside [0, T))) of its rows."""
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        start, end = bounds[e], max(bounds[e], bounds[e + 1])
        src = torch.arange(start, end) if rows is None else rows[start:end].long().cpu()
        yield e, start, end, torch.where((src >= 0) & (src < T), src, -1)


def oracle_gather_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """(P, N) float64 on the CPU of ``gather_grouped_mm(x (T, D), w (E, N, D), offsets (E+1,),
    rows (P,) or None (P = T, x already sorted), activation)``: y[p] = act(x[rows[p]] @ w[e].T),
    one expert and one row block at a time; rows past offsets[E] and rows whose source is
    outside [0, T) are zero."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    P = x.shape[0] if rows is None else rows.shape[0]
    exact = torch.zeros(P, w.shape[1], dtype=torch.float64)
    for e, start, end, src in _groups(offsets, rows, x.shape[0]):
        xs = torch.where((src >= 0)[:, None], x64[src.clamp(min=0)], 0.0)
        h = xs @ w64[e].T
        exact[start:end] = F.silu(h) if activation == "silu" else h
    return exact


def oracle_grouped_weight_grad(
    dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(E, N, D) float64 on the CPU of ``grouped_weight_grad(dy (P, N), x (T, D), offsets,
    rows)``: out[e] = sum over e's rows p of outer(dy[p], x[rows[p]]) (x[p] without rows),
    sources outside [0, T) skipped."""
    dy64, x64 = dy.double().cpu(), x.double().cpu()
    exact = torch.zeros(len(offsets) - 1, dy.shape[1], x.shape[1], dtype=torch.float64)
    for e, start, end, src in _groups(offsets, rows, x.shape[0]):
        xs = torch.where((src >= 0)[:, None], x64[src.clamp(min=0)], 0.0)
        exact[e] = dy64[start:end].T @ xs
    return exact


def _activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.silu(h)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def oracle_expert_mlp_rows(
    x, w_in, w_out, offsets, rows, gated
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) per grouped row in float64: y[r] = act(x[rows[r]] @ w_in[e].T) @
    w_out[e].T, row block by expert, rows past offsets[E] or reading no token zero; the bound:
    one rounding of y, plus the roundings of h and of the activation (one step of the dtype
    each, as the interpreter truncates) carried through the activation's slope and |w_out|,
    plus fp32 accumulation."""
    ulp = ULP[x.dtype]
    x64, wi, wo = x.double().cpu(), w_in.double().cpu(), w_out.double().cpu()
    exact = torch.zeros(rows.shape[0], w_out.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(exact)
    bounds, src_all = offsets.tolist(), rows.long().cpu()
    for e in range(len(bounds) - 1):
        start, end = bounds[e], max(bounds[e], bounds[e + 1])
        src = src_all[start:end]
        live = ((src >= 0) & (src < x.shape[0]))[:, None]
        xs = torch.where(live, x64[src.clamp(0, max(x.shape[0] - 1, 0))], 0.0)
        h = xs @ wi[e].T
        dh = ulp * h.abs() + 1e-5 * (xs.abs() @ wi[e].abs().T)
        a = _activation(h, gated)
        if gated:
            (g, u), (dg, du) = h.chunk(2, dim=-1), dh.chunk(2, dim=-1)
            da = ulp * a.abs() + 1.1 * u.abs() * dg + F.silu(g).abs() * du
        else:
            da = ulp * a.abs() + 1.1 * dh
        y = a @ wo[e].T
        exact[start:end] = y
        carried = (1.5 * da) @ wo[e].abs().T + 1e-5 * (a.abs() @ wo[e].abs().T)
        bound[start:end] = (ulp + 1e-6) * y.abs() + carried + 1e-30
    return exact, bound


def oracle_expert_mlp_formula(plan, gated: bool) -> Callable:
    """``fn(x (T, D), w_in (E, X, D), w_out (E, D, H))`` -> (P, D): ``expert_mlp``'s rows one at a
    time with torch autograd (pass float64 leaves): find the row's expert in ``plan.offsets``,
    gather x[token_indices[r]], two matmuls and SiLU (SwiGLU when ``gated``); rows outside the
    groups or reading token -1 zero."""
    bounds = [int(b) for b in plan.offsets]
    rows = [int(r) for r in plan.token_indices]
    E = len(bounds) - 1

    def fn(x, w_in, w_out):
        D, H = w_out.shape[1], w_out.shape[2]
        out = []
        for r, src in enumerate(rows):
            e = next((e for e in range(E) if bounds[e] <= r < bounds[e + 1]), None)
            if e is None or src < 0:
                out.append(x.new_zeros(D))
                continue
            h = w_in[e] @ x[src]
            a = F.silu(h[:H]) * h[H:] if gated else F.silu(h)
            out.append(w_out[e] @ a)
        return torch.stack(out)

    return fn


def oracle_routed_experts_formula(plan_of: Callable, gated: bool) -> Callable:
    """``fn(x (T, D), w_in, w_out, s (T, E))`` -> (T, D): ``routed_experts`` token by token with
    torch autograd (pass float64 leaves): each kept choice's expert MLP times its score s[t, e],
    the choices read from ``plan_of(s.detach().float())`` (the scores' gradient flows through
    the weights)."""
    plan = None

    def fn(x, w_in, w_out, s):
        nonlocal plan
        plan = plan_of(s.detach().float())
        T, K = plan.inverse.shape
        D, H = w_out.shape[1], w_out.shape[2]
        y = []
        for t in range(T):
            acc = x.new_zeros(D)
            for j in range(K):
                r = int(plan.inverse[t, j])
                if r < 0:
                    continue
                e = int(plan.expert_indices[r])
                h = w_in[e] @ x[t]
                a = F.silu(h[:H]) * h[H:] if gated else F.silu(h)
                acc = acc + s[t, e] * (w_out[e] @ a)
            y.append(acc)
        return torch.stack(y)

    return fn
