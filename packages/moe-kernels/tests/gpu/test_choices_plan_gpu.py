"""``plan_from_choices`` on the GPU: the one-program kernel (up to ``MAX_PAIRS`` pairs) gives
the torch reference's plan bit for bit (a decode step's sizes, sentinels, an expert range, int32
and int64 indices), without a host sync, and a CUDA graph of it replays to the eager plan after
its inputs change in place; past ``MAX_PAIRS`` the reference runs."""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.choices_plan import MAX_PAIRS
from moe_kernels.reference import choices_plan as ref
from moe_kernels.testing import forbid_host_sync, gpu_test_device, replay_mismatches

pytestmark = pytest.mark.gpu
DEVICE = gpu_test_device()
FIELDS = ("counts", "offsets", "expert_indices", "token_indices", "inverse", "weights")


def choices(T: int, k: int, E: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[::5, -1] = -1  # expert-parallel sentinels
    idx[1::7, 0] = E + 3
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    return idx.to(dtype).to(DEVICE), w.to(DEVICE)


@pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("T, k, E, lo, hi", [(1, 8, 128, 0, 128), (32, 8, 128, 0, 128),
                                             (64, 8, 256, 64, 192), (512, 8, 64, 0, 64),
                                             (600, 8, 64, 0, 64)])  # fmt: skip
def test_kernel_plan_is_the_reference_plan(T, k, E, lo, hi, dtype):
    idx, w = choices(T, k, E, dtype, T * k + E)
    with forbid_host_sync(DEVICE.type == "cuda"):
        plan = mk.plan_from_choices(idx, w, E, expert_index_start=lo, expert_index_end=hi)
    want = ref.plan_from_choices(idx, w, lo, hi - lo)
    for name, b in zip(FIELDS, want[:4] + (want[4], want[5]), strict=True):
        assert torch.equal(getattr(plan, name), b), (name, T * k <= MAX_PAIRS)


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="needs a CUDA device")
def test_kernel_plan_replays_in_a_cuda_graph():
    idx, w = choices(32, 8, 128, torch.int64, 0)

    def refill(seed):
        def go():
            i2, w2 = choices(32, 8, 128, torch.int64, seed)
            idx.copy_(i2)
            w.copy_(w2)

        return go

    def fn():
        return tuple(mk.plan_from_choices(idx, w, 128))

    assert replay_mismatches(fn, [refill(s) for s in (1, 2, 3)]) == []
