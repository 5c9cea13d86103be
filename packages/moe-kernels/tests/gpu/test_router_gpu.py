"""``router_scores`` on the GPU (the "fma" kernel up to 32 experts, the "split" bf16 tensor-core
GEMMs past that) against float64:

* forward, softmax and sigmoid: every score within a rigorous bound of the float64 scores
  (``oracle_router_scores``: the logits' fp32 summation error in any order, doubled for
  tensor-core accumulation, moved through softmax, plus exp / divide slack: the GPU's exp is
  ``ex2.approx`` of a rounded argument); the top-8 experts the float64 scores' except at
  near-ties; bitwise repeatable; outputs poisoned; no host sync;
* forward + backward at training sizes: scores, dx and dw within 1e-4 / 1e-2 / 1e-4 (max error
  over max value) of float64, where bf16 logits are 4e-3 to 1e-2 off (docs/training.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_kernels as mk
from moe_kernels.testing import (
    bits_equal,
    forbid_host_sync,
    gpu_test_device,
    oracle_router_scores,
    poison,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
U = 2.0**-24


def bounds(x: torch.Tensor, w: torch.Tensor, score_fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 scores, the elementwise bound on |fp32 scores - float64 scores|):
    ``oracle_router_scores``'s logit bound, doubled (tensor cores may truncate where the fp32 GEMM
    rounds), moved through softmax or sigmoid, plus exp / divide slack."""
    exact, dl = oracle_router_scores(x, w, score_fn)
    dl = 2 * dl
    logits = x.double() @ w.double().T
    if score_fn == "softmax":
        spread = logits.amax(dim=1, keepdim=True) - logits
        bound = exact * (dl + dl.amax(dim=1, keepdim=True) + 32 * U + 4 * U * spread)
    else:
        bound = exact * (dl + 32 * U + 4 * U * logits.abs())
    return exact, bound + 1e-30


@pytest.mark.parametrize("T,E", [(512, 16), (2048, 128), (4096, 256)])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_scores_within_the_float64_bound(T, E, score_fn):
    D = 2048
    g = torch.Generator(device=DEV).manual_seed(T + E)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    w = torch.randn(E, D, device=DEV, generator=g) / D**0.5  # the model's init
    exact, bound = bounds(x, w, score_fn)
    poison(4 * T * E, device=DEV)  # 0xFF: NaN in fp32
    with forbid_host_sync(ON_GPU):
        y = mk.router_scores(x, w, score_fn=score_fn)
    assert bool(torch.isfinite(y).all())
    over = ((y.double() - exact).abs() - bound).max().item()
    assert over <= 0, f"a score {over:.2e} beyond its bound"
    assert bits_equal(y, mk.router_scores(x, w, score_fn=score_fn)), "not repeatable"
    k = 8
    picked = y.topk(k, dim=1).indices
    want_vals, want_idx = exact.topk(k, dim=1)
    differ = (picked.sort(dim=1).values != want_idx.sort(dim=1).values).any(dim=1)
    near_tie = exact.gather(1, picked) >= want_vals[:, -1:] - 2 * bound.amax(dim=1, keepdim=True)
    assert not bool((differ & ~near_tie.all(dim=1)).any()), "top-8 differs beyond near-ties"


@pytest.mark.parametrize("T,D,E", [(2048, 2048, 16), (4096, 2048, 128)])
def test_training_step_near_float64(T, D, E):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, D, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(E, D, device=DEV, generator=g) / D**0.5
    ds = torch.randn(T, E, device=DEV, generator=g)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    sd = torch.softmax(F.linear(xd, wd), -1)
    sd.backward(ds.double())
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    s = mk.router_scores(xs, ws)
    s.backward(ds)
    pairs = ((s.detach(), sd.detach()), (xs.grad, xd.grad), (ws.grad, wd.grad))
    errs = [float((a.double() - b).abs().max() / b.abs().max()) for a, b in pairs]
    assert errs[0] <= 1e-4 and errs[1] <= 1e-2 and errs[2] <= 1e-4, errs
    assert xs.grad.dtype == torch.bfloat16 and ws.grad.dtype == torch.float32
