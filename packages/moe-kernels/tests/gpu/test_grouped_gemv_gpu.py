"""The grouped GEMV (a decode step's expert GEMMs) on the GPU at Qwen3-30B-A3B's shape (d 2048,
expert hidden 768, SwiGLU, 128 experts, top-8), T = 1, 2, 8 tokens:

* the plan runs it (``plan_gather_mlp``), and ``expert_mlp``'s no-grad forward lies within the
  float64 rows' rounding bound (``oracle_expert_mlp_rows``, the rule ``moe-bench verify``
  applies), rows past the plan zero, outputs poisoned first, no host sync;
* bitwise repeatable, and batch invariant on the device: each token's rows hold the same bits
  computed alone and among the others (an MMA's rows are independent);
* a CUDA graph of the forward replays to the eager bits after its inputs change in place;
* skewed routing (64 rows on one expert: four 16-row chunks) against the tile GEMM's launcher
  within one bf16 rounding of each side.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels._dispatch import triton_kernels
from moe_kernels._gemm_plan import plan_gather_mlp
from moe_kernels.testing import (
    bits_equal,
    bound_violations,
    execution_path,
    forbid_host_sync,
    gpu_test_device,
    oracle_expert_mlp_rows,
    poison,
    replay_mismatches,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
D, H, E, K = (2048, 768, 128, 8) if ON_GPU else (64, 32, 16, 8)


def problem(T: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.randn(T, E, device=DEV, generator=g).softmax(-1)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    w_in = (torch.randn(E, 2 * H, D, device=DEV, generator=g) / D**0.5).bfloat16()
    w_out = (torch.randn(E, D, H, device=DEV, generator=g) / H**0.5).bfloat16()
    return scores, x, w_in, w_out


def forward(x, w_in, w_out, plan):
    with torch.no_grad():
        return mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                             gated=True)  # fmt: skip


@pytest.mark.parametrize("T", [1, 2, 8])
def test_within_the_rounding_bound_no_sync_repeatable(T):
    scores, x, w_in, w_out = problem(T)
    plan = mk.route(scores, K)
    want = "reference" if execution_path(DEV) == "reference" else "gemv"
    assert plan_gather_mlp(x, w_in, plan.token_indices).kernel == want
    for _ in range(2):  # the first launch compiles, the second takes the cached handle
        poison(T * K * D * 2, device=DEV)  # 0xFF: NaN in bf16
        with forbid_host_sync(ON_GPU):
            y = forward(x, w_in, w_out, plan)
        exact, bound = oracle_expert_mlp_rows(x, w_in, w_out, plan.offsets, plan.token_indices,
                                              True)  # fmt: skip
        check = bound_violations(y, exact, bound)
        assert check.bad == 0, check
    assert bits_equal(y, forward(x, w_in, w_out, plan)), "not repeatable"


def test_batch_invariant_on_the_device():
    """Each of 8 tokens' outputs: the same bits routed alone (T = 1) as among the 8."""
    scores, x, w_in, w_out = problem(8, seed=1)
    plan = mk.route(scores, K)
    y = forward(x, w_in, w_out, plan)
    for t in range(8):
        alone = mk.route(scores[t : t + 1], K)
        y1 = forward(x[t : t + 1], w_in, w_out, alone)
        assert bits_equal(y1[alone.inverse[0].long()], y[plan.inverse[t].long()]), t


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_cuda_graph_replays_to_the_eager_bits():
    scores, x, w_in, w_out = problem(4, seed=2)
    plan = mk.route(scores, K)
    g = torch.Generator(device=DEV).manual_seed(3)

    def refill():
        x.copy_(torch.randn(x.shape, device=DEV, generator=g).bfloat16())
        new = mk.route(torch.randn(scores.shape, device=DEV, generator=g).softmax(-1), K)
        for dst, src in zip(plan, new, strict=True):
            dst.copy_(src)

    assert replay_mismatches(lambda: forward(x, w_in, w_out, plan), [refill] * 3) == []


@pytest.mark.skipif(DEV is None or execution_path(DEV) == "reference", reason="the kernels")
def test_skewed_routing_against_the_tile_gemm():
    """64 rows on one expert (and none on the others): four chunks of the GEMV's 16 rows, against
    the tile GEMM's launcher, within one bf16 rounding of each side."""
    _, x, w_in, _ = problem(64, seed=4)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=DEV)
    offsets[6:] = 64
    rows = torch.arange(64, dtype=torch.int32, device=DEV).flip(0)
    gemv = triton_kernels("grouped_gemv").grouped_gemv(x, w_in, offsets, rows, "silu")
    tile = triton_kernels("grouped_mm")
    want = tile.gather_grouped_mm(x, w_in, offsets, rows, tile.ACT_SILU).float()
    err = (gemv.float() - want).abs()
    assert bool((err <= 2.0**-7 * want.abs() + 1e-3).all()), float(err.max())
