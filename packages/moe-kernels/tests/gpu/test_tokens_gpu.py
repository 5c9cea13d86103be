"""The token-movement ops on the GPU (``dispatch``, ``combine``, ``gather_scale_dense_tokens``,
``scatter_add_dense_tokens``), bit for bit against the reference run on the same device
(``moe_kernels.reference.tokens``): outputs poisoned with NaN first, calls under the no-sync
guard, a plan with a tail of unrouted (-1) rows, fp32 / bf16 / fp16 tokens, odd widths; a
CUDA graph replayed on new tokens and scores; ``torch.compile(fullgraph=True)`` == eager.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import tokens as ref
from moe_kernels.testing import (
    bits_equal,
    compile_fresh,
    forbid_host_sync,
    gpu_test_device,
    poison,
    replay_mismatches,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]


def problem(T, D, k, E, dtype, seed):
    """(x, a plan over experts [1, E - 1) (a tail of -1 rows), the softmax scores)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    probs = torch.randn(T, E, device=DEV, generator=g).softmax(-1)
    plan = mk.route(probs, k, expert_index_start=1, expert_index_end=E - 1)
    return x, plan, probs


@pytest.mark.parametrize(
    "T,D,k,E,dtype",
    [(4096, 2048, 8, 16, torch.bfloat16), (300, 130, 4, 8, torch.float32),
     (257, 33, 2, 5, torch.float16)],
)  # fmt: skip
def test_token_ops_match_the_reference(T, D, k, E, dtype):
    T = T if ON_GPU else min(T, 64)
    x, plan, probs = problem(T, D, k, E, dtype, T + D)
    tok, exp, w = plan.token_indices, plan.expert_indices, plan.weights
    vtc = (tok >= 0).sum().reshape(1).int()
    assert int(vtc) < tok.shape[0], "the plan must hold unrouted rows"
    g = torch.Generator(device=DEV).manual_seed(1)
    acc = torch.randn(T, D, device=DEV, generator=g)
    acc_bf = torch.randn(T, D, device=DEV, generator=g).to(torch.bfloat16)
    acc_in, acc_bf_in = acc.clone(), acc_bf.clone()
    poison(tok.shape[0] * D * 4, device=DEV)  # 0xFF: NaN in every float dtype
    with forbid_host_sync(ON_GPU):
        gathered = mk.gather_scale_dense_tokens(x, tok, exp, probs, vtc)
        rows = mk.dispatch(x, plan)
        scaled = mk.dispatch(x, plan, scale=True)
        combined = mk.combine(scaled, plan, weighted=True)
        unweighted = mk.combine(rows, plan, weighted=False, out_dtype=torch.float32)
        mk.scatter_add_dense_tokens(acc, scaled, tok, vtc)
        mk.scatter_add_dense_tokens(acc_bf, scaled, tok)
    assert bits_equal(gathered, ref.gather_scale_dense_tokens(x, tok, exp, probs, vtc))
    assert bits_equal(rows, ref.dispatch(x, tok, w, False))
    assert bits_equal(scaled, ref.dispatch(x, tok, w, True))
    assert bits_equal(combined, ref.combine(scaled, plan.inverse, w, True, dtype))
    assert bits_equal(unweighted, ref.combine(rows, plan.inverse, w, False, torch.float32))
    ref.scatter_add_dense_tokens(acc_in, scaled, tok, vtc)
    ref.scatter_add_dense_tokens(acc_bf_in, scaled, tok, None)
    assert bits_equal(acc, acc_in) and bits_equal(acc_bf, acc_bf_in)
    assert not any(t.isnan().any() for t in (gathered, rows, scaled, combined))
    again = acc_in.clone()
    acc.copy_(again)
    mk.scatter_add_dense_tokens(acc, scaled, tok, vtc)
    mk.scatter_add_dense_tokens(again, scaled, tok, vtc)
    assert bits_equal(acc, again), "scatter-add is not deterministic"


@pytest.mark.parametrize("T,D", [(500, 130), (4096, 2048)])
def test_scatter_add_fp32_from_bf16_with_dead_rows(T, D):
    T = T if ON_GPU else min(T, 64)
    g = torch.Generator(device=DEV).manual_seed(7)
    n = T * 8
    tok = torch.randint(-1, T, (n,), device=DEV, generator=g, dtype=torch.int32)
    src = torch.randn(n, D, device=DEV, generator=g).to(torch.bfloat16)
    out = torch.randn(T, D, device=DEV, generator=g)
    want = out.clone()
    vtc = torch.tensor([n - 5], device=DEV)
    mk.scatter_add_dense_tokens(out, src, tok, vtc)
    ref.scatter_add_dense_tokens(want, src, tok, vtc)
    assert bits_equal(out, want)


def test_graph_replay_and_compile():
    T, D, k, E = (512, 256, 4, 8) if ON_GPU else (64, 32, 4, 8)
    g = torch.Generator(device=DEV).manual_seed(3)
    probs = torch.randn(T, E, device=DEV, generator=g).softmax(-1)
    plan = mk.route(probs, k)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    out = torch.zeros(T, D, device=DEV)
    tok, exp = plan.token_indices, plan.expert_indices

    def step():
        out.zero_()
        xs = mk.dispatch(x, plan)
        gs = mk.gather_scale_dense_tokens(x, tok, exp, probs)
        mk.scatter_add_dense_tokens(out, gs, tok)
        return mk.combine(xs, plan), gs, out

    def expected():
        gs = ref.gather_scale_dense_tokens(x, tok, exp, probs)
        acc = torch.zeros_like(out)
        ref.scatter_add_dense_tokens(acc, gs, tok)
        xs = ref.dispatch(x, tok, plan.weights, False)
        return ref.combine(xs, plan.inverse, plan.weights, True, x.dtype), gs, acc

    if ON_GPU:

        def refill():
            x.copy_(torch.randn_like(x))
            probs.copy_(torch.rand_like(probs))

        assert not replay_mismatches(step, [refill, refill], expected)

    def fn(x, probs, out, plan):
        xs = mk.dispatch(x, plan, scale=True)
        gs = mk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
        mk.scatter_add_dense_tokens(out, gs, plan.token_indices)
        return mk.combine(xs * 2, plan, weighted=False), out * 1

    o1, o2 = torch.zeros_like(out), torch.zeros_like(out)
    want = fn(x, probs, o1, plan)
    got = compile_fresh(fn)(x, probs, o2, plan)
    assert bits_equal(got, want) and bits_equal(o1, o2)
