"""expert_mlp (the routed experts as one autograd node) against torch autograd of an independent
float64 formula, bit for bit against the chain of differentiable ops it replaces, repeatability,
saved versus re-gathered rows, compiled == eager, opcheck of its new op, its argument checks.

Runs on the reference path and under ``TRITON_INTERPRET=1`` (the kernels in the interpreter).
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.activation import activation_grad_and_out_op
from moe_kernels.reference.activation import activation as ref_activation
from moe_kernels.reference.grouped_mm import gather_grouped_mm as ref_gather_grouped_mm
from moe_kernels.testing import (
    bound_violations,
    oracle_expert_mlp_formula,
    oracle_expert_mlp_rows,
    reference_bound,
)

T, E, K, D, H = 11, 4, 3, 32, 16


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(dtype=torch.float32, gated=False, seed=0):
    """Tokens, weights and a plan (expert E-1 gets no rows, the last two tokens none)."""
    s = torch.rand(T, E, generator=_g(seed))
    s[:, E - 1] = -1.0
    plan = mk.route(s, K, valid_token_count=torch.tensor([T - 2]))
    x = torch.randn(T, D, generator=_g(seed + 1)).to(dtype)
    w_in = (torch.randn(E, 2 * H if gated else H, D, generator=_g(seed + 2)) / D**0.5).to(dtype)
    w_out = (torch.randn(E, D, H, generator=_g(seed + 3)) / H**0.5).to(dtype)
    dy = torch.randn(T * K, D, generator=_g(seed + 4)).to(dtype)
    return x, w_in, w_out, plan, dy


def _run(fn, x, w_in, w_out, dy):
    ins = [t.detach().clone().requires_grad_() for t in (x, w_in, w_out)]
    y = fn(*ins)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in ins)]


def _ours(plan, gated, save_rows=True):
    def fn(x, w_in, w_out):
        return mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                             gated=gated, save_rows=save_rows)  # fmt: skip

    return fn


def _chain(plan, gated):
    """The chain of public differentiable ops that expert_mlp replaces."""

    def fn(x, w_in, w_out):
        h = mk.gather_grouped_mm(mk.dispatch(x, plan), w_in, plan.offsets)
        return mk.gather_grouped_mm(mk.expert_activation(h, gated), w_out, plan.offsets)

    return fn


@pytest.mark.parametrize("gated", [False, True])
def test_matches_float64_formula(gated):
    x, w_in, w_out, plan, dy = _problem(gated=gated)
    ours = _run(_ours(plan, gated), x, w_in, w_out, dy)
    want = _run(
        oracle_expert_mlp_formula(plan, gated),
        x.double(),
        w_in.double(),
        w_out.double(),
        dy.double(),
    )
    for a, b in zip(ours, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)
    assert plan.counts[E - 1] == 0 and ours[2][E - 1].abs().sum() == 0  # no rows, no gradient
    assert ours[1][T - 2 :].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_forward_within_the_rounding_bound(gated, dtype):
    """The forward against the float64 rows and their rounding bound, and against the torch
    reference within twice it (the interpreter truncates h to bf16, the reference rounds it to
    nearest): the rule ``moe-bench verify`` applies (``moe_kernels.testing.tolerance``)."""
    x, w_in, w_out, plan, _ = _problem(dtype, gated, seed=3)
    args = (plan.offsets, plan.token_indices)
    y = mk.expert_mlp(x, w_in, w_out, *args, plan.inverse, gated=gated)
    exact, bound = oracle_expert_mlp_rows(x, w_in, w_out, *args, gated)
    assert bound_violations(y, exact, bound).bad == 0
    h = ref_gather_grouped_mm(x, w_in, *args, None if gated else "silu")
    h = ref_activation(h, True) if gated else h
    ref = ref_gather_grouped_mm(h, w_out, plan.offsets, None, None)
    assert bound_violations(y, ref.double(), reference_bound(bound)).bad == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_bitwise_equal_to_the_op_chain(gated, dtype):
    x, w_in, w_out, plan, dy = _problem(dtype, gated, seed=5)
    ours = _run(_ours(plan, gated), x, w_in, w_out, dy)
    chain = _run(_chain(plan, gated), x, w_in, w_out, dy)
    names = ("y", "grad x", "grad w_in", "grad w_out")
    for name, a, b in zip(names, ours, chain, strict=True):
        assert a.dtype == dtype and torch.equal(a, b), name


@pytest.mark.parametrize("gated", [False, True])
def test_repeatable_and_regathering_gives_the_same_bits(gated):
    x, w_in, w_out, plan, dy = _problem(torch.bfloat16, gated, seed=9)
    first = _run(_ours(plan, gated), x, w_in, w_out, dy)
    again = _run(_ours(plan, gated), x, w_in, w_out, dy)
    regathered = _run(_ours(plan, gated, save_rows=False), x, w_in, w_out, dy)
    for a, b, c in zip(first, again, regathered, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("gated", [False, True])
def test_no_grad_forward(gated):
    """Without gradients SiLU runs in the GEMM's epilogue on the fp32 accumulator (one rounding
    fewer): equal bits for SwiGLU, within a rounding of the pre-activation for SiLU."""
    x, w_in, w_out, plan, dy = _problem(torch.float32, gated, seed=3)
    with torch.no_grad():
        y = _ours(plan, gated)(x, w_in, w_out)
    y_grad = _run(_ours(plan, gated), x, w_in, w_out, dy)[0]
    if gated:
        assert torch.equal(y, y_grad)
    torch.testing.assert_close(y, y_grad, atol=1e-5, rtol=1e-5)


def test_only_some_gradients():
    x, w_in, w_out, plan, dy = _problem(seed=4)
    w_in = w_in.requires_grad_()
    mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse).backward(dy)
    full = _run(_ours(plan, False), x, w_in, w_out, dy)
    assert torch.equal(w_in.grad, full[2])


def test_compiled_equals_eager():
    x, w_in, w_out, plan, dy = _problem(torch.bfloat16, True, seed=6)
    eager = _run(_ours(plan, True), x, w_in, w_out, dy)
    torch._dynamo.reset()
    compiled = torch.compile(_ours(plan, True), fullgraph=True, backend="aot_eager")
    got = _run(compiled, x, w_in, w_out, dy)
    assert all(torch.equal(a, b) for a, b in zip(eager, got, strict=True))


def test_opcheck_grad_and_out():
    h = torch.randn(T, 2 * H, generator=_g(1))
    go = torch.randn(T, H, generator=_g(2))
    torch.library.opcheck(torch.ops.moe_kernels.expert_activation_grad_and_out.default,
                          (go, h, True), test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    dh, a = activation_grad_and_out_op.call(go, h, True)
    assert torch.equal(a, mk.expert_activation(h, True))
    hh = h.clone().requires_grad_()
    mk.expert_activation(hh, True).backward(go)
    assert torch.equal(dh, hh.grad)


def test_bad_input():
    x, w_in, w_out, plan, _ = _problem(seed=2)
    args = (plan.offsets, plan.token_indices, plan.inverse)
    with pytest.raises(TypeError, match="w_in_EXD"):
        mk.expert_mlp(x, w_in.double(), w_out, *args)
    with pytest.raises(ValueError, match="w_out_EDH"):
        mk.expert_mlp(x, w_in, w_out[:, :, :-1], *args)
    with pytest.raises(ValueError, match="w_in_EXD"):
        mk.expert_mlp(x[:, :-1], w_in, w_out, *args)
    with pytest.raises(ValueError, match="offsets"):
        mk.expert_mlp(x, w_in, w_out, plan.offsets[:-1], *args[1:])
    with pytest.raises(ValueError, match="inverse_NK"):
        mk.expert_mlp(x, w_in, w_out, *args[:2], plan.inverse[:-1])
    with pytest.raises(TypeError, match="row_indices"):
        mk.expert_mlp(x, w_in, w_out, args[0], plan.token_indices.float(), args[2])
    with pytest.raises(ValueError, match="even"):
        mk.expert_mlp(x, w_in[:, :-1], w_out, *args, gated=True)
    with pytest.raises(TypeError, match="gated"):
        mk.expert_mlp(x, w_in, w_out, *args, gated=1)
