"""Each op's backward against torch autograd of an independent formula (plain indexing and
matmuls), repeatability, opcheck's autograd checks, and compiled gradients equal to eager ones.

Runs on the reference path and under ``TRITON_INTERPRET=1`` (the kernels in the interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_kernels as mk
from moe_kernels._dispatch import use_triton

T, E, K, D, H = 13, 8, 3, 24, 16


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(fn, inputs, seed=7):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    out.backward(torch.randn(out.shape, generator=_g(seed)).to(out.dtype))
    return [t.grad for t in ins if t.is_floating_point()]


def _close(a, b, tol=1e-5):
    for x, y in zip(a, b, strict=True):
        assert x is not None and y is not None
        torch.testing.assert_close(x.float(), y.float(), atol=tol, rtol=tol)


def _choices(s, k):
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("span", [(0, E), (2, 6)])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_route_weights(renormalize, span, scale):
    s = torch.rand(T, E, generator=_g(0))
    vtc = torch.tensor([T - 2])
    opts = dict(renormalize=renormalize, valid_token_count=vtc, expert_index_start=span[0],
                expert_index_end=span[1], scale=scale)  # fmt: skip
    plan = mk.route(s, K, **opts)
    gw = torch.randn(T * K, generator=_g(1))

    def ours(s):
        return (mk.route(s, K, **opts).weights * gw).sum()

    def formula(s):
        w = s.gather(1, _choices(s.detach(), K))
        if renormalize:
            w = w / w.sum(1, keepdim=True)
        w = w * scale
        inv = plan.inverse.long()
        return torch.where(inv >= 0, w * gw[inv.clamp(min=0)], 0.0).sum()

    x1, x2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    (g1,) = torch.autograd.grad(ours(x1), x1)
    (g2,) = torch.autograd.grad(formula(x2), x2)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not use_triton(torch.device("cpu")), reason="the kernel: interpreter")
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_backward_kernel_equals_reference(renormalize, dtype):
    """The Triton kernel (interpreter: numpy fp32, no FMA contraction) bit for bit against the
    torch formula in fp32, on a plan with unrouted tokens, a scale and 40 experts (two column
    blocks)."""
    from moe_kernels._triton.routing.backward import route_backward
    from moe_kernels.reference.routing import route_backward_reference

    n_tok, n_exp, k = 37, 40, 5
    s = torch.rand(n_tok, n_exp, generator=_g(5)).to(dtype)
    plan = mk.route(s, k, renormalize=renormalize, valid_token_count=torch.tensor([n_tok - 4]))
    g = torch.randn(n_tok * k, generator=_g(6))
    got = route_backward(g, plan.inverse, plan.expert_indices, s, 0, 1.5, renormalize)
    want = route_backward_reference(g, plan.inverse, plan.expert_indices, s, 0, n_exp, 1.5,
                                    renormalize)  # fmt: skip
    assert got.dtype == dtype
    assert torch.equal(got != 0, want != 0)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter truncates bf16 stores (docs: triton-on-cpu): one ulp apart at most
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    assert got[n_tok - 4 :].abs().sum() == 0  # unrouted tokens: no gradient


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_route_backward_and_router_split_kernels_on_cuda():
    """On the GPU (compiled kernels: FMA contraction, round-to-nearest casts), over expert counts,
    top-k and score dtypes: route's backward kernel against its torch formula (bit for bit
    without renormalize), the split router's weight pieces bit for bit against ``split3`` and its
    dlogits' pieces summing to the formula within fp32 rounding (the compiled elementwise math
    differs from torch's in the last bit on some elements, seen on the H200)."""
    from moe_kernels._router_split import logits_grad, split3
    from moe_kernels._triton.router_split import split_grad, split_weight
    from moe_kernels._triton.routing.backward import route_backward
    from moe_kernels.reference.routing import route_backward_reference

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for n_tok, n_exp, k in [(1, 8, 1), (300, 16, 8), (1000, 128, 8), (77, 256, 6), (64, 1024, 4)]:
        for dtype in (torch.float32, torch.bfloat16):
            s = torch.rand(n_tok, n_exp, device=dev, generator=gen).to(dtype)
            vtc = torch.tensor([n_tok - n_tok // 5], device=dev)
            for renorm in (False, True):
                plan = mk.route(s, k, renormalize=renorm, valid_token_count=vtc)
                g = torch.randn(n_tok * k, device=dev, generator=gen)
                got = route_backward(g, plan.inverse, plan.expert_indices, s, 0, 0.5, renorm)
                want = route_backward_reference(g, plan.inverse, plan.expert_indices, s, 0,
                                                n_exp, 0.5, renorm)  # fmt: skip
                if renorm:  # the quotient rule's k terms (each at most |g|) may cancel:
                    # fp32 rounding at the incoming gradient's scale, not the result's
                    atol = 1e-6 * float(g.abs().max())
                    torch.testing.assert_close(got.float(), want.float(), rtol=2e-6, atol=atol)
                else:
                    assert torch.equal(got, want)
        w = torch.randn(n_exp, 96, device=dev, generator=gen) / 10
        assert torch.equal(split_weight(w).view(4, n_exp, 96)[1:], split3(w))
        sc = torch.softmax(torch.randn(n_tok, n_exp, device=dev, generator=gen), dim=-1)
        g = torch.randn(n_tok, n_exp, device=dev, generator=gen)
        for fn in ("softmax", "sigmoid"):
            a, b = (t.float().view(n_tok, 3, n_exp) for t in split_grad(g, sc, fn == "softmax"))
            dl = logits_grad(g, sc, fn)
            scale = float(dl.abs().max())  # cancellation: a few fp32 ulps of the largest
            torch.testing.assert_close(
                (b[:, 0] + b[:, 1]) + b[:, 2], dl, rtol=1e-6, atol=1e-6 * scale
            )
            assert torch.equal(a[:, 1], b[:, 0]) and torch.equal(a[:, 0], b[:, 1])


@pytest.mark.parametrize("scale", [False, True])
def test_dispatch(scale):
    s = torch.rand(T, E, generator=_g(0))
    plan = mk.route(s, K, expert_index_start=1, expert_index_end=7)
    x = torch.randn(T, D, generator=_g(2))
    w = plan.weights.clone()
    tok = plan.token_indices.long()

    def ours(x, w):
        return mk.dispatch(x, plan._replace(weights=w), scale=scale)

    def formula(x, w):
        rows = x[tok.clamp(min=0)] * (w[:, None] if scale else 1.0)
        return torch.where((tok >= 0)[:, None], rows, 0.0)

    a = _grads(ours, [x, w])
    b = _grads(formula, [x, w])
    _close(a[:1] if not scale else a, b[:1] if not scale else b)


@pytest.mark.parametrize("weighted", [False, True])
def test_combine(weighted):
    s = torch.rand(T, E, generator=_g(0))
    plan = mk.route(s, K, expert_index_start=1, expert_index_end=7)
    y = torch.randn(T * K, D, generator=_g(3))
    inv = plan.inverse.long()

    def ours(y, w):
        return mk.combine(y, plan._replace(weights=w), weighted=weighted, out_dtype=torch.float32)

    def formula(y, w):
        terms = y[inv.clamp(min=0)] * (w[inv.clamp(min=0)][..., None] if weighted else 1.0)
        return torch.where((inv >= 0)[..., None], terms, 0.0).sum(1)

    a, b = _grads(ours, [y, plan.weights]), _grads(formula, [y, plan.weights])
    _close(a if weighted else a[:1], b if weighted else b[:1])


def test_gather_scale_and_scatter_add():
    s = torch.rand(T, E, generator=_g(0))
    _, exp, tok = mk.index_shuffling(s, top_k=K)
    tok = tok.clone()
    tok[4] = -1
    vtc = torch.tensor([T * K - 3])
    x = torch.randn(T, D, generator=_g(4))
    live = (tok >= 0) & (exp >= 0) & (torch.arange(T * K) < vtc)
    t, e = tok.long().clamp(min=0), exp.long().clamp(min=0)

    def ours(x, s):
        return mk.gather_scale_dense_tokens(x, tok, exp, s, vtc)

    def formula(x, s):
        return torch.where(live[:, None], x[t] * s[t, e][:, None], 0.0)

    _close(_grads(ours, [x, s]), _grads(formula, [x, s]))
    y = torch.randn(T * K, D, generator=_g(5))

    def ours_add(o, y):
        o = o * 1.0
        mk.scatter_add_dense_tokens(o, y, tok, vtc)
        return o

    def formula_add(o, y):
        return o.index_add(0, t[live], y[live])

    _close(_grads(ours_add, [x, y]), _grads(formula_add, [x, y]))


@pytest.mark.parametrize("gated", [False, True])
def test_expert_activation(gated):
    h = torch.randn(T, 2 * H if gated else H, generator=_g(6)) * 3

    def formula(h):
        if not gated:
            return F.silu(h)
        g, u = h.chunk(2, -1)
        return F.silu(g) * u

    _close(_grads(lambda h: mk.expert_activation(h, gated), [h]), _grads(formula, [h]), 1e-5)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("gathered", [False, True])
def test_gather_grouped_mm(activation, gathered):
    offs = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    n_rows = 24
    rows = torch.randint(-1, T, (n_rows,), generator=_g(7)).int() if gathered else None
    x = torch.randn(T if gathered else n_rows, D, generator=_g(8))
    w = torch.randn(4, H, D, generator=_g(9)) / D**0.5

    def ours(x, w):
        return mk.gather_grouped_mm(x, w, offs, rows, activation=activation)

    def formula(x, w):
        out = []
        for p in range(n_rows):
            e = next((e for e in range(4) if offs[e] <= p < offs[e + 1]), None)
            src = p if rows is None else int(rows[p])
            if e is None or not 0 <= src < x.shape[0]:
                out.append(x.new_zeros(H))
                continue
            h = w[e] @ x[src]
            out.append(F.silu(h) if activation else h)
        return torch.stack(out)

    _close(_grads(ours, [x, w]), _grads(formula, [x, w]), 1e-4)


def test_grouped_weight_grad():
    offs = torch.tensor([0, 7, 7, 15], dtype=torch.int32)
    rows = torch.randint(-1, T, (18,), generator=_g(10)).int()
    dy, x = torch.randn(18, H, generator=_g(11)), torch.randn(T, D, generator=_g(12))
    out = mk.grouped_weight_grad(dy, x, offs, rows)
    ref = torch.zeros(3, H, D)
    for e in range(3):
        for p in range(int(offs[e]), int(offs[e + 1])):
            if 0 <= int(rows[p]) < T:
                ref[e] += torch.outer(dy[p], x[int(rows[p])])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="x_TD"):
        mk.grouped_weight_grad(dy, x.double(), offs, rows)
    with pytest.raises(ValueError, match="row_indices"):
        mk.grouped_weight_grad(dy, x, offs, rows[:5])


def test_backward_is_bitwise_repeatable():
    s = torch.rand(T, E, generator=_g(0))
    x = torch.randn(T, D, generator=_g(1))
    w = torch.randn(E, H, D, generator=_g(2)) / D**0.5

    def fn(x, w, s):
        p = mk.route(s, K, renormalize=True)
        h = mk.gather_grouped_mm(mk.dispatch(x, p), w, p.offsets)
        return mk.combine(mk.expert_activation(h), p._replace(), out_dtype=torch.float32)

    a, b = _grads(fn, [x, w, s]), _grads(fn, [x, w, s])
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_opcheck_autograd():
    s = torch.rand(T, E, generator=_g(0))
    plan = mk.route(s, K)
    x = torch.randn(T, D, generator=_g(1), requires_grad=True)
    ops = torch.ops.moe_kernels
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.route.default, (s.requires_grad_(), K, None, 0, E, True, None, 1, 1,
                          1.0), test_utils=checks)  # fmt: skip
    args = (torch.randn(T * K, generator=_g(5)), plan.inverse, plan.expert_indices, s.detach(), 0,
            E, 2.0, True, None, 1, 1)  # fmt: skip
    torch.library.opcheck(ops.route_backward.default, args, test_utils=checks)
    args = (x, plan.token_indices, plan.weights, plan.inverse, False)
    torch.library.opcheck(ops.dispatch.default, args, test_utils=checks)
    y = torch.randn(T * K, D, generator=_g(2), requires_grad=True)
    args = (y, plan.inverse, plan.token_indices, plan.weights.requires_grad_(), True, torch.float32)
    torch.library.opcheck(ops.combine.default, args, test_utils=checks)
    h = torch.randn(T, 2 * H, generator=_g(3), requires_grad=True)
    torch.library.opcheck(ops.expert_activation.default, (h, True), test_utils=checks)
    w = torch.randn(E, H, D, generator=_g(4), requires_grad=True)
    args = (x, w, plan.offsets, plan.token_indices, "silu")
    torch.library.opcheck(ops.gather_grouped_mm.default, args, test_utils=checks)
