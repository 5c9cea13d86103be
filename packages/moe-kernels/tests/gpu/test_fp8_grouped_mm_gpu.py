"""``fp8_grouped_mm`` on the GPU: the Triton FP8 kernel (e4m3 ``tl.dot``, each 128-deep K step
summed by the tensor cores, then added in fp32) against the torch reference of the same fp8
values (exact fp32 products): within one rounding of the output plus 2^-12 of the sum of
|products| (sm_90's fp8 MMA accumulates a step with about 13 mantissa bits; on the H100, with
the whole K loop in the MMA, the error reached 5e-3 of the largest output and this bound failed),
per-channel and block scales, gathered
rows with sentinels and sorted rows with a tail; no host sync; bitwise repeatable; a CUDA graph
replays to the eager output after its inputs change in place."""

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
    bound = ULP[torch.bfloat16] * want.abs() + 2.0**-12 * mag + 1e-30
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
