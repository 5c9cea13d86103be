"""Registry entries of the token-movement ops: ``dispatch``, ``combine``,
``gather_scale_dense_tokens``, ``scatter_add_dense_tokens``."""

from __future__ import annotations

import random

import torch

from moe_kernels.testing import oracle_combine_f64
from moe_tools.ops.spec import (
    BF16_ULP,
    CheckFailed,
    OpSpec,
    Problem,
    Sizes,
    expect_equal,
    randn,
    softmax_scores,
)

E_TOKENS = 16  # experts of the routing plan the token ops are measured with
TOKEN_SIZES = {"quick": [dict(T=512, k=4, D=256)], "full": [dict(T=65536, k=8, D=2048)]}


def _draw(rng: random.Random, large: bool) -> Sizes:
    return dict(
        T=rng.randint(1, 4096 if large else 96),
        E=rng.choice([8, 16]),
        k=rng.choice([1, 2, 4]),
        D=rng.choice([64, 256, 2048, 2050] if large else [32, 64, 130]),
        scale=rng.choice([False, True]),
    )


def _inputs(s: Sizes, gen: torch.Generator, device: torch.device):
    """(label, scores (T, E) bf16, x (T, D) bf16): the routing scores and the tokens."""
    T, k, D, E = s["T"], s["k"], s["D"], s.get("E", E_TOKENS)
    scores = softmax_scores(T, E, gen, device)
    x = randn((T, D), gen, device, torch.bfloat16)
    return f"T={T} k={k} D={D}", scores, x


def _plan(scores: torch.Tensor, k: int):
    import moe_kernels

    return moe_kernels.route(scores, k)


def _shuffled(scores: torch.Tensor, k: int):
    import moe_kernels

    return moe_kernels.index_shuffling(scores, top_k=k)


# ----------------------------------------------------------------------------------------------
# dispatch


def _make_dispatch(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, scores, x = _inputs(s, gen, device)
    scale = bool(s.get("scale", False))
    return Problem(
        label + (" scaled" if scale else ""), s, (x, _plan(scores, s["k"])), {"scale": scale}
    )


def _dispatch_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    (x, plan), scale = p.args, p.kwargs["scale"]
    tok = plan.token_indices.long().cpu()
    rows = x.double().cpu()[tok.clamp(min=0)]
    if scale:
        rows = rows * plan.weights.double().cpu()[:, None]
    rows[tok < 0] = 0
    return expect_equal(
        "vs oracle", out[0], rows, rel=BF16_ULP
    )  # one rounding (a truncation in the interpreter)


def _dispatch_native(p: Problem):
    (x, plan), scale = p.args, p.kwargs["scale"]
    tok, w = plan.token_indices.long().clamp(min=0), plan.weights
    if scale:
        return lambda: (x.index_select(0, tok).float() * w[:, None]).to(x.dtype)
    return lambda: x.index_select(0, tok)


def _dispatch_reference(x, plan, scale=False):
    from moe_kernels.reference import tokens

    return tokens.dispatch(x, plan.token_indices, plan.weights, scale)


def _rows_bytes(p: Problem) -> int:
    """Bytes of the T*k gathered rows."""
    return p.sizes["T"] * p.sizes["k"] * p.sizes["D"] * 2


DISPATCH = OpSpec(
    name="dispatch",
    sizes=TOKEN_SIZES,
    draw=_draw,
    make=_make_dispatch,
    reference=_dispatch_reference,
    oracle=_dispatch_oracle,
    bytes_moved=lambda p: 2 * _rows_bytes(p) + p.sizes["T"] * p.sizes["k"] * 4,
    native=_dispatch_native,
)


# ----------------------------------------------------------------------------------------------
# combine


def _make_combine(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, scores, _ = _inputs(s, gen, device)
    y = randn((s["T"] * s["k"], s["D"]), gen, device, torch.bfloat16)
    return Problem(label, s, (y, _plan(scores, s["k"])))


def _combine_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """A naive loop over the pairs in float64 (``oracle_combine_f64``); fp32 accumulation then
    one bf16 rounding stays within 2 bf16 steps of the exact sum."""
    y, plan = p.args
    want = oracle_combine_f64(y, plan.token_indices, plan.weights, plan.inverse.shape[0])
    err = (out[0].cpu().double() - want).abs()
    worst = float(err.max()) if err.numel() else 0.0
    if bool((err > 2 * BF16_ULP * want.abs() + 1e-6).any()):
        raise CheckFailed(f"vs oracle: max error {worst:.3g}")
    return worst


def _combine_native(p: Problem):
    y, plan = p.args
    T, D = plan.inverse.shape[0], y.shape[1]
    tok, w = plan.token_indices.long().clamp(min=0), plan.weights

    def index_add() -> torch.Tensor:
        acc = torch.zeros(T, D, device=y.device, dtype=torch.float32)
        return acc.index_add_(0, tok, y.float() * w[:, None]).to(y.dtype)

    return index_add


def _combine_reference(y, plan, weighted=True, out_dtype=None):
    from moe_kernels.reference import tokens

    return tokens.combine(y, plan.inverse, plan.weights, weighted, out_dtype or y.dtype)


COMBINE = OpSpec(
    name="combine",
    sizes=TOKEN_SIZES,
    draw=_draw,
    make=_make_combine,
    reference=_combine_reference,
    oracle=_combine_oracle,
    bytes_moved=lambda p: (
        _rows_bytes(p) + p.sizes["T"] * p.sizes["D"] * 2 + p.sizes["T"] * p.sizes["k"] * 8
    ),
    native=_combine_native,
)


# ----------------------------------------------------------------------------------------------
# gather_scale_dense_tokens


def _make_gather(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, scores, x = _inputs(s, gen, device)
    _, expert_idx, token_idx = _shuffled(scores, s["k"])
    return Problem(label, s, (x, token_idx, expert_idx, scores))


def _gather_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    x, tok_i, exp_i, scores = p.args
    tok, ex = tok_i.long().cpu(), exp_i.long().cpu()
    live = tok >= 0
    want = (
        x.cpu().double()[tok.clamp(min=0)]
        * scores.cpu().double()[tok.clamp(min=0), ex.clamp(min=0)][:, None]
    )
    want[~live] = 0
    return expect_equal("vs oracle", out[0], want, rel=BF16_ULP)


def _gather_native(p: Problem):
    x, tok_i, exp_i, scores = p.args
    tok, ex = tok_i.long().clamp(min=0), exp_i.long().clamp(min=0)
    return lambda: x.index_select(0, tok) * scores[tok, ex][:, None]


def _gather_reference(x, token_indices, expert_indices, scores, valid_token_count=None):
    from moe_kernels.reference import tokens

    return tokens.gather_scale_dense_tokens(
        x, token_indices, expert_indices, scores, valid_token_count
    )


GATHER_SCALE_DENSE_TOKENS = OpSpec(
    name="gather_scale_dense_tokens",
    sizes=TOKEN_SIZES,
    draw=_draw,
    make=_make_gather,
    reference=_gather_reference,
    oracle=_gather_oracle,
    bytes_moved=lambda p: 2 * _rows_bytes(p) + p.sizes["T"] * p.sizes["k"] * 12,
    native=_gather_native,
    fbgemm=lambda ops, p: lambda: ops.gather_scale_dense_tokens(*p.args),
)


# ----------------------------------------------------------------------------------------------
# scatter_add_dense_tokens


def _make_scatter(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, scores, _ = _inputs(s, gen, device)
    _, _, token_idx = _shuffled(scores, s["k"])
    y = randn((s["T"] * s["k"], s["D"]), gen, device, torch.bfloat16)
    out = randn((s["T"], s["D"]), gen, device, torch.float32)
    return Problem(label + " bf16->fp32", s, (out, y, token_idx))


def _scatter_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    base, y, tok_i = p.args
    want = base.double().cpu().index_add_(0, tok_i.long().cpu().clamp(min=0), y.double().cpu())
    err = (out[0].cpu().double() - want).abs()
    worst = float(err.max()) if err.numel() else 0.0
    if bool((err > 1e-5 * (want.abs() + 1.0)).any()):
        raise CheckFailed(f"vs oracle: max error {worst:.3g}")
    return worst


def _scatter_native(p: Problem):
    out, y, tok_i = p.args
    tok = tok_i.long().clamp(min=0)
    return lambda: out.index_add_(0, tok, y.float())


def _scatter_reference(out_tokens, in_tokens, token_indices, valid_token_count=None):
    from moe_kernels.reference import tokens

    tokens.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)


SCATTER_ADD_DENSE_TOKENS = OpSpec(
    name="scatter_add_dense_tokens",
    sizes=TOKEN_SIZES,
    draw=_draw,
    make=_make_scatter,
    reference=_scatter_reference,
    oracle=_scatter_oracle,
    bytes_moved=lambda p: (
        _rows_bytes(p) + 2 * p.sizes["T"] * p.sizes["D"] * 4 + p.sizes["T"] * p.sizes["k"] * 4
    ),
    native=_scatter_native,
    fbgemm=lambda ops, p: lambda: ops.scatter_add_dense_tokens(*p.args),
    mutates=(0,),
)

ENTRIES = (DISPATCH, COMBINE, GATHER_SCALE_DENSE_TOKENS, SCATTER_ADD_DENSE_TOKENS)
