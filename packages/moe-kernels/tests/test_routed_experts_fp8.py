"""``routed_experts(fp8=True)``, FP8 training: the forward and its gradients against a float64
oracle of the quantised chain written here from the formulas (FBGEMM's row-wise e4m3: s = 448 /
max(amax, 1e-12), q = e4m3(clamp(v s)), dequantised q / s; activations and output gradients per
row, the weights per output channel, the transposed weights per output channel of the
transpose; bf16-free: fp32 rows, so the only roundings are the e4m3 ones), bitwise repeatable,
close to the unquantised op, and bad arguments named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_kernels as mk

FP8 = torch.float8_e4m3fn
T, D, E, K, H = 40, 64, 6, 2, 48


def deq_rows(v: torch.Tensor) -> torch.Tensor:
    """v's rows quantised to e4m3 with row-wise scales and dequantised, float64."""
    v = v.double()
    s = 448.0 / v.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12).double()
    return (v * s).clamp(-448, 448).float().to(FP8).double() / s


def act(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.silu(h)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def oracle(x, w_in, w_out, plan, dy, gated):
    """(y, dx, dw_in, dw_out, ds) in float64 from the formulas (module docstring)."""
    x, w_in, w_out, dy = (t.double() for t in (x, w_in, w_out, dy))
    rows, offs = plan.token_indices.long(), plan.offsets.long()
    s_R = plan.weights.double()
    R = rows.shape[0]
    expert_R = torch.full((R,), -1, dtype=torch.long)
    for e in range(E):
        expert_R[offs[e] : offs[e + 1]] = e
    live = (expert_R >= 0) & (rows >= 0)
    tok = rows.clamp_min(0)
    xs = torch.where(live[:, None], x[tok], 0.0)
    q_in, q_out = deq_rows(w_in), deq_rows(w_out)  # per output channel (rows of w[e])
    q_in_t, q_out_t = deq_rows(w_in.mT), deq_rows(w_out.mT)  # the transposes' channels
    e_R = expert_R.clamp_min(0)
    h = torch.einsum("rd,rxd->rx", deq_rows(xs), q_in[e_R])
    a = act(h, gated)
    o = torch.einsum("rh,rdh->rd", deq_rows(a), q_out[e_R]) * live[:, None]
    y = torch.zeros_like(x).index_add_(0, tok, s_R[:, None] * o * live[:, None])
    dyg = dy[tok] * live[:, None]
    da = torch.einsum("rd,rhd->rh", deq_rows(dyg), q_out_t[e_R])
    hv = h.detach().requires_grad_()
    (dh,) = torch.autograd.grad(act(hv, gated), hv, s_R[:, None] * da)
    ds = (da * a).sum(-1) * live
    dx_R = torch.einsum("rx,rdx->rd", deq_rows(dh), q_in_t[e_R]) * live[:, None]
    dx = torch.zeros_like(x).index_add_(0, tok, dx_R)
    dw_out = torch.zeros_like(w_out).index_add_(
        0, e_R, dyg[:, :, None] * (s_R[:, None] * a)[:, None, :] * live[:, None, None]
    )
    dw_in = torch.zeros_like(w_in).index_add_(
        0, e_R, (dh * live[:, None])[:, :, None] * xs[:, None, :]
    )
    return y, dx, dw_in, dw_out, ds


def problem(gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = 2 * H if gated else H
    x = torch.randn(T, D, generator=g)
    w_in = torch.randn(E, X, D, generator=g) / D**0.5
    w_out = torch.randn(E, D, H, generator=g) / H**0.5
    plan = mk.route(torch.randn(T, E, generator=g).softmax(-1), K)
    dy = torch.randn(T, D, generator=g)
    return x, w_in, w_out, plan, dy


def run(x, w_in, w_out, plan, dy, gated, fp8=True):
    leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out, plan.weights)]
    y = mk.routed_experts(*leaves[:3], plan._replace(weights=leaves[3]), gated=gated, fp8=fp8)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


@pytest.mark.parametrize("gated", [False, True])
def test_forward_and_gradients_match_the_oracle_and_repeat(gated):
    x, w_in, w_out, plan, dy = problem(gated)
    got = run(x, w_in, w_out, plan, dy, gated)
    again = run(x, w_in, w_out, plan, dy, gated)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    y, dx, dw_in, dw_out, ds = oracle(x, w_in, w_out, plan, dy, gated)
    # fp32 rows: the same e4m3 values as the oracle's, fp32 sums (measured 1-3e-7 on the
    # reference path and in the interpreter; the unquantised op is 4-7e-2 away).
    for name, a, b in zip(("y", "dx", "dw_in", "dw_out", "ds"), got,
                          (y, dx, dw_in, dw_out, ds), strict=True):  # fmt: skip
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < 1e-5, (name, err)


def test_close_to_the_unquantised_op_and_not_equal():
    """FP8 operands move every output and gradient by a few percent of its norm: not more (a
    wrong scale or transpose would), and not zero (the GEMMs did run on e4m3 values)."""
    x, w_in, w_out, plan, dy = problem(True, seed=3)
    got = run(x, w_in, w_out, plan, dy, True)
    want = run(x, w_in, w_out, plan, dy, True, fp8=False)
    for a, b in zip(got, want, strict=True):
        rel = float((a - b).norm() / b.norm())
        assert 1e-3 < rel < 0.1, rel


def test_without_autograd_the_same_forward():
    x, w_in, w_out, plan, dy = problem(False)
    with torch.no_grad():
        y = mk.routed_experts(x, w_in, w_out, plan, fp8=True)
    assert torch.equal(y, run(x, w_in, w_out, plan, dy, False)[0])


def test_fp8_must_be_a_bool():
    x, w_in, w_out, plan, _ = problem(False)
    with pytest.raises(TypeError, match="fp8"):
        mk.routed_experts(x, w_in, w_out, plan, fp8=1)
