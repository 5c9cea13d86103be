"""Every public op compiled with ``fullgraph=True`` in a fresh interpreter before any eager call,
then run eager and compared bit for bit (``moe_kernels.testing.cold_compile``).

A module-level cache that a traced frame fills on its first call (the device-capability memo
was one: compiling the layer from a cold process crashed on CUDA) fails only in a cold process;
in one whose caches an eager call already filled, as in the other tests, the program compiles.
CPU (CI): one process for all ops, on the reference path or, under ``TRITON_INTERPRET=1``, the
interpreter. CUDA (``-m gpu``): one process per op, several at a time.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest
import torch

import moe_kernels as mk
from moe_kernels.testing import FreshRun, fresh_runs, op_problems, run_fresh

COLD = "from moe_kernels.testing import cold_main; cold_main()"
NAMES = list(op_problems("cpu"))


def test_every_public_op_has_a_problem():
    """A new public op gets a compile-from-cold check: a problem named after it."""
    ops = [n for n in mk.__all__ if inspect.isfunction(getattr(mk, n))]
    missing = [op for op in ops if not any(p == op or p.startswith(op + "_") for p in NAMES)]
    assert not missing, f"add these ops to moe_kernels.testing.op_problems: {missing}"


def test_every_op_compiles_cold_on_cpu():
    run = run_fresh(COLD, "cpu", *NAMES)
    assert run.returncode == 0, run.output[-8000:]
    assert run.output.count(": ok") == len(NAMES), run.output[-8000:]


def test_fresh_runs_starts_each_selected_case_once(monkeypatch):
    """Up front, once per distinct case of the requesting module in a plain session; on demand,
    once per case asked, in an xdist worker (which collects every case of every worker)."""
    calls = []

    def one(case):
        calls.append(case)
        return FreshRun(0, case)

    here, other = SimpleNamespace(), SimpleNamespace()

    def item(module, params):
        return SimpleNamespace(module=module, callspec=SimpleNamespace(params=params))

    items = [item(here, {"name": n}) for n in "abca"] + [item(other, {"name": "z"})]
    items.append(item(here, {"rows": 3}))
    request = SimpleNamespace(module=here, session=SimpleNamespace(items=items))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    runs = fresh_runs(request, "name", one, workers=2)
    assert sorted(calls) == ["a", "b", "c"] and list(runs) == ["a", "b", "c"]
    assert runs["b"].output == "b"
    calls.clear()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    runs = fresh_runs(request, "name", one, workers=2)
    assert calls == []
    assert runs["c"].output == "c" and runs["c"].output == "c" and calls == ["c"]


@pytest.fixture(scope="module")
def gpu_runs(request):
    """op name -> FreshRun, one process per op, up to 8 at a time (compiling is host work;
    ``fresh_runs``)."""
    workers = int(os.environ.get("MOE_COLD_WORKERS", "8"))
    return fresh_runs(request, "name", lambda n: run_fresh(COLD, "cuda", n), workers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_op_compiles_cold_on_cuda(name, gpu_runs):
    run = gpu_runs[name]
    assert run.returncode == 0 and f"{name}: ok" in run.output, run.output[-8000:]
