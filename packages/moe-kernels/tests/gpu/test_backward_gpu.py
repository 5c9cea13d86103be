"""Each differentiable op's backward on the GPU against autograd of the same call on the CPU
(the reference path), in fp32, and bitwise repeatable: ``route`` (with and without
renormalize), ``dispatch`` (scaled, an expert range), ``combine`` (weighted),
``gather_scale_dense_tokens``, ``scatter_add_dense_tokens``, ``expert_activation``,
``gather_grouped_mm`` (gathered with SiLU, sorted rows in bf16), ``expert_mlp`` (keeping the
gathered rows or gathering them again) and ``routed_experts`` (with the router weights'
gradient). Then at a Qwen3-like training shape in bf16: ``expert_mlp`` against the op chain it
replaces and ``routed_experts`` against ``expert_mlp`` + ``combine``, both repeatable.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.testing import bits_equal, gpu_test_device

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
T, E, K, D, H = 300, 16, 4, 96, 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp64, on the CPU."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def grads(fn, inputs, on):
    """The floating inputs' gradients of sum(fn(*inputs) * cos ramp), inputs copied to ``on``."""
    ins = [t.detach().to(on).clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    out.backward(torch.cos(torch.arange(out.numel(), device=on).view_as(out).float()).to(out))
    return [t.grad for t in ins if t.is_floating_point()]


def assert_matches_cpu(fn, *inputs, tol=1e-5) -> None:
    got, want, again = grads(fn, inputs, DEV), grads(fn, inputs, "cpu"), grads(fn, inputs, DEV)
    err = max(rel_err(a, b) for a, b in zip(got, want, strict=True))
    assert err <= tol, f"gradients {err:.1e} from the CPU reference's"
    assert all(bits_equal(a, b) for a, b in zip(got, again, strict=True)), "not repeatable"


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return g, torch.rand(T, E, generator=g), torch.randn(T, D, generator=g)


@pytest.mark.parametrize("renorm", [False, True])
def test_route(renorm):
    _, scores, _ = data()
    assert_matches_cpu(lambda s: mk.route(s, K, renormalize=renorm).weights * 1.0, scores)


def test_dispatch_and_combine():
    g, scores, x = data()

    def disp(x, s):
        return mk.dispatch(x, mk.route(s, K, expert_index_start=2, expert_index_end=14), scale=True)

    def comb(y, s):
        return mk.combine(y, mk.route(s, K, renormalize=True), out_dtype=torch.float32)

    assert_matches_cpu(disp, x, scores)
    assert_matches_cpu(comb, torch.randn(T * K, D, generator=g), scores)


def test_gather_scale_and_scatter_add():
    g, scores, x = data()
    _, e_idx, t_idx = mk.index_shuffling(scores, top_k=K)

    def gs(x, s):
        return mk.gather_scale_dense_tokens(x, t_idx.to(x.device), e_idx.to(x.device), s)

    def sa(o, y):
        o = o * 1.0
        mk.scatter_add_dense_tokens(o, y, t_idx.to(o.device))
        return o

    assert_matches_cpu(gs, x, scores)
    assert_matches_cpu(sa, x, torch.randn(T * K, D, generator=g))


@pytest.mark.parametrize("gated", [False, True])
def test_expert_activation(gated):
    g, _, _ = data()
    h = torch.randn(T, 2 * H if gated else H, generator=g)
    assert_matches_cpu(lambda h: mk.expert_activation(h, gated), h)


def test_gather_grouped_mm():
    g, scores, x = data()
    plan = mk.route(scores, K)
    w = torch.randn(E, H, D, generator=g) / D**0.5
    for act in (None, "silu"):

        def ggmm(x, w, act=act):
            rows = plan.token_indices.to(x.device)
            return mk.gather_grouped_mm(x, w, plan.offsets.to(x.device), rows, activation=act)

        assert_matches_cpu(ggmm, x, w, tol=1e-4)
    xs = mk.dispatch(x, plan).bfloat16()  # sorted rows: CUTLASS's forward on sm90 bf16

    def gmm(a, w):
        return mk.gather_grouped_mm(a, w, plan.offsets.to(a.device))

    assert_matches_cpu(gmm, xs, w.bfloat16(), tol=2e-2)


@pytest.mark.parametrize("save_rows", [True, False])
def test_expert_mlp(save_rows):
    g, scores, x = data()
    plan = mk.route(scores, K)
    w_in = torch.randn(E, 2 * H, D, generator=g) / D**0.5
    w_out = torch.randn(E, D, H, generator=g) / H**0.5

    def mlp(x, w_in, w_out):
        p = [t.to(x.device) for t in (plan.offsets, plan.token_indices, plan.inverse)]
        return mk.expert_mlp(x, w_in, w_out, *p, gated=True, save_rows=save_rows)

    assert_matches_cpu(mlp, x, w_in, w_out, tol=1e-4)


def test_routed_experts():
    g, scores, x = data()
    plan = mk.route(scores, K)
    w_in = torch.randn(E, 2 * H, D, generator=g) / D**0.5
    w_out = torch.randn(E, D, H, generator=g) / H**0.5

    def routed(x, w_in, w_out, s):
        p = plan._replace(**{f: getattr(plan, f).to(x.device) for f in plan._fields})
        return mk.routed_experts(x, w_in, w_out, p._replace(weights=s), gated=True)

    assert_matches_cpu(routed, x, w_in, w_out, plan.weights, tol=1e-4)


def test_experts_in_bf16_against_their_op_chains():
    """Qwen3-like (gated, 128 experts, top-8) at 2048 tokens: ``expert_mlp`` (both saving modes)
    against dispatch + two grouped GEMMs + activation, ``routed_experts`` against ``expert_mlp``
    + ``combine``: gradients within bf16 noise of each other (5e-2 of the largest), each bitwise
    repeatable."""
    Tq, Dq, Hq, Eq, kq = (2048, 2048, 768, 128, 8) if ON_GPU else (64, 32, 16, 4, 2)
    g = torch.Generator(device=DEV).manual_seed(0)
    plan = mk.route(torch.randn(Tq, Eq, device=DEV, generator=g).softmax(-1), kq)
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=DEV, generator=g) * scale).to(dtype)

    x, w_in, w_out = r(Tq, Dq), r(Eq, 2 * Hq, Dq, scale=Dq**-0.5), r(Eq, Dq, Hq, scale=Hq**-0.5)
    dy_R, dy = r(Tq * kq, Dq, scale=Dq**-0.5), r(Tq, Dq, scale=Dq**-0.5)
    idx = (plan.offsets, plan.token_indices, plan.inverse)

    def chain(x, w_in, w_out):
        h = mk.gather_grouped_mm(mk.dispatch(x, plan), w_in, plan.offsets)
        return mk.gather_grouped_mm(mk.expert_activation(h, True), w_out, plan.offsets)

    def two_nodes(x, w_in, w_out, s):
        o = mk.expert_mlp(x, w_in, w_out, *idx, gated=True)
        return mk.combine(o, plan._replace(weights=s), out_dtype=x.dtype)

    def one_node(x, w_in, w_out, s):
        return mk.routed_experts(x, w_in, w_out, plan._replace(weights=s), gated=True)

    def step(fn, params, dy):
        ps = [p.detach().requires_grad_() for p in params]
        fn(*ps).backward(dy)
        return [p.grad for p in ps]

    def agree(a, b):
        return all(rel_err(u, v) < 5e-2 for u, v in zip(a, b, strict=True))

    params = [x, w_in, w_out]
    want = step(chain, params, dy_R)
    for save_rows in (True, False):

        def node(x, w_in, w_out, save_rows=save_rows):
            return mk.expert_mlp(x, w_in, w_out, *idx, gated=True, save_rows=save_rows)

        got = step(node, params, dy_R)
        assert agree(got, want), f"expert_mlp(save_rows={save_rows}) vs the op chain"
        assert bits_equal(got, step(node, params, dy_R)), "expert_mlp not repeatable"
    params = [x, w_in, w_out, plan.weights]
    want = step(two_nodes, params, dy)
    got = step(one_node, params, dy)
    assert agree(got, want), "routed_experts vs expert_mlp + combine"
    assert bits_equal(got, step(one_node, params, dy)), "routed_experts not repeatable"
