"""expert_ops.grouped_mm: torch._grouped_mm where it runs on CPU (torch 2.11+, float32 / bfloat16 /
float16) and the static loop elsewhere (float64 here), each against per-expert matmuls on the
groups' row slices: forward and gradients, empty experts, a tail of rows in no group, the
stride-0 gradient of ``y.sum().backward()``, bitwise repeatability, torch.compile."""

from __future__ import annotations

import pytest
import torch

from moe_model import MoELayer, expert_ops
from moe_model.expert_ops import grouped_mm, grouped_mm_supported

CPU_GMM = expert_ops._CPU_GROUPED_MM
needs_cpu_gmm = pytest.mark.skipif(not CPU_GMM, reason="torch < 2.11: CPU takes the static loop")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}

K, N, E = 32, 48, 5
# Rows per expert (experts 1 and 4, the last, empty), then TAIL rows in no group (expert -1).
COUNTS, TAIL = [3, 0, 7, 4, 0], 3


def _problem(dtype, counts=COUNTS, tail=TAIL, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = sum(counts) + tail
    a = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(len(counts), N, K, generator=g).to(dtype)  # (E, N, K): b = w.mT, as the MLP
    expert = torch.cat(
        [torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((tail,), -1)]
    )
    c = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.cat([c.new_zeros(1), torch.cumsum(c, 0, dtype=torch.int32)])
    return a, w, offsets, expert


def _reference(a, w, counts):
    """Per-expert matmuls on the groups' row slices, in float64; rows in no group zero."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        out[start : start + c] = a[start : start + c].double() @ w[e].double().T
        start += c
    return out


def _run(a, w, offsets, expert, grad="cos"):
    a = a.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = grouped_mm(a, w.mT, offsets, expert)
    if grad == "sum":  # an expanded (stride-0) incoming gradient
        y.sum().backward()
    else:
        y.backward(_cos_like(y).to(y.dtype))
    return y.detach(), a.grad, w.grad


def _cos_like(y):
    return torch.cos(torch.arange(y.numel(), dtype=torch.float64)).view(y.shape)


def _check(got, a, w, offsets, expert, grad, tol):
    a64 = a.double().clone().requires_grad_()
    w64 = w.double().clone().requires_grad_()
    y64 = _reference(a64, w64, COUNTS)
    if grad == "sum":
        y64.sum().backward()
    else:
        y64.backward(_cos_like(y64))
    for name, x, ref in zip(["y", "a", "w"], got, [y64.detach(), a64.grad, w64.grad], strict=True):
        assert x.dtype == a.dtype and x.shape == ref.shape, name
        err = float((x.double() - ref).abs().max() / ref.abs().max())
        assert err <= tol, f"{name}: {err:.2e}"
    y, ga, gw = got
    n_grouped = sum(COUNTS)
    # Exact zeros where the docstring promises them: rows in no group (output and gradient) and
    # the empty experts' weight gradient.
    assert torch.all(y[n_grouped:] == 0) and torch.all(ga[n_grouped:] == 0)
    assert torch.all(gw[1] == 0) and torch.all(gw[4] == 0)


@needs_cpu_gmm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", ["cos", "sum"])
def test_cpu_grouped_mm_path(dtype, grad):
    a, w, offsets, expert = _problem(dtype)
    assert grouped_mm_supported(a, w.mT)
    got = _run(a, w, offsets, expert, grad)
    _check(got, a, w, offsets, expert, grad, TOL[dtype])
    again = _run(a, w, offsets, expert, grad)
    assert all(torch.equal(x, y) for x, y in zip(got, again, strict=True))


@needs_cpu_gmm
def test_cpu_grouped_mm_misaligned_data_pointer():
    """Views that start 4 bytes into their storage: no data-pointer rule from torch 2.11 on."""
    a, w, offsets, expert = _problem(torch.float32)
    a_off = torch.empty(a.numel() + 1)[1:].view_as(a).copy_(a)
    w_off = torch.empty(w.numel() + 1)[1:].view_as(w).copy_(w)
    assert a_off.data_ptr() % 16 and w_off.data_ptr() % 16
    assert grouped_mm_supported(a_off, w_off.mT)
    got = _run(a_off, w_off, offsets, expert)
    _check(got, a, w, offsets, expert, "cos", TOL[torch.float32])


def test_loop_path_float64():
    a, w, offsets, expert = _problem(torch.float64)
    assert not grouped_mm_supported(a, w.mT)
    for grad in ("cos", "sum"):
        _check(_run(a, w, offsets, expert, grad), a, w, offsets, expert, grad, TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_path_forced(dtype, monkeypatch):
    """The static loop (what float32 takes under torch.compile, and older torch) still holds."""
    monkeypatch.setattr(expert_ops, "grouped_mm_supported", lambda a, b: False)
    a, w, offsets, expert = _problem(dtype)
    _check(_run(a, w, offsets, expert, "sum"), a, w, offsets, expert, "sum", TOL[dtype])


def test_unaligned_widths_take_the_loop():
    """K or N not a multiple of 16 bytes: torch._grouped_mm's backward would refuse them."""
    a = torch.randn(6, 30)
    assert not grouped_mm_supported(a, torch.randn(2, 30, 8))
    assert not grouped_mm_supported(torch.randn(6, 32), torch.randn(2, 32, 6))
    assert not grouped_mm_supported(a.double(), torch.randn(2, 30, 8).double())
    assert not grouped_mm_supported(torch.randn(6, 32)[:, ::2], torch.randn(2, 16, 8))


@needs_cpu_gmm
def test_cpu_grouped_mm_compiles():
    """Under torch.compile(fullgraph=True): bfloat16 through torch._grouped_mm, float32 through
    the static loop (the op's fake kernel takes bfloat16 alone); forward and gradients equal to
    eager within rounding."""
    torch._dynamo.reset()
    for dtype in (torch.bfloat16, torch.float32):
        a, w, offsets, expert = _problem(dtype)
        eager = _run(a, w, offsets, expert, "sum")
        torch._dynamo.reset()
        f = torch.compile(grouped_mm, fullgraph=True)
        a_c, w_c = a.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(a_c, w_c.mT, offsets, expert)
        y.sum().backward()
        for x, ref in zip([y, a_c.grad, w_c.grad], eager, strict=True):
            torch.testing.assert_close(x, ref, atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.all(y[sum(COUNTS) :] == 0) and torch.all(a_c.grad[sum(COUNTS) :] == 0)
    torch._dynamo.reset()


@needs_cpu_gmm
def test_torch_impl_layer_grouped_mm_equals_loop(monkeypatch):
    """MoELayer(impl="torch") in float32: the torch._grouped_mm path against the static loop,
    forward and every gradient, through ``y.sum().backward()``."""
    torch.manual_seed(0)
    layer = MoELayer(64, 8, 2, 32, gated=True, impl="torch")
    x = torch.randn(40, 64)

    def grads():
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.sum().backward()
        return [y, xx.grad, layer.router.weight.grad, layer.in_proj.grad, layer.out_proj.grad]

    fast = grads()
    monkeypatch.setattr(expert_ops, "grouped_mm_supported", lambda a, b: False)
    loop = grads()
    for a, b in zip(fast, loop, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
