"""routed_experts (the experts and the weighted combine as one autograd node) against torch
autograd of an independent float64 formula, its forward bit for bit against combine(expert_mlp),
its gradients against that chain's, repeatability, compiled == eager, opcheck and an independent
check of its activation pass, its argument checks.

Runs on the reference path and under ``TRITON_INTERPRET=1`` (the kernels in the interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_kernels as mk
from moe_kernels.activation import activation_grad_weighted
from moe_kernels.testing import oracle_routed_experts_formula

T, E, K, D, H = 11, 4, 3, 32, 16


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(dtype=torch.float32, gated=False, seed=0):
    """Tokens, weights, route scores and dY (expert E-1 gets no rows, the last two tokens none)."""
    s = torch.rand(T, E, generator=_g(seed)) + 0.1
    s[:, E - 1] = -1.0
    x = torch.randn(T, D, generator=_g(seed + 1)).to(dtype)
    w_in = (torch.randn(E, 2 * H if gated else H, D, generator=_g(seed + 2)) / D**0.5).to(dtype)
    w_out = (torch.randn(E, D, H, generator=_g(seed + 3)) / H**0.5).to(dtype)
    dy = torch.randn(T, D, generator=_g(seed + 4)).to(dtype)
    return x, w_in, w_out, s, dy


def _plan(s):
    return mk.route(s, K, valid_token_count=torch.tensor([T - 2]))


def _run(fn, x, w_in, w_out, s, dy):
    """y and the gradients of x, w_in, w_out and the scores (through the plan's weights)."""
    ins = [t.detach().clone().requires_grad_() for t in (x, w_in, w_out, s)]
    y = fn(*ins)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in ins)]


def _ours(gated, save_rows=True):
    def fn(x, w_in, w_out, s):
        return mk.routed_experts(x, w_in, w_out, _plan(s), gated=gated, save_rows=save_rows)

    return fn


def _chain(gated):
    def fn(x, w_in, w_out, s):
        plan = _plan(s)
        o = mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                          gated=gated)  # fmt: skip
        return mk.combine(o, plan, out_dtype=x.dtype)

    return fn


@pytest.mark.parametrize("gated", [False, True])
def test_matches_float64_formula(gated):
    x, w_in, w_out, s, dy = _problem(gated=gated)
    ours = _run(_ours(gated), x, w_in, w_out, s, dy)
    want = _run(
        oracle_routed_experts_formula(_plan, gated), *(t.double() for t in (x, w_in, w_out, s, dy))
    )
    names = ("y", "grad x", "grad w_in", "grad w_out", "grad scores")
    for name, a, b in zip(names, ours, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)
    assert ours[1][T - 2 :].abs().sum() == 0 and ours[4][T - 2 :].abs().sum() == 0
    assert ours[3][E - 1].abs().sum() == 0  # no rows, no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_against_the_chain_it_replaces(gated, dtype):
    """The forward bit for bit; the gradients the same math with the router weight applied after
    the data-gradient GEMM: equal in fp32 up to rounding, within bf16 roundings in bf16."""
    x, w_in, w_out, s, dy = _problem(dtype, gated, seed=5)
    ours = _run(_ours(gated), x, w_in, w_out, s, dy)
    chain = _run(_chain(gated), x, w_in, w_out, s, dy)
    assert torch.equal(ours[0], chain[0])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    names = ("grad x", "grad w_in", "grad w_out", "grad scores")
    for name, a, b in zip(names, ours[1:], chain[1:], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)


@pytest.mark.parametrize("gated", [False, True])
def test_repeatable_and_regathering_gives_the_same_bits(gated):
    x, w_in, w_out, s, dy = _problem(torch.bfloat16, gated, seed=9)
    first = _run(_ours(gated), x, w_in, w_out, s, dy)
    again = _run(_ours(gated), x, w_in, w_out, s, dy)
    regathered = _run(_ours(gated, save_rows=False), x, w_in, w_out, s, dy)
    for a, b, c in zip(first, again, regathered, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_no_grad_forward_equals_the_chain():
    x, w_in, w_out, s, _ = _problem(torch.bfloat16, True, seed=3)
    with torch.no_grad():
        assert torch.equal(_ours(True)(x, w_in, w_out, s), _chain(True)(x, w_in, w_out, s))
        y32 = mk.routed_experts(x, w_in, w_out, _plan(s), gated=True, out_dtype=torch.float32)
    assert y32.dtype == torch.float32


def test_compiled_equals_eager():
    x, w_in, w_out, s, dy = _problem(torch.bfloat16, True, seed=6)
    eager = _run(_ours(True), x, w_in, w_out, s, dy)
    torch._dynamo.reset()
    compiled = torch.compile(_ours(True), fullgraph=True, backend="aot_eager")
    got = _run(compiled, x, w_in, w_out, s, dy)
    assert all(torch.equal(a, b) for a, b in zip(eager, got, strict=True))


@pytest.mark.parametrize("gated", [False, True])
def test_weighted_activation_pass(gated):
    """(dh, w act(h), dw) against torch autograd of sum(grad * w * act(h)) in float64; a row
    with token -1 counts with weight 0."""
    m = 9
    h = torch.randn(m, 2 * H if gated else H, generator=_g(1))
    go = torch.randn(m, H, generator=_g(2))
    w = torch.rand(m, generator=_g(3))
    tok = torch.arange(m)
    tok[4] = -1
    dh, aw, dw = activation_grad_weighted(go, h, w, tok, gated)
    hh, ww = h.double().requires_grad_(), torch.where(tok >= 0, w, 0).double().requires_grad_()
    a = F.silu(hh[:, :H]) * hh[:, H:] if gated else F.silu(hh)
    (go.double() * ww[:, None] * a).sum().backward()
    torch.testing.assert_close(dh.double(), hh.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aw.double(), ww[:, None].detach() * a.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw.double(), torch.where(tok >= 0, ww.grad, 0), atol=1e-5, rtol=1e-5)
    assert dw[4] == 0 and aw[4].abs().sum() == 0 and dh[4].abs().sum() == 0
    op = torch.ops.moe_kernels.expert_activation_grad_weighted.default
    torch.library.opcheck(op, (go, h, w, tok, gated), test_utils=("test_schema", "test_faketensor"))


def test_bad_input():
    x, w_in, w_out, s, _ = _problem(seed=2)
    plan = _plan(s)
    with pytest.raises(TypeError, match="plan"):
        mk.routed_experts(x, w_in, w_out, (plan.offsets, plan.token_indices))
    with pytest.raises(TypeError, match="w_in_EXD"):
        mk.routed_experts(x, w_in.double(), w_out, plan)
    with pytest.raises(ValueError, match="plan.inverse"):
        mk.routed_experts(x[:-1], w_in, w_out, plan)
    with pytest.raises(ValueError, match="plan.weights"):
        mk.routed_experts(x, w_in, w_out, plan._replace(weights=plan.weights[:-1]))
    with pytest.raises(TypeError, match="out_dtype"):
        mk.routed_experts(x, w_in, w_out, plan, out_dtype=torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fn", ["routed_experts", "expert_mlp"])
def test_rows_past_the_groups_never_reach_a_result_on_cuda(gated, fn):
    """On CUDA the CUTLASS GEMMs leave the intermediates' rows past the groups unwritten
    (``zero_tail=False``). With the allocator's free blocks full of NaN first, a plan with such
    rows (a valid token count and a partial expert range) gives finite results, the same bits as
    over zero-filled blocks, and the CPU reference's values within bf16 rounding."""
    n_tok, n_exp, k, d, h = 300, 16, 4, 128, 64
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(n_tok, n_exp, generator=gen) + 0.1
    x = torch.randn(n_tok, d, generator=gen).bfloat16()
    w_in = (torch.randn(11, 2 * h if gated else h, d, generator=gen) / d**0.5).bfloat16()
    w_out = (torch.randn(11, d, h, generator=gen) / h**0.5).bfloat16()
    dy = torch.randn(n_tok, d, generator=gen).bfloat16()

    def run(dev, fill):
        ins = [t.to(dev).requires_grad_() for t in (x, w_in, w_out, s)]
        vtc = torch.tensor([n_tok - 37], device=dev)
        if dev == "cuda":  # the sizes the node allocates, filled and freed for it to reuse
            junk = [torch.full((n_tok * k, c), fill, dtype=torch.bfloat16, device=dev)
                    for c in (d, h, 2 * h, d, h, 2 * h, d)]  # fmt: skip
            del junk
        plan = mk.route(ins[3], k, valid_token_count=vtc, expert_index_start=2,
                        expert_index_end=13)  # fmt: skip
        if fn == "routed_experts":
            y = mk.routed_experts(ins[0], ins[1], ins[2], plan, gated=gated)
        else:
            o = mk.expert_mlp(ins[0], ins[1], ins[2], plan.offsets, plan.token_indices,
                              plan.inverse, gated=gated)  # fmt: skip
            y = mk.combine(o, plan, out_dtype=torch.bfloat16)
        y.backward(dy.to(dev))
        return [t.detach().float().cpu() for t in (y, *(i.grad for i in ins))]

    nan_run, zero_run = run("cuda", float("nan")), run("cuda", 0.0)
    ref = run("cpu", 0.0)
    for a, b, r in zip(nan_run, zero_run, ref, strict=True):
        assert bool(torch.isfinite(a).all())
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2 * float(r.abs().max()))
