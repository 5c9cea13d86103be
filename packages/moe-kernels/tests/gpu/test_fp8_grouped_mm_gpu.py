"""``fp8_grouped_mm`` on the GPU: the Triton FP8 kernel (e4m3 ``tl.dot``) against the torch
reference of the same fp8 values (exact fp32 products): within one rounding of the output plus a
share of the sum of |products|: 2^-7 where the K loop accumulates in the MMA (per-channel
scales, the default, FBGEMM's fast accumulation: sm_90's fp8 MMA keeps about 13 mantissa bits
over its chained steps) and 2^-12 where each 128-deep step is promoted to fp32 (block scales,
and ``fast_accum=False``); per-channel and block scales, gathered rows with sentinels and sorted
rows with a tail; no host sync; bitwise repeatable; a CUDA graph replays to the eager output
after its inputs change in place."""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import fp8_grouped_mm as ref
from moe_kernels.reference.fp8_rowwise import quantize_rows
from moe_kernels.testing import ULP, forbid_host_sync, gpu_test_device, replay_mismatches

pytestmark = pytest.mark.gpu
DEVICE = gpu_test_device()


def problem(T, E, D, N, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(DEVICE)
    w = (torch.randn(E, N, D, generator=g) / D**0.5).to(DEVICE)
    xq, xs = quantize_rows(x, None, None)
    q = mk.quantize_fp8_weights(w, block=block)
    plan = mk.route(torch.randn(T, E, generator=g).softmax(-1).to(DEVICE), k)
    rows = plan.token_indices.clone()
    rows[::7] = -1
    return xq, xs, q, plan.offsets, rows


@pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("T, E, D, N, k", [(256, 8, 1024, 512, 2), (97, 16, 2048, 768, 8),
                                           (33, 4, 200, 72, 1)])  # fmt: skip
def test_kernel_within_the_reference_bound(T, E, D, N, k, block):
    xq, xs, q, offsets, rows = problem(T, E, D, N, k, block)
    with forbid_host_sync(DEVICE.type == "cuda"):
        y = mk.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, rows, out_dtype=torch.bfloat16)
    want = ref.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, rows, torch.float32)
    mag = ref.fp8_grouped_mm(xq.float().abs().to(xq.dtype), xs, q.weight.float().abs().to(
        q.weight.dtype), q.scale, offsets, rows, torch.float32)  # fmt: skip
    share = 2.0**-12 if block else 2.0**-7  # promoted K steps / fast accumulation
    bound = ULP[torch.bfloat16] * want.abs() + share * mag + 1e-30
    assert ((y.float() - want).abs() <= bound).all()
    again = mk.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, rows, out_dtype=torch.bfloat16)
    assert torch.equal(y, again)


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="needs a CUDA device")
def test_kernel_replays_in_a_cuda_graph():
    xq, xs, q, offsets, rows = problem(128, 8, 512, 256, 2, False)

    def refill(seed):
        def go():
            xq2, xs2, _, off2, rows2 = problem(128, 8, 512, 256, 2, False, seed)
            xq.copy_(xq2)
            xs.copy_(xs2)
            offsets.copy_(off2)
            rows.copy_(rows2)

        return go

    def fn():
        return mk.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, rows)

    assert replay_mismatches(fn, [refill(s) for s in (1, 2)]) == []


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_training_node(gated):
    """``routed_experts(fp8=True)`` in bf16: output and every gradient within FP8's few percent
    of the bf16 node's, no host sync, bitwise repeatable, compiled (fullgraph) equal to eager."""
    g = torch.Generator().manual_seed(5)
    T, D, E, K, H = 512, 1024, 8, 2, 512
    X = 2 * H if gated else H
    x = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    w_in = (torch.randn(E, X, D, generator=g) / D**0.5).to(DEVICE, torch.bfloat16)
    w_out = (torch.randn(E, D, H, generator=g) / H**0.5).to(DEVICE, torch.bfloat16)
    plan = mk.route(torch.randn(T, E, generator=g).softmax(-1).to(DEVICE), K)
    dy = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)

    def step(fn, fp8):
        leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out, plan.weights)]
        y = fn(*leaves[:3], plan._replace(weights=leaves[3]), gated=gated, fp8=fp8)
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    with forbid_host_sync():
        got = step(mk.routed_experts, True)
    assert all(torch.equal(a, b) for a, b in zip(got, step(mk.routed_experts, True), strict=True))
    for a, b in zip(got, step(mk.routed_experts, False), strict=True):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert 1e-3 < rel < 0.1, rel
    torch._dynamo.reset()
    comp = step(torch.compile(mk.routed_experts, fullgraph=True), True)
    assert all(torch.equal(a, b) for a, b in zip(got, comp, strict=True))


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("override", [dict(), dict(fast_accum=False), dict(persistent=True),
                                      dict(persistent=True, block_n=256),
                                      dict(block_n=256, num_stages=4)])  # fmt: skip
def test_sorted_row_variants_within_their_bound(override):
    """The sorted-row launches the GEMM plan chooses between (the launcher's typed ``config=``
    over the plan's choice): the plain grid and the persistent kernel accumulating K in the MMA
    within one output rounding plus 2^-7 of the sum of |products|, the promoted K loop within
    2^-12; repeatable; rows past the last group (a tail of 5) zero, an empty and a one-row
    group among them."""
    from moe_kernels._gemm_plan import fp8_config
    from moe_kernels._triton import fp8_grouped_mm as tri

    xq, xs, q, _, _ = problem(300, 8, 2048, 768, 2, False)
    ends = [0, 10, 50, 51, 120, 190, 190, 260, 295]  # 8 groups over 295 of the 300 rows
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    cfg = fp8_config(xq.shape[0], 768, 2048, False)._replace(**override)
    y = tri.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, None, torch.bfloat16, cfg)
    want = ref.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, None, torch.float32)
    mag = ref.fp8_grouped_mm(xq.float().abs().to(xq.dtype), xs, q.weight.float().abs().to(
        q.weight.dtype), q.scale, offsets, None, torch.float32)  # fmt: skip
    share = 2.0**-7 if cfg.fast_accum or cfg.persistent else 2.0**-12
    assert ((y.float() - want).abs() <= ULP[torch.bfloat16] * want.abs() + share * mag).all()
    assert torch.equal(y[-5:].float(), torch.zeros_like(y[-5:].float()))
    assert torch.equal(y, tri.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, None,
                                             torch.bfloat16, cfg))  # fmt: skip
