"""The pytest-benchmark suite: full sizes on CUDA, tiny ones on CPU (so it passes anywhere).

Run it with ``nox -s benchmarks`` (JSON: ``benchmarks/results/<machine>/pytest-benchmark.json``) or
``pytest packages/moe-tools/benchmarks --benchmark-json=out.json``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_tools.env import environment

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE.type == "cuda"


def pytest_benchmark_update_machine_info(config: object, machine_info: dict) -> None:
    """Put the moe-bench environment (torch, triton, GPU, package versions) into the JSON."""
    machine_info["moe_bench"] = environment(DEVICE)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def sync() -> Callable[[], None]:
    """Wait for the GPU (a no-op on CPU): every timed function ends with it."""
    if CUDA:
        return lambda: torch.cuda.synchronize(DEVICE)
    return lambda: None
