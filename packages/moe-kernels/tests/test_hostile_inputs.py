"""Hostile offsets, indices, slots and counts (contract violations that live in device tensors
and so are never checked: no host sync) fed to the token movement ops, the grouped GEMMs (the
gathering, persistent and K-grouped kernels, the grouped GEMV, CUTLASS on CUDA), the expert MLP,
the routed experts, RoPE's cache write, the router, the activation, the FP8 gather and the
routing.

Each case checks, on the path this session runs (the torch reference with TRITON_INTERPRET=0,
the Triton kernels in the interpreter with TRITON_INTERPRET=1, CUDA in the ``gpu`` tests):

* no crash, and every input (a ``moe_kernels.testing.guarded`` copy) and every output the
  kernel modules allocate (``torch.empty`` there made guarded) keeps its guard bytes: no store
  outside a tensor; a stray read would bring guard bytes into the results, which the next
  checks see;
* the documented rule: the result equals the op's result on the sanitised inputs (the rule
  applied here in plain Python: an index outside its range is -1, a slot outside [0, S)
  writes nothing, offsets clamped by ``group_bounds``' running maximum);
* where the kernels run: the result equals the reference path's (``use_triton`` patched off)
  on the same hostile inputs (bit for bit for the data movement, within the GEMMs' summation
  order elsewhere).

The known findings of issue 45 have their own tests: ``test_zero_experts_*`` (the Triton path
raised IndexError), ``test_rope_skips_out_of_range_slots`` (the reference raised IndexError)
and ``test_routed_experts_errors_name_the_callers_arguments``.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
import moe_kernels._gemm_plan as plan_mod
from moe_kernels._dispatch import triton_kernels, use_triton
from moe_kernels._routing_outputs import RoutingPlan
from moe_kernels.testing import GuardHarness

CPU = torch.device("cpu")
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
# the kernel modules whose torch.empty outputs are guarded
KERNEL_MODULES = ("tokens", "tokens_backward", "grouped_mm", "grouped_gemv",
                  "persistent_grouped_mm", "grouped_weight_grad", "rope", "router",
                  "router_split", "activation", "gather_quant", "routing.launch",
                  "routing.backward")  # fmt: skip
# the public modules whose use_triton the reference comparison patches off
PUBLIC_MODULES = ("tokens", "dense_tokens", "_gemm_plan", "rope", "router", "_router_split",
                  "routing", "activation", "gather_quant")  # fmt: skip


# --------------------------------------------------------------------------------------------
# harness


def harness(monkeypatch, device: torch.device) -> GuardHarness:
    return GuardHarness(monkeypatch, device, KERNEL_MODULES, PUBLIC_MODULES)


@pytest.fixture
def cpu(monkeypatch):
    return harness(monkeypatch, CPU)


@pytest.fixture
def cuda(monkeypatch):
    return harness(monkeypatch, torch.device("cuda"))


def on_gpu(fn):
    """A ``gpu`` test: skipped without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(fn))


def same_bits(a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    ai, bi = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if ai.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        ai, bi = ai.view(ints[ai.element_size()]), bi.view(ints[bi.element_size()])
    assert torch.equal(ai, bi), f"{(ai != bi).sum()} of {ai.numel()} elements differ"


def close(a, b, tol: float = 1e-5) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    torch.testing.assert_close(a.detach().cpu().float(), b.detach().cpu().float(), rtol=tol,
                               atol=tol, equal_nan=True)  # fmt: skip


def each(check, got, other, *args) -> None:
    """``check(a, b, *args)`` for the pairs of ``got`` and ``other`` (none where other is None:
    the reference is the path that ran)."""
    if other is not None:
        for a, b in zip(got, other, strict=True):
            check(a, b, *args)


def randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def idx(values, bound: int, dtype=torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """(hostile index tensor, its sanitised twin: out of [0, bound) -> -1)."""
    clean = [v if 0 <= v < bound else -1 for v in values]
    return torch.tensor(values, dtype=dtype), torch.tensor(clean, dtype=dtype)


def group_bounds(offsets: list[int], rows: int) -> list[int]:
    """The documented rule: offsets[0] reads as 0, each later one clamped into [previous, rows]."""
    out, prev = [0], 0
    for v in offsets[1:]:
        prev = min(max(v, prev), rows)
        out.append(prev)
    return out


def grads_of(fn, inputs, upstream_seed: int = 99):
    """(out, grads of ``inputs``) of ``fn(*inputs)`` against a fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(randn(out.shape, upstream_seed).to(out.device, out.dtype))
    return (out.detach(), *[t.grad for t in leaves])


# --------------------------------------------------------------------------------------------
# tokens: gather_scale_dense_tokens, scatter_add_dense_tokens, dispatch, combine

TOK = [0, -1, 6, -7, I32_MAX, 5, 2, I32_MIN]  # T = 6
EXP = [0, 3, -1, 1, 2, -4, 1, 0]  # E = 3
VTCS = [None, ([-3], torch.int32), ([5], torch.int64), ([2**40], torch.int64),
        ([I32_MIN], torch.int32)]  # fmt: skip


def vtc_pair(h: GuardHarness, spec, n: int):
    """(hostile valid_token_count, its sanitised twin clamped into [0, n])."""
    if spec is None:
        return None, None
    values, dtype = spec
    clean = torch.tensor([min(max(values[0], 0), n)], dtype=dtype, device=h.device)
    return h.g(torch.tensor(values, dtype=dtype)), clean


def check_gather_scatter(h: GuardHarness, spec) -> None:
    T, D, E = 6, 5, 3
    x, scores = h.g(randn((T, D), 1)), h.g(randn((T, E), 2))
    tok, tok_c = idx(TOK, T)
    exp, exp_c = idx(EXP, E, torch.int64)
    tok, exp = h.g(tok), h.g(exp)
    tok_c, exp_c = tok_c.to(h.device), exp_c.to(h.device)
    vtc, vtc_c = vtc_pair(h, spec, len(TOK))
    gather = mk.gather_scale_dense_tokens
    got = grads_of(lambda a, s: gather(a, tok, exp, s, vtc), (x, scores))
    h.intact()
    each(same_bits, got, grads_of(lambda a, s: gather(a, tok_c, exp_c, s, vtc_c), (x, scores)))
    ref = h.reference(grads_of, lambda a, s: gather(a, tok, exp, s, vtc), (x, scores))
    each(same_bits, got, ref)

    out = h.g(randn((T, D), 3))
    before = out.clone()
    src = h.g(randn((len(TOK), D), 4))
    mk.scatter_add_dense_tokens(out, src, tok, vtc)
    h.intact()
    want = before.clone()
    mk.scatter_add_dense_tokens(want, src, tok_c, vtc_c)
    same_bits(out, want)
    if h.kernels:
        ref = before.clone()
        h.reference(mk.scatter_add_dense_tokens, ref, src, tok, vtc)
        same_bits(out, ref)


@pytest.mark.parametrize("spec", VTCS, ids=lambda s: "none" if s is None else str(s[0][0]))
def test_gather_and_scatter_hostile_indices(cpu, spec):
    check_gather_scatter(cpu, spec)


def test_gather_scale_no_tokens_or_experts(cpu):
    """T = 0 or E = 0: every row dead; the backward indexed the empty scores before."""
    for T, E in ((0, 3), (4, 0)):
        x, scores = cpu.g(randn((T, 5), 1)), cpu.g(randn((T, E), 2))
        tok, exp = cpu.g(torch.tensor([0, -1, 3])), cpu.g(torch.tensor([0, 1, -1]))
        out, gx, gs = grads_of(lambda a, s: mk.gather_scale_dense_tokens(a, tok, exp, s),  # noqa: B023
                               (x, scores))  # fmt: skip
        cpu.intact()
        assert out.shape == (3, 5) and out.eq(0).all()
        assert gx.shape == x.shape and gx.eq(0).all() and gs.shape == scores.shape


def hostile_plan(h: GuardHarness, T: int = 4, K: int = 2, D: int = 5):
    """(x, y, hostile plan, its sanitised twin): token indices and inverse out of range."""
    P = T * K
    tok, tok_c = idx([0, 3, -1, T, I32_MIN, 1, 2, I32_MAX], T)
    inv, inv_c = idx([0, -1, 9, 3, I32_MIN, 7, 2, I32_MAX], P)
    weights = h.g(randn((P,), 5))
    counts = torch.zeros(1, dtype=torch.int32, device=h.device)
    offsets = torch.tensor([0, P], dtype=torch.int32, device=h.device)
    experts = torch.zeros(P, dtype=torch.int32, device=h.device)
    plan = RoutingPlan(counts, offsets, experts, h.g(tok), weights, h.g(inv).view(T, K))
    clean = plan._replace(token_indices=tok_c.to(h.device), inverse=inv_c.to(h.device).view(T, K))
    return h.g(randn((T, D), 6)), h.g(randn((P, D), 7)), plan, clean


def test_dispatch_and_combine_hostile_plan(cpu):
    x, y, plan, clean = hostile_plan(cpu)

    def run(p):
        outs = []
        for scale in (False, True):
            outs += grads_of(lambda a, w: mk.dispatch(a, p._replace(weights=w), scale=scale),  # noqa: B023
                             (x, p.weights))  # fmt: skip
        for weighted in (False, True):
            outs += grads_of(lambda b, w: mk.combine(b, p._replace(weights=w), weighted=weighted),  # noqa: B023
                             (y, p.weights))  # fmt: skip
        return outs

    got = run(plan)
    cpu.intact()
    each(same_bits, got, run(clean))
    each(close, got, cpu.reference(run, plan))  # (the weights' dots sum D in another order)


# --------------------------------------------------------------------------------------------
# grouped GEMMs: gather_grouped_mm, grouped_weight_grad, the persistent kernel, zero_tail

HOSTILE_OFFSETS = {  # E = 3 groups over P = 12 rows: E+1 offsets
    "end_past_P": ([0, 5, 40, 9], torch.int32),
    "decreasing": ([0, 10, 4, 7], torch.int32),
    "negative": ([0, -3, 6, -1], torch.int32),
    "first_not_0": ([5, 7, 9, 12], torch.int64),
    "int32_extremes": ([I32_MIN, I32_MAX, 3, I32_MIN], torch.int32),
    "int64_huge": ([0, 2**40, -(2**62), 2**62], torch.int64),
    "wraps_int32": ([0, 2**32 + 3, 4, 5], torch.int64),  # 3 if truncated to int32
    "empty": ([0, 0, 0, 0], torch.int32),
    "valid": ([0, 3, 3, 10], torch.int32),
}
ROWS = [0, -1, 9, 10, I32_MAX, 3, I32_MIN, 4, 5, -2, 8, 1]  # P = 12 rows of x (T = 10)


def offsets_pair(h: GuardHarness, case: str, rows: int):
    ends, dtype = HOSTILE_OFFSETS[case]
    clean = torch.tensor(group_bounds(ends, rows), dtype=dtype, device=h.device)
    return h.g(torch.tensor(ends, dtype=dtype)), clean


def check_gather_grouped_mm(h: GuardHarness, case: str, gathered: bool, backward: bool,
                            dtype=torch.float32, tol: float = 1e-5, D: int = 16,
                            N: int = 8) -> None:  # fmt: skip
    E, P = 3, 12
    T = 10 if gathered else P
    x, w = h.g(randn((T, D), 1, dtype)), h.g(randn((E, N, D), 2, dtype))
    offs, offs_c = offsets_pair(h, case, P)
    rows = rows_c = None
    if gathered:
        rows, rows_c = idx(ROWS, T)
        rows, rows_c = h.g(rows), rows_c.to(h.device)

    def run(o, r, act):
        fn = lambda a, b: mk.gather_grouped_mm(a, b, o, r, activation=act)  # noqa: E731
        if backward:
            return grads_of(fn, (x, w))
        return (fn(x, w),)

    for act in (None, "silu"):
        got = run(offs, rows, act)
        h.intact()
        end = group_bounds(HOSTILE_OFFSETS[case][0], P)[-1]
        assert got[0][end:].eq(0).all()  # rows past the (clamped) last offset are zero
        each(same_bits, got, run(offs_c, rows_c, act))
        each(close, got, h.reference(run, offs, rows, act), tol)

    dy = h.g(randn((P, N), 3, dtype))
    got = mk.grouped_weight_grad(dy, x, offs, rows)
    h.intact()
    same_bits(got, mk.grouped_weight_grad(dy, x, offs_c, rows_c))
    if h.kernels:
        close(got, h.reference(mk.grouped_weight_grad, dy, x, offs, rows), tol)


@pytest.mark.parametrize("case", list(HOSTILE_OFFSETS))
def test_gather_grouped_mm_hostile_offsets(cpu, case):
    check_gather_grouped_mm(cpu, case, gathered=case in ("decreasing", "wraps_int32"),
                            backward=case in ("end_past_P", "first_not_0"))  # fmt: skip


def test_gather_grouped_mm_hostile_rows(cpu):
    check_gather_grouped_mm(cpu, "valid", gathered=True, backward=True)


@pytest.mark.skipif(not use_triton(CPU), reason="runs the persistent kernel in the interpreter")
@pytest.mark.parametrize("case", ["end_past_P", "decreasing", "first_not_0", "wraps_int32"])
def test_persistent_grouped_mm_and_zero_tail_hostile_offsets(cpu, case):
    """The persistent kernel (CUDA sm90 bf16 only in the op) and zero_tail, in the interpreter."""
    E, P, K, N = 3, 12, 16, 8
    a, w = cpu.g(randn((P, K), 1)), randn((E, N, K), 2)
    offs, offs_c = offsets_pair(cpu, case, P)
    pgm, gm = triton_kernels("persistent_grouped_mm"), triton_kernels("grouped_mm")
    want = cpu.reference(mk.gather_grouped_mm, a, w, offs)
    for layout, wl in (("nk", cpu.g(w)), ("kn", cpu.g(w.mT.contiguous()))):
        c = pgm.persistent_grouped_mm(a, wl, offs, layout)
        cpu.intact()
        gm.zero_tail(c, offs)
        cpu.intact()
        same_bits(
            c,
            pgm.persistent_grouped_mm(a, wl, offs_c, layout).index_fill_(
                0, torch.arange(group_bounds(HOSTILE_OFFSETS[case][0], P)[-1], P), 0.0
            ),
        )
        close(c, want)


@pytest.mark.skipif(not use_triton(CPU), reason="runs the tile GEMM in the interpreter")
@pytest.mark.parametrize("case", ["end_past_P", "decreasing", "int32_extremes", "wraps_int32"])
def test_tile_grouped_mm_hostile_offsets_and_rows(cpu, case):
    """The tile GEMM (the op's plan above a decode step's rows; at these 12 it runs the grouped
    GEMV, which the tests above cover), in the interpreter."""
    E, P, K, N, T = 3, 12, 16, 8, 10
    x, w = cpu.g(randn((T, K), 1)), cpu.g(randn((E, N, K), 2))
    offs, offs_c = offsets_pair(cpu, case, P)
    rows, rows_c = idx(ROWS, T)
    rows = cpu.g(rows)
    gm = triton_kernels("grouped_mm")
    y = gm.gather_grouped_mm(x, w, offs, rows, gm.ACT_SILU)
    cpu.intact()
    same_bits(y, gm.gather_grouped_mm(x, w, offs_c, rows_c, gm.ACT_SILU))
    close(y, cpu.reference(mk.gather_grouped_mm, x, w, offs, rows, activation="silu"))


def test_zero_experts_gather_grouped_mm(cpu, monkeypatch):
    """Finding (a): no experts gives zeros on every path (the Triton path's CUTLASS test
    indexed w_END[0]: IndexError). The Triton path is forced here even without the
    interpreter: with no experts it launches nothing."""
    x, w = cpu.g(randn((6, 16), 1)), cpu.g(randn((0, 8, 16), 2))
    offs = cpu.g(torch.tensor([0], dtype=torch.int32))
    rows = cpu.g(torch.tensor([0, 5, -1, 2]))
    ref = []
    for kernels in (False, True):
        with monkeypatch.context() as m:
            m.setattr(plan_mod, "use_triton", lambda device, k=kernels: k)
            outs = grads_of(lambda a, b: mk.gather_grouped_mm(a, b, offs), (x, w))
            silu = lambda a, b: mk.gather_grouped_mm(a, b, offs, rows, activation="silu")  # noqa: E731
            outs += grads_of(silu, (x, w))
            outs += (mk.grouped_weight_grad(randn((6, 8), 3), x, offs),)
        cpu.intact()
        assert [tuple(t.shape) for t in outs] == [(6, 8), (6, 16), (0, 8, 16), (4, 8), (6, 16),
                                                  (0, 8, 16), (0, 8, 16)]  # fmt: skip
        assert all(t.eq(0).all() for t in outs)
        ref.append(outs)
    each(same_bits, *ref)


def test_zero_experts_expert_mlp_and_routed_experts(cpu):
    """Finding (a) through the composites: expert_mlp's no-grad forward indexed w_in[0]."""
    T, D, H = 4, 16, 8
    x = cpu.g(randn((T, D), 1))
    w_in, w_out = cpu.g(randn((0, H, D), 2)), cpu.g(randn((0, D, H), 3))
    plan = RoutingPlan(
        torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.full((T,), -1, dtype=torch.int32), torch.full((T,), -1, dtype=torch.int32),
        torch.zeros(T), torch.full((T, 1), -1, dtype=torch.int32),
    )  # fmt: skip
    y = mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse)
    assert y.shape == (T, D) and y.eq(0).all()
    y, gx, gi, go = grads_of(lambda a, b, c: mk.expert_mlp(a, b, c, plan.offsets,
                             plan.token_indices, plan.inverse), (x, w_in, w_out))  # fmt: skip
    assert y.eq(0).all() and gx.eq(0).all() and gi.shape == w_in.shape
    y = mk.routed_experts(x, w_in, w_out, plan)
    assert y.shape == (T, D) and y.eq(0).all()
    cpu.intact()


# --------------------------------------------------------------------------------------------
# expert_mlp and routed_experts: hostile plans


def test_expert_mlp_hostile_offsets_and_rows(cpu):
    """expert_mlp's rows past the clamped groups are zero (zero_tail), so the hostile result
    equals the clean one; routed_experts with hostile offsets only has to stay memory-safe (its
    intermediates' rows past the groups are unwritten, and a hostile inverse may read them)."""
    T, D, H, E, K = 5, 16, 8, 3, 2
    R = T * K
    x = cpu.g(randn((T, D), 1))
    w_in, w_out = cpu.g(randn((E, 2 * H, D), 2)), cpu.g(randn((E, D, H), 3))
    offs, offs_c = (
        cpu.g(torch.tensor([3, 4, -2, 40])),
        torch.tensor(group_bounds([3, 4, -2, 40], R)),
    )
    rows, rows_c = idx([0, 4, -1, 5, I32_MIN, 2, 3, I32_MAX, 1, 0], T)
    inv, inv_c = idx([0, 1, 2, -1, 99, 5, 6, I32_MIN, 8, 9], R)
    rows, inv = cpu.g(rows), cpu.g(inv).view(T, K)
    inv_c = inv_c.view(T, K)

    def mlp(o, r, i):
        return grads_of(lambda a, b, c: mk.expert_mlp(a, b, c, o, r, i, gated=True), (x, w_in,
                        w_out))  # fmt: skip

    got = mlp(offs, rows, inv)
    cpu.intact()
    each(same_bits, got, mlp(offs_c, rows_c, inv_c))
    each(close, got, cpu.reference(mlp, offs, rows, inv))
    with torch.no_grad():  # (the gathering GEMM: the same rows, maybe another summation order)
        close(mk.expert_mlp(x, w_in, w_out, offs, rows, inv, gated=True), got[0])
    cpu.intact()

    weights = cpu.g(randn((R,), 4))
    plan = RoutingPlan(torch.zeros(E, dtype=torch.int32), offs, torch.zeros(R, dtype=torch.int32),
                       rows, weights, inv)  # fmt: skip
    clean = plan._replace(offsets=torch.tensor([0, 4, 4, R]), token_indices=rows_c, inverse=inv_c)

    def routed(p):
        return grads_of(lambda a, b, c, s: mk.routed_experts(a, b, c, p._replace(weights=s),
                        gated=True), (x, w_in, w_out, weights))  # fmt: skip

    got = routed(clean._replace(token_indices=rows, inverse=inv))  # hostile indices
    cpu.intact()
    each(same_bits, got, routed(clean))
    each(close, got, cpu.reference(routed, clean._replace(token_indices=rows, inverse=inv)))
    routed(plan)  # hostile offsets too: memory-safe, results unspecified
    cpu.intact()


def test_routed_experts_errors_name_the_callers_arguments():
    """Finding (c): routed_experts' errors name its own arguments (x_TD, plan.*), not
    expert_mlp's internals (x_ND, inverse_NK, offsets, row_indices)."""
    T, D, H, E, K = 4, 8, 4, 2, 2
    x, w_in, w_out = randn((T, D), 1), randn((E, H, D), 2), randn((E, D, H), 3)
    plan = mk.route(torch.softmax(randn((T, E), 4), -1), K)
    cases = [
        (dict(x=x[:-1]), ValueError, "plan.inverse must have size 3 in dim 0 (T, the rows of "
         "x_TD)"),
        (dict(plan=plan._replace(offsets=plan.offsets[:-1])), ValueError, "plan.offsets must"),
        (dict(plan=plan._replace(offsets=plan.offsets.float())), TypeError, "plan.offsets must"),
        (dict(plan=plan._replace(token_indices=plan.token_indices[:, None])), ValueError,
         "plan.token_indices must"),
        (dict(plan=plan._replace(inverse=plan.inverse.flatten())), ValueError, "plan.inverse"),
        (dict(x=x.int()), TypeError, "x_TD must"),
        (dict(w_in=w_in.double()), TypeError, "w_in_EXD must have x_TD's dtype"),
        (dict(w_in=w_in[:, :, :-1]), ValueError, "(D, the columns of x_TD)"),
        (dict(plan=plan._replace(weights=plan.weights.int())), TypeError, "plan.weights"),
    ]  # fmt: skip
    for change, exc, message in cases:
        a = {**dict(x=x, w_in=w_in, w_out=w_out, plan=plan), **change}
        with pytest.raises(exc) as info:
            mk.routed_experts(a["x"], a["w_in"], a["w_out"], a["plan"])
        text = str(info.value)
        assert message in text, text
        for internal in ("x_ND", "inverse_NK", "row_indices"):
            assert internal not in text, text
        assert "offsets" not in text.replace("plan.offsets", ""), text
    internal = r"inverse_NK must have size 3 in dim 0 \(N, the rows of x_ND\)"
    with pytest.raises(ValueError, match=internal):  # expert_mlp's own names stay
        mk.expert_mlp(x[:-1], w_in, w_out, plan.offsets, plan.token_indices, plan.inverse)


# --------------------------------------------------------------------------------------------
# qk_norm_rope: slots outside [0, S)

SLOTS = [[-1], [3], [I64_MIN, 1], [2, 2**40], [I64_MAX, -5], [1, 1], [2]]  # S = 3


def check_rope(h: GuardHarness, slots: list[int], dtype=torch.float32) -> None:
    N, H, K, D, L, S = 3, 2, 1, 4, 2, 3
    qkv = randn((N, (H + 2 * K) * D), 1, dtype)
    q, k, v = (h.g(t) for t in qkv.split([H * D, K * D, K * D], dim=1))
    qw, kw = h.g(randn((D,), 2).abs() + 0.5), h.g(randn((D,), 3).abs() + 0.5)
    ang = randn((N, D // 2), 4)
    cos, sin = h.g(ang.cos()), h.g(ang.sin())
    poison = torch.full((L, K, S, N, D), float("nan"), dtype=dtype)
    kc, vc = h.g(poison), h.g(poison)
    layer = 1
    slots_t = h.g(torch.tensor(slots, dtype=torch.int64))
    q_out = mk.qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, layer, slots_t)
    h.intact()
    valid = [s for s in slots if 0 <= s < S]
    wk, wv = h.g(poison), h.g(poison)
    if valid:  # the sanitised call: only the valid slots
        want_q = mk.qk_norm_rope(q, k, v, qw, kw, cos, sin, wk, wv, layer,
                                 torch.tensor(valid, device=h.device))  # fmt: skip
        same_bits(q_out, want_q)
    same_bits(kc, wk)
    same_bits(vc, wv)
    if h.kernels:
        rk, rv = poison.clone().to(h.device), poison.clone().to(h.device)
        ref_q = h.reference(mk.qk_norm_rope, q, k, v, qw, kw, cos, sin, rk, rv, layer, slots_t)
        close(q_out, ref_q)
        close(kc, rk)
        same_bits(vc, rv)


@pytest.mark.parametrize("slots", SLOTS, ids=str)
def test_rope_skips_out_of_range_slots(cpu, slots):
    """Finding (b): a slot outside [0, S) is skipped on every path (the reference, the default
    CPU path, raised IndexError)."""
    check_rope(cpu, slots)


# --------------------------------------------------------------------------------------------
# router, activation, gather_quant: odd shapes, strides and special values (no index inputs
# but the FP8 gather's)


def specials(shape, seed: int, values=(float("nan"), float("inf"), float("-inf"), -0.0, 3e38)):
    x = randn(shape, seed)
    flat = x.view(-1)
    for i, s in enumerate(values):
        flat[(7 * i + 1) % flat.numel()] = s
    return x


def test_router_odd_shapes_and_specials(cpu):
    """fma (E <= 32) and split (bf16, more experts) variants: strided x (forward), specials
    (no overflowing finite values: the paths sum D in other orders; no infinities for the
    split variant, whose zero weight pieces make inf * 0 = NaN where the fp32 formula has inf),
    T = 1, and the backward."""
    for E, dtype in ((3, torch.float32), (40, torch.bfloat16)):
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        nonfinite = (float("nan"), -0.0) + (() if E > 32 else (float("inf"), float("-inf")))
        xs = cpu.g(specials((5, 48), E, nonfinite).to(dtype))[:, 7:31]  # (5, 24), strided
        x1 = cpu.g(randn((1, 24), 1, dtype))
        wt = cpu.g(randn((E, 24), 2))
        for fn in ("softmax", "sigmoid"):
            got = mk.router_scores(xs, wt, score_fn=fn)
            cpu.intact()
            each(close, (got,), cpu.reference(lambda: (mk.router_scores(xs, wt, score_fn=fn),)),  # noqa: B023
                 tol)  # fmt: skip
            for x in (xs, x1):
                got = grads_of(lambda a, b: mk.router_scores(a, b, score_fn=fn), (x, wt))  # noqa: B023
                cpu.intact()
                ref = cpu.reference(grads_of, lambda a, b: mk.router_scores(a, b, score_fn=fn),  # noqa: B023
                                    (x, wt))  # fmt: skip
                each(close, got, ref, tol)


def test_activation_odd_shapes_and_weighted_rows(cpu):
    from moe_kernels.activation import activation_grad_weighted

    M, H = 5, 3
    h_full = cpu.g(specials((M, 2 * H + 4), 1))
    for gated, h in ((False, h_full[:, 1 : H + 1]), (True, h_full[:, 2 : 2 * H + 2])):
        got = mk.expert_activation(h, gated)  # strided
        cpu.intact()
        each(close, (got,), cpu.reference(lambda: (mk.expert_activation(h, gated),)))  # noqa: B023
        got = grads_of(lambda a: mk.expert_activation(a, gated), (h,))  # noqa: B023
        cpu.intact()
        fn = lambda a: mk.expert_activation(a, gated)  # noqa: B023, E731
        each(close, got, cpu.reference(grads_of, fn, (h,)))
        go, w = cpu.g(randn((M, H), 2)), cpu.g(randn((M,), 3))
        tok = cpu.g(torch.tensor([0, -1, I32_MAX, I32_MIN, 7], dtype=torch.int32))
        hc = h.contiguous()
        got = activation_grad_weighted(go, hc, w, tok, gated)
        cpu.intact()
        ref = cpu.reference(activation_grad_weighted, go, hc, w, tok, gated)
        each(close, got, ref)
        assert got[2][[1, 3]].eq(0).all()  # rows with a negative token: dw 0
    empty = cpu.g(randn((0, 6), 4))
    assert mk.expert_activation(empty, True).shape == (0, 3)
    cpu.intact()


def test_gather_quant_hostile_indices(cpu):
    T, D, E = 6, 40, 3
    x, scores = cpu.g(randn((T, D), 1)), cpu.g(randn((T, E), 2))
    tok, tok_c = idx(TOK, T, torch.int64)
    exp, exp_c = idx(EXP, E)
    tok, exp = cpu.g(tok), cpu.g(exp)
    for spec in VTCS[::2]:
        vtc, vtc_c = vtc_pair(cpu, spec, len(TOK))
        q, s = mk.gather_scale_quant_dense_tokens(x, tok, exp, scores, None, vtc)
        cpu.intact()
        qc, sc = mk.gather_scale_quant_dense_tokens(x, tok_c, exp_c, scores, None, vtc_c)
        same_bits(q.view(torch.uint8), qc.view(torch.uint8))
        same_bits(s, sc)
        ref = cpu.reference(mk.gather_scale_quant_dense_tokens, x, tok, exp, scores, None, vtc)
        if ref is not None:
            close(q.float() * s[:, None], ref[0].float() * ref[1][:, None], 0.15)


# --------------------------------------------------------------------------------------------
# routing: valid token counts outside [0, T], special scores and biases


def routing_scores(h: GuardHarness, T: int = 10, E: int = 6, dtype=torch.float32) -> torch.Tensor:
    return h.g(specials((T, E), 5).to(dtype))


ROUTE_VTCS = [([-4], torch.int32), ([7], torch.int64), ([2**40], torch.int64),
              ([I32_MIN], torch.int32), ([I64_MAX], torch.int64)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_routing_hostile_counts_and_specials(cpu, dtype):
    x = routing_scores(cpu, dtype=dtype)
    T = x.shape[0]
    bias = cpu.g(torch.tensor([0.0, float("nan"), float("inf"), -1.0, float("-inf"), 2.0]))
    for vtc_spec in ROUTE_VTCS:
        vtc, vtc_c = vtc_pair(cpu, vtc_spec, T)
        calls = [
            lambda s, v: mk.route(s, 2, valid_token_count=v, renormalize=True),
            lambda s, v: mk.route(s, 3, valid_token_count=v, expert_index_start=1,
                                  expert_index_end=5),
            lambda s, v: mk.route(s, 2, valid_token_count=v, bias=bias, n_groups=2, topk_groups=1,
                                  scale=2.0),
            lambda s, v: mk.index_shuffling(s, 2, 6, v, 2),
        ]  # fmt: skip
        for call in calls:
            got = call(x, vtc)
            cpu.intact()
            each(same_bits, got, call(x, vtc_c))
            each(same_bits, got, cpu.reference(call, x, vtc))
        # the backward of route's weights (its Triton kernel in the interpreter)
        fn = lambda s: mk.route(s, 2, valid_token_count=vtc, renormalize=True).weights  # noqa: B023, E731
        got = grads_of(fn, (x,))
        cpu.intact()
        # (renormalised weights: one rounding to a 16-bit dtype may differ, as in test_backward)
        each(
            close, got, cpu.reference(grads_of, fn, (x,)), 1e-5 if dtype == torch.float32 else 2**-7
        )


# --------------------------------------------------------------------------------------------
# CUDA: the same checks on the GPU's paths (CUTLASS and the persistent GEMM included)


@on_gpu
@pytest.mark.parametrize("spec", VTCS, ids=lambda s: "none" if s is None else str(s[0][0]))
def test_gpu_gather_and_scatter(cuda, spec):
    check_gather_scatter(cuda, spec)


@on_gpu
def test_gpu_dispatch_and_combine(cuda):
    x, y, plan, clean = hostile_plan(cuda)
    got = mk.combine(y, plan), mk.dispatch(x, plan, scale=True)
    cuda.intact()
    each(same_bits, got, (mk.combine(y, clean), mk.dispatch(x, clean, scale=True)))


@on_gpu
@pytest.mark.parametrize("kernel", ["persistent", "cutlass", "triton"])
@pytest.mark.parametrize("case", ["end_past_P", "decreasing", "first_not_0", "int64_huge",
                                  "wraps_int32", "empty"])  # fmt: skip
def test_gpu_grouped_mm_hostile_offsets(cuda, monkeypatch, case, kernel):
    """bf16, 16-aligned: sorted rows take the persistent GEMM (sm90) or CUTLASS (forced by a
    zero rows-per-expert bound), whose offsets are clamped before torch._grouped_mm reads them."""
    from moe_kernels import _gemm_plan as rules

    if kernel != "persistent":
        monkeypatch.setattr(rules, "PERSISTENT_MAX_ROWS_PER_EXPERT", 0)
        monkeypatch.setattr(rules, "WGRAD_MAX_ROWS_PER_EXPERT", 0)
    if kernel == "triton":
        monkeypatch.setattr(rules, "_cutlass", lambda *a: False)
    check_gather_grouped_mm(cuda, case, gathered=False, backward=True, dtype=torch.bfloat16,
                            tol=3e-2, D=32, N=32)  # fmt: skip
    check_gather_grouped_mm(cuda, case, gathered=True, backward=True, dtype=torch.bfloat16,
                            tol=3e-2, D=32, N=32)  # fmt: skip


@on_gpu
@pytest.mark.parametrize("slots", SLOTS, ids=str)
def test_gpu_rope_slots(cuda, slots):
    check_rope(cuda, slots, torch.bfloat16)


@on_gpu
def test_gpu_routing_hostile_counts(cuda):
    x = routing_scores(cuda, T=40, E=8, dtype=torch.bfloat16)
    for vtc_spec in ROUTE_VTCS:
        vtc, vtc_c = vtc_pair(cuda, vtc_spec, 40)
        each(
            same_bits,
            mk.route(x, 2, valid_token_count=vtc, renormalize=True),
            mk.route(x, 2, valid_token_count=vtc_c, renormalize=True),
        )
        cuda.intact()
