"""The eager autograd path (``KernelOp.register_autograd``): what plain-eager CUDA calls that
record gradients run instead of the registered op. Called directly here (on CPU the public
functions take the op), it must give the op's outputs and gradients bit for bit, and
``KernelOp.route`` must choose it only for plain eager CUDA calls that record gradients.

Runs on the reference path and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels import activation, dense_tokens, grouped_mm, router, routing, tokens

T, E, K, D, H = 9, 6, 2, 16, 8


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _run(fn, inputs, seed=3):
    """Outputs and the gradients of the float inputs, for a random upstream gradient on each
    float output."""
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs[0]]
    outs = fn(*ins, *inputs[1])
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum(
        (o * torch.randn(o.shape, generator=_g(seed + i))).sum()
        for i, o in enumerate(outs)
        if o.is_floating_point()
    )
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in ins if t.is_floating_point()]


def _cases():
    s = torch.rand(T, E, generator=_g(0))
    plan = mk.route(s, K)
    x = torch.randn(T, D, generator=_g(1))
    y = torch.randn(T * K, D, generator=_g(2))
    w = torch.randn(E, H, D, generator=_g(4)) / D**0.5
    h = torch.randn(T, 2 * H, generator=_g(5))
    rw = torch.randn(E, D, generator=_g(6))
    scores = torch.rand(T, E, generator=_g(7))
    out = torch.randn(T, D, generator=_g(8))
    cases = {
        "route": (routing.route_op, ((s,), (K, None, 0, E, True, None, 1, 1, 1.0))),
        "router_scores": (router.router_scores_op, ((x, rw), ("softmax",))),
        "combine": (tokens.combine_op, ((y, plan.inverse, plan.token_indices, plan.weights),
                                        (True, torch.float32))),
        "dispatch": (tokens.dispatch_op, ((x, plan.token_indices, plan.weights, plan.inverse),
                                          (True,))),
        "gather_grouped_mm": (grouped_mm.gather_grouped_mm_op,
                              ((x, w, plan.offsets, plan.token_indices), ("silu",))),
        "expert_activation": (activation.expert_activation_op, ((h,), (True,))),
        "gather_scale_dense_tokens": (dense_tokens.gather_scale_dense_tokens_op,
                                      ((x, plan.token_indices, plan.expert_indices, scores),
                                       (None,))),
        "scatter_added_dense_tokens": (dense_tokens.scatter_added_dense_tokens_op,
                                       ((out, y, plan.token_indices), (None,))),
    }  # fmt: skip
    return {name: (kop.op, kop.eager_autograd, inputs) for name, (kop, inputs) in cases.items()}


@pytest.mark.parametrize("name", list(_cases()))
def test_eager_autograd_equals_the_op(name):
    op, eager, inputs = _cases()[name]
    want, got = _run(op, inputs), _run(eager, inputs)
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_route():
    op = activation.expert_activation_op  # has an eager autograd path
    no_autograd = activation.expert_activation_backward_op
    cpu = torch.zeros(2, requires_grad=True)
    assert op.route(cpu, True) == "op"  # CPU: the registered op
    if torch.cuda.is_available():
        t = torch.zeros(2, device="cuda")
        assert op.route(t, None) == "impl"
        assert op.route(t.requires_grad_()) == "eager_autograd"
        assert op.route(torch.nn.Parameter(t)) == "eager_autograd"
        assert no_autograd.route(t, t) == "op"
        with torch.no_grad():
            assert op.route(t) == "impl"
