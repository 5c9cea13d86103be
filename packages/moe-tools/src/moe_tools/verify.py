"""``moe-bench verify``: every moe-kernels op on random shapes against (a) its torch reference
twin in ``moe_kernels._reference`` and (b) an independent naive oracle written here, plus a
determinism check (two calls, bitwise equal); and every MoE implementation against the baseline.

On CUDA the public ops run their Triton kernels, so (a) checks kernel == reference bit for bit.
On CPU they run the reference (or the Triton kernels in the interpreter when
``TRITON_INTERPRET=1``, where bf16 stores may be 1 ulp off and fp8 casts one e4m3 step off, as
documented in the interpreter notes), so (b) is what gives the CPU run its meaning.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_tools import report
from moe_tools.report import Result, Row, short_error
from moe_tools.timing import default_device

COLUMNS = ["check", "shape", "vs_reference", "vs_oracle", "deterministic", "status"]
CHECKS = (
    "route",
    "index_shuffling",
    "dispatch",
    "gather_scale",
    "combine",
    "scatter_add",
    "to_blocked",
    "blocked_2d",
    "blocked_3d",
    "to_mxfp8",
    "to_mxfp8_dim1",
    "from_mxfp8",
    "moe",
)


class CheckFailed(AssertionError):
    """A comparison did not hold; the message says which and by how much."""


@dataclass
class Ctx:
    device: torch.device
    gen: torch.Generator
    rng: random.Random
    big: bool  # CUDA: larger shapes
    interp: bool  # Triton interpreter on CPU: 1-ulp bf16 / 1-step fp8 slack vs the reference
    shape: str = "-"  # set by each check as soon as it has drawn its shape


# ----------------------------------------------------------------------------------------------
# comparisons (each returns the max abs difference, raising CheckFailed beyond the tolerance)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def expect_equal(name: str, got: torch.Tensor, want: torch.Tensor, *, rel: float = 0.0) -> float:
    """Same shape, and |got - want| <= rel * |want| elementwise (rel=0: bitwise-equal values;
    NaNs must sit in the same places)."""
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        got, want = got.float(), want.float()
    g, w = got.double(), want.double()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        raise CheckFailed(f"{name}: NaN positions differ")
    g, w = torch.where(nan_g, 0.0, g), torch.where(nan_w, 0.0, w)
    diff = (g - w).abs()
    bad = diff > rel * w.abs()
    if bool(bad.any()):
        n = int(bad.sum())
        raise CheckFailed(f"{name}: {n} of {bad.numel()} differ (max {float(diff.max()):.3g})")
    return float(diff.max()) if diff.numel() else 0.0


BF16_ULP = 2.0**-7  # relative size of one bf16 step (upper bound, normal numbers)
E4M3_STEP = 2.0**-3


def _ref_rel(ctx: Ctx, dtype: torch.dtype) -> float:
    """Slack of the kernel vs its reference: none, except the interpreter's documented rounding."""
    if not ctx.interp:
        return 0.0
    return {torch.bfloat16: BF16_ULP, torch.float8_e4m3fn: E4M3_STEP}.get(dtype, 0.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of the same width (bitwise comparison, NaN == NaN)."""
    if not t.is_floating_point():
        return t
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _twice(
    fn: Callable[[], Any], specified: Callable[[Any], Sequence[torch.Tensor]] | None = None
) -> tuple[Any, bool]:
    """Call twice; True when every output tensor (or the ``specified`` part of the outputs, where
    the contract leaves the rest unwritten) is bitwise identical."""
    a, b = fn(), fn()
    if specified is not None:
        ta, tb = specified(a), specified(b)
    else:
        ta = a if isinstance(a, (tuple, list)) else (a,)
        tb = b if isinstance(b, (tuple, list)) else (b,)
    same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(ta, tb, strict=True))
    return a, same


# ----------------------------------------------------------------------------------------------
# oracles (plain loops and simple torch, independent of moe_kernels._reference)


def oracle_choices(scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T, k) int64 experts by descending score, ties to the lower expert (fp32 values)."""
    x = scores_TE.float().cpu()
    T, E = x.shape
    out = torch.empty(T, top_k, dtype=torch.int64)
    for t in range(T):
        row = x[t].tolist()
        out[t] = torch.tensor(sorted(range(E), key=lambda e, r=row: (-r[e], e))[:top_k])
    return out


def oracle_pairs(choice_TK: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every pair sorted by expert then token, via one scan per expert."""
    experts, tokens = [], []
    for e in range(E):
        toks = (choice_TK == e).any(dim=1).nonzero().flatten()
        experts.append(torch.full_like(toks, e))
        tokens.append(toks)
    return torch.cat(experts), torch.cat(tokens)


def oracle_blocked(scale_RC: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scaling layout by its definition: 128x4 tiles in row-major tile order, inside
    a tile byte (r, c) at offset (r % 32) * 16 + (r // 32) * 4 + c; zero padding."""
    R, C = scale_RC.shape
    Rp, Cp = -(-R // 128) * 128, -(-C // 4) * 4
    src = scale_RC.view(torch.uint8).cpu()
    out = torch.zeros(Rp * Cp, dtype=torch.uint8)
    r = torch.arange(R)[:, None].expand(R, C)
    c = torch.arange(C)[None, :].expand(R, C)
    tile = (r // 128) * (Cp // 4) + c // 4
    rr, cc = r % 128, c % 4
    out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = src
    return out.view(Rp, Cp)


def oracle_mxfp8_scale(x_MK: torch.Tensor) -> torch.Tensor:
    """(M, K/32) uint8 biased exponents: the smallest e with 2**e >= amax / 448 (rceil), in fp64."""
    M, K = x_MK.shape
    amax = x_MK.double().abs().reshape(M, K // 32, 32).amax(-1)
    e = torch.ceil(torch.log2(amax / 448.0))
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# checks: each records its shape in ctx.shape and returns (max diff vs the reference, max diff
# vs the oracle, deterministic); a failed comparison raises CheckFailed


def _scores(ctx: Ctx, T: int, E: int) -> torch.Tensor:
    logits = torch.randn(T, E, generator=ctx.gen)
    return logits.softmax(-1).to(device=ctx.device, dtype=torch.bfloat16)


def _route_shape(ctx: Ctx) -> tuple[int, int, int]:
    E = ctx.rng.choice([4, 16, 33, 128] if ctx.big else [4, 8, 16])
    k = ctx.rng.choice([k for k in (1, 2, 4, 8) if k <= E])
    T = ctx.rng.randint(1, 2048 if ctx.big else 200)
    ctx.shape = f"T={T} E={E} k={k}"
    return T, E, k


def check_route(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.routing as R
    from moe_kernels._reference.routing import route_reference

    T, E, k = _route_shape(ctx)
    s = _scores(ctx, T, E)
    plan, det = _twice(lambda: tuple(R.route(s, k)))
    ref = route_reference(s, k, None, 0, E, False)
    for name, got, want in zip(
        ("counts", "offsets", "expert_indices", "token_indices", "weights", "inverse"),
        plan,
        ref,
        strict=True,
    ):
        expect_equal(name, got, want)
    counts, offsets, exp_P, tok_P, w_P, inv_TK = (t.cpu() for t in plan)
    choice = oracle_choices(s, k)
    oe, ot = oracle_pairs(choice, E)
    expect_equal("oracle counts", counts.long(), torch.bincount(choice.flatten(), minlength=E))
    expect_equal("oracle offsets[1:]", offsets[1:].long(), torch.cumsum(counts.long(), 0))
    expect_equal("oracle experts", exp_P.long(), oe)
    expect_equal("oracle tokens", tok_P.long(), ot)
    expect_equal("oracle weights", w_P, s.float().cpu()[ot, oe])
    expect_equal(
        "oracle inverse->token", tok_P.long()[inv_TK.long()], torch.arange(T)[:, None].expand(T, k)
    )
    expect_equal("oracle inverse->expert", exp_P.long()[inv_TK.long()], choice)
    return 0.0, 0.0, det


def check_index_shuffling(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.routing as R
    from moe_kernels._reference.routing import index_shuffling_reference

    T, E, k = _route_shape(ctx)
    s = _scores(ctx, T, E)
    out, det = _twice(lambda: R.index_shuffling(s, top_k=k))
    for name, got, want in zip(
        ("counts", "expert_indices", "token_indices"),
        out,
        index_shuffling_reference(s, 0, E, None, k),
        strict=True,
    ):
        expect_equal(name, got, want)
    counts, exp_P, tok_P = (t.cpu().long() for t in out)
    choice = oracle_choices(s, k)
    oe, ot = oracle_pairs(choice, E)
    want_counts = torch.cat(
        [torch.bincount(choice.flatten(), minlength=E), torch.tensor([T, T * k])]
    )
    expect_equal("oracle counts", counts, want_counts)
    expect_equal("oracle experts", exp_P, oe)
    expect_equal("oracle tokens", tok_P, ot)
    return 0.0, 0.0, det


def _token_inputs(ctx: Ctx) -> tuple[int, int, int, int, Any, torch.Tensor, torch.Tensor]:
    import moe_kernels.routing as R

    T = ctx.rng.randint(1, 4096 if ctx.big else 96)
    E = ctx.rng.choice([8, 16])
    k = ctx.rng.choice([1, 2, 4])
    D = ctx.rng.choice([64, 256, 2048, 2050] if ctx.big else [32, 64, 130])
    ctx.shape = f"T={T} k={k} D={D}"
    s = _scores(ctx, T, E)
    x = torch.randn(T, D, generator=ctx.gen).to(device=ctx.device, dtype=torch.bfloat16)
    return T, E, k, D, R.route(s, k), s, x


def check_dispatch(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.tokens as Tk
    from moe_kernels._reference import tokens as ref

    T, E, k, D, plan, _, x = _token_inputs(ctx)
    out, det = _twice(lambda: Tk.dispatch(x, plan, scale=True))
    r = expect_equal(
        "vs reference",
        out,
        ref.dispatch(x, plan.token_indices, plan.weights, True),
        rel=_ref_rel(ctx, x.dtype),
    )
    tok = plan.token_indices.long().cpu()
    want = (x.float().cpu()[tok.clamp(min=0)] * plan.weights.cpu()[:, None]).to(x.dtype)
    want[tok < 0] = 0
    o = expect_equal("vs oracle", out.cpu(), want, rel=BF16_ULP)
    return r, o, det


def check_gather_scale(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.routing as R
    import moe_kernels.tokens as Tk
    from moe_kernels._reference import tokens as ref

    T, E, k, D, _, s, x = _token_inputs(ctx)
    _, exp_i, tok_i = R.index_shuffling(s, top_k=k)
    out, det = _twice(lambda: Tk.gather_scale_dense_tokens(x, tok_i, exp_i, s))
    r = expect_equal(
        "vs reference",
        out,
        ref.gather_scale_dense_tokens(x, tok_i, exp_i, s),
        rel=_ref_rel(ctx, x.dtype),
    )
    tok, ex = tok_i.long().cpu(), exp_i.long().cpu()
    want = x.cpu().double()[tok] * s.cpu().double()[tok, ex][:, None]
    o = expect_equal("vs oracle", out.cpu(), want, rel=BF16_ULP)
    return r, o, det


def check_combine(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.tokens as Tk
    from moe_kernels._reference import tokens as ref

    T, E, k, D, plan, _, _ = _token_inputs(ctx)
    y = torch.randn(T * k, D, generator=ctx.gen).to(device=ctx.device, dtype=torch.bfloat16)
    out, det = _twice(lambda: Tk.combine(y, plan))
    r = expect_equal(
        "vs reference",
        out,
        ref.combine(y, plan.inverse, plan.weights, True, y.dtype),
        rel=_ref_rel(ctx, y.dtype),
    )
    want = torch.zeros(T, D, dtype=torch.float64)
    tok, w = plan.token_indices.long().cpu(), plan.weights.double().cpu()
    yd = y.double().cpu()
    for p in range(T * k):  # naive: one pair at a time, fp64
        want[tok[p]] += w[p] * yd[p]
    # fp32 accumulation then one bf16 rounding: within 2 bf16 steps of the exact sum
    err = (out.cpu().double() - want).abs()
    o = float(err.max()) if err.numel() else 0.0
    if bool((err > 2 * BF16_ULP * want.abs() + 1e-6).any()):
        raise CheckFailed(f"vs oracle: max error {o:.3g}")
    return r, o, det


def check_scatter_add(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.routing as R
    import moe_kernels.tokens as Tk
    from moe_kernels._reference import tokens as ref

    T, E, k, D, _, s, _ = _token_inputs(ctx)
    _, _, tok_i = R.index_shuffling(s, top_k=k)
    ctx.shape += " bf16->fp32"
    y = torch.randn(T * k, D, generator=ctx.gen).to(device=ctx.device, dtype=torch.bfloat16)
    base = torch.randn(T, D, generator=ctx.gen).to(ctx.device)

    def run() -> torch.Tensor:
        out = base.clone()
        Tk.scatter_add_dense_tokens(out, y, tok_i)
        return out

    out, det = _twice(run)
    want_ref = base.clone()
    ref.scatter_add_dense_tokens(want_ref, y, tok_i)
    r = expect_equal("vs reference", out, want_ref)
    want = base.double().cpu().index_add_(0, tok_i.long().cpu(), y.double().cpu())
    err = (out.cpu().double() - want).abs()
    o = float(err.max()) if err.numel() else 0.0
    if bool((err > 1e-5 * (want.abs() + 1.0)).any()):
        raise CheckFailed(f"vs oracle: max error {o:.3g}")
    return r, o, det


def check_to_blocked(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    R_ = ctx.rng.randint(1, 20000 if ctx.big else 400)
    C = ctx.rng.randint(1, 260 if ctx.big else 70)
    ctx.shape = f"({R_},{C})"
    s = torch.randint(0, 256, (R_, C), generator=ctx.gen, dtype=torch.uint8).to(ctx.device)
    out, det = _twice(lambda: M.to_blocked(s))
    r = expect_equal("vs reference", out, ref.to_blocked(s))
    expect_equal("vs oracle", out.view(torch.uint8).cpu(), oracle_blocked(s.cpu()))
    return r, 0.0, det


def check_blocked_2d(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    R_ = ctx.rng.randint(1, 20000 if ctx.big else 700)
    C = ctx.rng.randint(1, 260 if ctx.big else 70)
    G = ctx.rng.randint(1, 16)
    ctx.shape = f"({R_},{C}) G={G}"
    ends = sorted(ctx.rng.randint(0, R_) for _ in range(G - 1)) + [R_]
    ends_t = torch.tensor(ends, dtype=torch.int32, device=ctx.device)
    s = torch.randint(0, 256, (R_, C), generator=ctx.gen, dtype=torch.uint8).to(ctx.device)
    (out, start_rows), det = _twice(
        lambda: M.to_blocked_per_group_2d(s, ends_t),
        specified=lambda o: (o[0][: int(o[1][-1])], o[1]),  # rows past start_rows[G]: unwritten
    )
    want, want_start = ref.to_blocked_per_group_2d(s, ends_t)
    expect_equal("start_rows", start_rows, want_start)
    used = int(want_start[-1])
    r = expect_equal("vs reference", out[:used], want[:used])
    # oracle: each group alone through the tile definition, stacked at 128-row boundaries
    o_start, o_parts, begin = [0], [], 0
    for end in ends:
        part = oracle_blocked(s[begin:end].cpu()) if end > begin else torch.zeros(0, 1)
        if end > begin:
            o_parts.append(part)
        o_start.append(o_start[-1] + (part.shape[0] if end > begin else 0))
        begin = end
    expect_equal("oracle start_rows", start_rows.cpu().long(), torch.tensor(o_start))
    if o_parts:
        expect_equal("vs oracle", out[:used].view(torch.uint8).cpu(), torch.cat(o_parts))
    return r, 0.0, det


def check_blocked_3d(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    E = ctx.rng.randint(1, 8)
    N = ctx.rng.randint(1, 4096 if ctx.big else 300)
    C = ctx.rng.randint(1, 224 if ctx.big else 40)
    ctx.shape = f"({E},{N},{C})"
    s = torch.randint(0, 256, (E, N, C), generator=ctx.gen, dtype=torch.uint8).to(ctx.device)
    out, det = _twice(lambda: M.to_blocked_per_group_3d(s))
    r = expect_equal("vs reference", out, ref.to_blocked_per_group_3d(s))
    want = torch.stack([oracle_blocked(s[e].cpu()).flatten() for e in range(E)])
    expect_equal("vs oracle", out.view(torch.uint8).cpu(), want)
    return r, 0.0, det


def _check_quant(ctx: Ctx, dim1: bool) -> tuple[float, float, bool]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    m = 32 * ctx.rng.randint(1, 64 if ctx.big else 8)
    k = 32 * ctx.rng.randint(1, 64 if ctx.big else 8)
    ctx.shape = f"({m},{k}) bf16"
    x = (torch.randn(m, k, generator=ctx.gen) * 10 ** ctx.rng.uniform(-3, 3)).to(
        device=ctx.device, dtype=torch.bfloat16
    )
    fn = M.to_mxfp8_dim1 if dim1 else M.to_mxfp8
    (data, scale), det = _twice(lambda: fn(x))
    want_d, want_s = (ref.to_mxfp8_dim1 if dim1 else ref.to_mxfp8)(x)
    expect_equal("scale vs reference", scale.view(torch.uint8), want_s.view(torch.uint8))
    r = expect_equal("data vs reference", data, want_d, rel=_ref_rel(ctx, torch.float8_e4m3fn))
    xr = (x.t() if dim1 else x).cpu().float().contiguous()
    expect_equal("scale vs oracle", scale.view(torch.uint8).cpu(), oracle_mxfp8_scale(xr))
    deq = (
        data.cpu().float().reshape(xr.shape[0], -1, 32)
        * torch.exp2(scale.view(torch.uint8).cpu().double() - 127).float()[..., None]
    )
    amax = xr.abs().reshape(xr.shape[0], -1, 32).amax(-1, keepdim=True)
    err = (deq - xr.reshape(deq.shape)).abs()
    if bool((err > amax / 16).any()):  # 3 mantissa bits: half a step <= amax / 16
        raise CheckFailed(f"vs oracle: dequantised error {float(err.max()):.3g} > amax/16")
    return r, float((err / amax.clamp(min=1e-30)).max()), det


def check_to_mxfp8(ctx: Ctx) -> tuple[float, float, bool]:
    return _check_quant(ctx, dim1=False)


def check_to_mxfp8_dim1(ctx: Ctx) -> tuple[float, float, bool]:
    return _check_quant(ctx, dim1=True)


def check_from_mxfp8(ctx: Ctx) -> tuple[float, float, bool]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    m = 32 * ctx.rng.randint(1, 64 if ctx.big else 8)
    k = 32 * ctx.rng.randint(1, 64 if ctx.big else 8)
    ctx.shape = f"({m},{k}) -> bf16"
    data = torch.randint(0, 256, (m, k), generator=ctx.gen, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0  # no e4m3 NaN codes in the data
    scale = torch.randint(100, 155, (m, k // 32), generator=ctx.gen, dtype=torch.uint8)
    data_d = data.to(ctx.device).view(torch.float8_e4m3fn)
    scale_d = scale.to(ctx.device).view(torch.float8_e8m0fnu)
    out, det = _twice(lambda: M.from_mxfp8(data_d, scale_d, torch.bfloat16))
    r = expect_equal(
        "vs reference",
        out,
        ref.from_mxfp8(data_d, scale_d, torch.bfloat16),
        rel=_ref_rel(ctx, torch.bfloat16),
    )
    # oracle: the e4m3 value by its bit fields, times 2**(byte - 127), in fp64
    bits = data.long()
    sign = 1 - 2 * (bits >> 7)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    val = torch.where(exp > 0, (1 + man / 8.0) * torch.exp2(exp.double() - 7), man / 8.0 * 2.0**-6)
    want = sign * val * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
    o = expect_equal("vs oracle", out.cpu(), want, rel=2.0**-8)  # one bf16 rounding
    return r, o, det


KERNEL_CHECKS: dict[str, Callable[[Ctx], tuple[float, float, bool]]] = {
    "route": check_route,
    "index_shuffling": check_index_shuffling,
    "dispatch": check_dispatch,
    "gather_scale": check_gather_scale,
    "combine": check_combine,
    "scatter_add": check_scatter_add,
    "to_blocked": check_to_blocked,
    "blocked_2d": check_blocked_2d,
    "blocked_3d": check_blocked_3d,
    "to_mxfp8": check_to_mxfp8,
    "to_mxfp8_dim1": check_to_mxfp8_dim1,
    "from_mxfp8": check_from_mxfp8,
}


# ----------------------------------------------------------------------------------------------
# MoE implementations vs the baseline


def moe_rows(ctx: Ctx) -> list[Row]:
    """Every MoELayer impl on one layer and input vs the baseline: relative max error."""
    try:
        from moe_model import MOE_IMPLS
        from moe_tools.matrix import build_layer
    except Exception as exc:
        return [_row("moe", "-", status=f"unavailable: {short_error(exc)}")]
    cuda = ctx.device.type == "cuda"
    d, E, k, h, T = (512, 16, 4, 256, 512) if cuda else (64, 8, 2, 32, 48)
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    # mxfp8: e4m3 data, ~2^-4 relative per element; triton_bf16: its combine writes bf16
    tolerances = {"mxfp8": 0.1, "triton_bf16": 1e-2}
    shape = f"T={T} d={d} E={E} k={k} h={h} {str(dtype).removeprefix('torch.')}"
    sizes = dict(
        d_model=d,
        n_experts=E,
        top_k=k,
        hidden=h,
        gated=False,
        score_fn="softmax",
        renormalize=False,
    )
    layer = build_layer(sizes, ctx.device, dtype, seed=ctx.rng.randint(0, 2**31 - 1))
    x = torch.randn(T, d, generator=ctx.gen).to(device=ctx.device, dtype=dtype)
    rows = []
    with torch.no_grad():
        y_base = layer(x).double()
        scale = float(y_base.abs().max()) or 1.0
        for impl in MOE_IMPLS:
            if impl == "baseline":
                continue
            try:
                layer.impl = impl
                y, det = _twice(lambda: layer(x))
            except Exception as exc:
                rows.append(_row(f"moe:{impl}", shape, status=f"unavailable: {short_error(exc)}"))
                continue
            err = float((y.double() - y_base).abs().max()) / scale
            tol = tolerances.get(impl, tol)
            ok = err <= tol and det
            status = (
                "pass"
                if ok
                else (
                    f"FAIL: rel error {err:.3g} > {tol:g}"
                    if err > tol
                    else "FAIL: not deterministic"
                )
            )
            rows.append(_row(f"moe:{impl}", shape, vs_oracle=err, deterministic=det, status=status))
    return rows


def _row(check: str, shape: str, **kw: Any) -> Row:
    row: Row = {c: None for c in COLUMNS}
    row.update(check=check, shape=shape, **kw)
    return row


def run(
    *,
    device: torch.device | str | None = None,
    shapes: int | None = None,
    ops: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Result:
    """Rows of pass/FAIL/unavailable; ``extra["failed"]`` counts the failures."""
    from moe_kernels import _dispatch

    device = torch.device(device) if device is not None else default_device()
    if ops is not None:
        unknown = sorted(set(ops) - set(CHECKS))
        if unknown:
            raise ValueError(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    cuda = device.type == "cuda"
    shapes = shapes or (8 if cuda else 3)
    ctx = Ctx(
        device,
        torch.Generator().manual_seed(seed),
        random.Random(seed),
        big=cuda,
        interp=device.type == "cpu" and _dispatch.use_triton(device),
    )
    names = [n for n in KERNEL_CHECKS if ops is None or n in ops]
    rows: list[Row] = []
    jobs = [(n, i) for n in names for i in range(shapes)]
    for name, _ in report.progress(jobs, enabled=progress, desc="verify", unit="check"):
        ctx.shape = "-"
        try:
            r, o, det = KERNEL_CHECKS[name](ctx)
        except (ImportError, AttributeError) as exc:
            rows.append(_row(name, "-", status=f"unavailable: {short_error(exc)}"))
            continue
        except CheckFailed as exc:
            rows.append(_row(name, ctx.shape, status=f"FAIL: {exc}"))
            continue
        except Exception as exc:
            rows.append(_row(name, ctx.shape, status=f"FAIL: {short_error(exc)}"))
            continue
        rows.append(
            _row(
                name,
                ctx.shape,
                vs_reference=r,
                vs_oracle=o,
                deterministic=det,
                status="pass" if det else "FAIL: not deterministic",
            )
        )
    if ops is None or "moe" in ops:
        rows.extend(moe_rows(ctx))
    failed = sum(str(r["status"]).startswith("FAIL") for r in rows)
    passed = sum(r["status"] == "pass" for r in rows)
    extra = {
        "failed": failed,
        "passed": passed,
        "interpreter": ctx.interp,
        "notes": [f"{passed} passed, {failed} failed, {len(rows) - passed - failed} unavailable"],
    }
    return Result("verify", rows, COLUMNS, extra)
