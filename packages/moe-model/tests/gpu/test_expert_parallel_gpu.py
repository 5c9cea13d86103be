"""``ExpertParallelMoE`` on two GPUs (NCCL, ``NCCL_NVLS_ENABLE=0``; skipped with fewer): each
rank's forward and backward against one GPU's ``MoELayer`` (all experts) on the same tokens, in
both exchange modes, nothing dropped (capacity factor E / k): the output, dx and the local
experts' weight gradients within 2e-2 (bf16) of the single-GPU layer's; no host sync in the
padded mode's forward; the padded forward captured in a CUDA graph and replayed on new tokens
equals eager; the device guard (the layer and tokens on cuda:r while the current device is the
other GPU: the same bits, nothing allocated on the current device).

The two-rank CPU version (gloo) with every option: ``tests/test_expert_parallel.py``; timings:
``benchmarks/gpu/ep_gpu.py``.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_kernels.testing import bits_equal, capture, forbid_host_sync
from moe_model import ExpertParallelMoE, MoELayer

WORLD = 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < WORLD
        or not dist.is_available() or not dist.is_nccl_available(),
        reason=f"needs {WORLD} CUDA devices and NCCL",
    ),
]  # fmt: skip
T, E, K, D, H = 512, 16, 4, 256, 128  # tokens per rank, experts, top-k, d_model, hidden
TOL = 2e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def tokens(dev, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, D, generator=g).to(dev, torch.bfloat16)


def make_layer(dev, impl: str, gated: bool) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D, E, K, H, gated=gated, impl=impl, device=dev, dtype=torch.bfloat16)


def check_equality(fails, dev, rank, impl, gated, mode) -> None:
    full = make_layer(dev, impl, gated)
    ep = ExpertParallelMoE(copy.deepcopy(full), mode=mode, capacity_factor=E / K)
    xs = [tokens(dev, s) for s in range(WORLD)]
    tag = f"{impl} gated={gated} {mode}"
    with torch.no_grad():
        with forbid_host_sync(mode == "padded"):
            y = ep(xs[rank])
        err = rel_err(y, full(xs[rank]))
    if err > TOL:
        fails.append(f"{tag}: forward {err:.2e}")
    full.requires_grad_(True)
    ep.requires_grad_(True)
    dy = torch.cos(torch.arange(T * D, device=dev, dtype=torch.float32)).view(T, D)
    x = xs[rank].clone().requires_grad_()
    (ep(x).float() * dy).sum().backward()
    whole = torch.cat(xs).requires_grad_()
    (full(whole).float() * torch.cat([dy] * WORLD)).sum().backward()
    lo, hi = ep.expert_start, ep.expert_end
    errs = {
        "dx": rel_err(x.grad, whole.grad[rank * T : (rank + 1) * T]),
        "d in_proj": rel_err(ep.in_proj.grad, full.in_proj.grad[lo:hi]),
        "d out_proj": rel_err(ep.out_proj.grad, full.out_proj.grad[lo:hi]),
    }
    fails += [f"{tag}: {n} {e:.2e}" for n, e in errs.items() if e > TOL]


def check_graph_replay(fails, dev, rank) -> None:
    full = make_layer(dev, "triton_bf16", False).requires_grad_(False)
    ep = ExpertParallelMoE(copy.deepcopy(full), mode="padded", capacity_factor=1.25)
    x = tokens(dev, rank)
    with torch.no_grad():
        graph, y_static = capture(lambda: ep(x), warmup=2)
        new = tokens(dev, rank + 17)
        want = ep(new).clone()
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
    if not bits_equal(y_static, want):
        fails.append("padded graph replay != eager on new tokens")


def check_device_guard(fails, dev, rank) -> None:
    other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
    full = make_layer(dev, "triton_bf16", True).requires_grad_(True)
    for mode in ("dropless", "padded"):
        ep = ExpertParallelMoE(copy.deepcopy(full), mode=mode, capacity_factor=2.0)
        x = tokens(dev, rank).requires_grad_()
        y_home = ep(x)
        y_home.float().sum().backward()
        g_home = x.grad.clone()
        x.grad = None
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(other)
        torch.cuda.set_device(other)
        try:
            y = ep(x)
            y.float().sum().backward()
            torch.cuda.synchronize(dev)
            after = torch.cuda.memory_allocated(other)
        finally:
            torch.cuda.set_device(dev)
        if not (bits_equal(y, y_home) and bits_equal(x.grad, g_home) and after == before):
            fails.append(f"device guard {mode}: {after - before} bytes on the current device")


def _worker(rank: int, store: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (before NCCL starts)
    importlib.import_module("torch._dynamo")  # before the group: docs/expert_parallel.md
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("nccl", store, rank=rank, world_size=WORLD, timeout=timeout)
    fails: list[str] = []
    try:
        for impl in ("triton_bf16", "torch"):
            for gated in (False, True):
                for mode in ("dropless", "padded"):
                    check_equality(fails, dev, rank, impl, gated, mode)
        check_graph_replay(fails, dev, rank)
        check_device_guard(fails, dev, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not fails, f"rank {rank}: " + "; ".join(fails)


def test_expert_parallel_on_two_gpus(tmp_path):
    store = (tmp_path / "store").as_uri()  # the group meets in a file: no port to pick
    mp.spawn(_worker, args=(store,), nprocs=WORLD, join=True)
