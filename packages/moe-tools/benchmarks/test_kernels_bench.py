"""Each moe-kernels op of the op registry at its benchmark shapes (full on CUDA, quick on CPU);
the torch-native time, a same-bytes clone and the copy ceiling (CUDA) go into extra_info."""

from __future__ import annotations

import pytest
import torch

from moe_tools import kernels
from moe_tools.ops import REGISTRY
from moe_tools.timing import bench_us

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SIZE_CLASS = "full" if CUDA else "quick"
CASES = [(name, i) for name, spec in REGISTRY.items() for i in range(len(spec.sizes[SIZE_CLASS]))]


@pytest.fixture(scope="module")
def ceiling_gbps() -> float | None:
    return kernels.copy_ceiling_gbps(DEVICE) if CUDA else None


@pytest.mark.parametrize(("op", "index"), CASES, ids=[f"{op}-{i}" for op, i in CASES])
def test_kernel(benchmark, sync, ceiling_gbps, op, index):
    spec = REGISTRY[op]
    gen = torch.Generator(device=DEVICE).manual_seed(index)
    with torch.no_grad():
        problem = spec.make(spec.sizes[SIZE_CLASS][index], gen, DEVICE)
        fn = spec.thunk(problem)
        try:
            fn()
        except Exception as exc:
            pytest.skip(f"unavailable: {exc}")

        def call() -> None:
            fn()
            sync()

        benchmark.pedantic(call, rounds=20 if CUDA else 3, iterations=1, warmup_rounds=1)
        us = bench_us(fn, DEVICE)
        native = bench_us(spec.native(problem), DEVICE) if spec.native is not None else None
        nbytes = spec.bytes_moved(problem)
        clone = bench_us(kernels.clone_buffer(nbytes, DEVICE).clone, DEVICE) if CUDA else None
    gbps = nbytes / us / 1e3
    benchmark.extra_info.update(
        op=op,
        shape=problem.label,
        bytes=nbytes,
        median_us=us,
        gbps=gbps,
        pct_ceiling=100 * gbps / ceiling_gbps if ceiling_gbps else None,
        clone_us=clone,
        vs_clone=clone / us if clone else None,
        torch_us=native,
        speedup=native / us if native else None,
        path="triton" if CUDA else "reference",
    )
