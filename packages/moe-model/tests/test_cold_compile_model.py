"""The layer and the engine compiled in a fresh interpreter, before any eager call.

A module-level cache that a traced frame fills on its first call crashes only in a cold process:
in one where an eager call already filled it (as in the other tests of this session) the same
program compiles. So each case runs ``python -c`` in a new process (``run_fresh``) that compiles
first and runs eager after, then compares: the layer's forward and its training step
(forward + backward) for every implementation, ``WorldEngine(compile=True)`` with and without
CUDA graphs. On CPU (CI) the torch-running implementations in one process per check; on CUDA
(``-m gpu``) one process per implementation and case, run side by side.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moe_kernels.testing import run_fresh
from moe_model import MOE_IMPLS
from moe_model.impls import IMPLS

# argv: device, then implementation names. Every compiled call (forward without gradients,
# then forward + backward) runs before the first eager one; then eager, and the comparison:
# bitwise for the gradients of the Triton implementations on CPU (their kernels are opaque
# there), else within the rounding of the layer's dtype (Inductor re-derives the torch ops).
LAYER = r"""
import sys, torch
from moe_model import MoELayer
device, impls = sys.argv[1], sys.argv[2:]
cuda = device == "cuda"
D, E, K, H, T = (1024, 64, 8, 2048, 512) if cuda else (64, 8, 2, 32, 24)
dt = torch.bfloat16 if cuda else torch.float32

def make(impl):
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, gated=True, impl=impl).to(device)
    layer.in_proj.data = layer.in_proj.data.to(dt)
    layer.out_proj.data = layer.out_proj.data.to(dt)
    return layer

x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(device, dt)
dy = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(device, dt)

def step(fn, layer, train):
    if not train:
        with torch.no_grad():
            return [fn(x)]
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    y = fn(xx)
    y.backward(dy)
    return [y, xx.grad, layer.router.weight.grad, layer.in_proj.grad, layer.out_proj.grad]

got, fail = {}, 0
for impl in impls:
    for train in (False, True):
        if train and impl == "fbgemm":
            continue  # inference only
        layer = make(impl)
        try:
            got[impl, train] = step(torch.compile(layer, fullgraph=True), layer, train)
        except Exception as exc:
            print(f"{impl} train={train}: FAIL compiled: {type(exc).__name__}: {exc}")
            fail = 1
for (impl, train), outs in got.items():
    layer = make(impl)
    want = step(layer, layer, train)
    exact = not cuda and train and impl.startswith("triton")
    for i, (a, b) in enumerate(zip(outs, want, strict=True)):
        a, b = a.float(), b.float()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        # mxfp8: a rounding flip inside a quantised block moves an element by an e4m3 step
        tol = 0.125 if impl == "mxfp8" else 2e-2 if dt == torch.bfloat16 else 1e-4
        ok = torch.equal(a, b) if exact else err <= tol
        if not ok:
            print(f"{impl} train={train}: FAIL output {i}: {err:.2e} from eager")
            fail = 1
    print(f"{impl} train={train}: done")
raise SystemExit(fail)
"""

# argv: device, impl, cuda_graph ("1" / "0"). A compiled engine's frames first, then an eager
# engine's from the same seed: equal within the bf16 / fp32 tolerance of test_gpu.py /
# test_world.py.
ENGINE = r"""
import sys, torch
from moe_model import WorldEngine, WorldModelConfig
device, impl, graphs = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cuda = device == "cuda"
small = {} if cuda else dict(n_layers=1, denoise_steps=1)
cfg = WorldModelConfig.from_preset("tiny", moe_impl=impl, **small)
dt = torch.bfloat16 if cuda else torch.float32
n = cfg.window + 2
comp = WorldEngine(cfg, device=device, dtype=dt, seed=3, compile=True, cuda_graph=graphs)
got = [comp.gen_frame(return_img=False) for _ in range(n)]
eager = WorldEngine(cfg, device=device, dtype=dt, seed=3)
want = [eager.gen_frame(return_img=False) for _ in range(n)]
tol = 5e-2 if cuda else 1e-4
for f, (a, b) in enumerate(zip(got, want, strict=True)):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"frame {f}")
print("done")
"""


def _check(run) -> None:
    assert run.returncode == 0, run.output[-6000:]


# Every implementation but "baseline", the plain-PyTorch stand-in that reads each expert's row
# range on the host (no fullgraph compile by design); on CPU fbgemm is not there either.
COMPILABLE = [i for i in MOE_IMPLS if i != "baseline"]
CPU_IMPLS = [i for i in COMPILABLE if i != "fbgemm"]


def test_layer_compiles_cold_on_cpu():
    _check(run_fresh(LAYER, "cpu", *CPU_IMPLS))


def test_engine_compiles_cold_on_cpu():
    _check(run_fresh(ENGINE, "cpu", "triton_fp32", "0"))


# --------------------------------------------------------------------------------------------
# CUDA: one fresh process per case, several at a time (compiling is host work).

GPU_IMPLS = [i for i in COMPILABLE if IMPLS[i].available]
GPU_CASES = [("layer", impl, "-") for impl in GPU_IMPLS] + [
    ("engine", impl, graphs) for impl in GPU_IMPLS for graphs in "10"
]


@pytest.fixture(scope="module")
def gpu_runs():
    """case -> FreshRun, every GPU case started at once (up to 8 processes)."""

    def one(case):
        kind, impl, graphs = case
        if kind == "layer":
            return run_fresh(LAYER, "cuda", impl)
        return run_fresh(ENGINE, "cuda", impl, graphs)

    workers = int(os.environ.get("MOE_COLD_WORKERS", "8"))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(GPU_CASES, pool.map(one, GPU_CASES), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def test_compiles_cold_on_cuda(case, gpu_runs):
    _check(gpu_runs[case])
