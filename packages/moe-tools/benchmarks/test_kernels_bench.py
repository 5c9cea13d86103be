"""Each moe-kernels op at the `moe-bench kernels` shapes (full on CUDA, small on CPU); the
torch-native time, a same-bytes clone and the copy ceiling go into extra_info."""

from __future__ import annotations

import pytest
import torch

from moe_tools import kernels
from moe_tools.timing import bench_us

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

QUICK = not CUDA
_FAMILY = {
    "route": "route",
    "index_shuffling": "route",
    "dispatch": "tokens",
    "gather_scale": "tokens",
    "combine": "tokens",
    "scatter_add": "tokens",
    "blocked_2d": "blocked_2d",
    "blocked_3d": "blocked_3d",
    "to_mxfp8": "quant",
    "to_mxfp8_dim1": "quant",
    "from_mxfp8": "quant",
}
CASES = [(op, i) for op in kernels.OPS for i in range(len(kernels.shapes(QUICK)[_FAMILY[op]]))]


@pytest.fixture(scope="module")
def ceiling_gbps() -> float:
    return kernels.copy_ceiling_gbps(DEVICE)


def _case(op: str, index: int) -> kernels.Case:
    gen = torch.Generator(device=DEVICE).manual_seed(index)
    for i, case in enumerate(c for c in kernels.all_cases(DEVICE, QUICK, gen, [op])):
        if i == index:
            return case
    raise LookupError((op, index))


@pytest.mark.parametrize(("op", "index"), CASES, ids=[f"{op}-{i}" for op, i in CASES])
def test_kernel(benchmark, sync, ceiling_gbps, op, index):
    case = _case(op, index)
    fn = case.impls.get("moe_kernels")
    if fn is None:
        pytest.skip(f"unavailable: {case.unavailable.get('moe_kernels')}")

    def call() -> None:
        fn()
        sync()

    with torch.no_grad():
        call()
        benchmark.pedantic(call, rounds=20 if CUDA else 3, iterations=1, warmup_rounds=1)
        us = bench_us(fn, DEVICE)
        native = bench_us(case.impls["torch"], DEVICE) if "torch" in case.impls else None
        clone = kernels.clone_us(case.nbytes, DEVICE)
    gbps = case.nbytes / us / 1e3
    benchmark.extra_info.update(
        op=op,
        shape=case.shape,
        bytes=case.nbytes,
        median_us=us,
        gbps=gbps,
        pct_ceiling=100 * gbps / ceiling_gbps,
        clone_us=clone,
        vs_clone=clone / us,
        torch_us=native,
        speedup=native / us if native else None,
    )
