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

import pytest
import torch

from moe_kernels.testing import fresh_runs, run_fresh
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
dt = torch.bfloat16 if cuda else torch.float32
# (T, gated): on CUDA issue 44's layer, MoELayer(1024, 64 experts, top 8, hidden 2048), at
# 512 rows per expert (CUTLASS GEMMs) without a gate and 64 (the persistent kernels) with one
D, E, K, H = (1024, 64, 8, 2048) if cuda else (64, 8, 2, 32)
CASES = [(4096, False), (512, True)] if cuda else [(24, True)]

def make(impl, gated):
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, gated=gated, impl=impl).to(device)
    layer.in_proj.data = layer.in_proj.data.to(dt)
    layer.out_proj.data = layer.out_proj.data.to(dt)
    return layer

def data(T):
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(device, dt)
    dy = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(device, dt)
    return x, dy

def step(fn, layer, T, train):
    x, dy = data(T)
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
    for T, gated in CASES:
        for train in (False, True):
            if train and impl == "fbgemm":
                continue  # inference only
            layer = make(impl, gated)
            torch._dynamo.reset()  # each layer compiles the same forward anew: no recompile limit
            fn = torch.compile(layer, fullgraph=True, dynamic=False)
            try:
                got[impl, T, gated, train] = step(fn, layer, T, train)
            except Exception as exc:
                print(f"{impl} T={T} train={train}: FAIL compiled: {type(exc).__name__}: {exc}")
                fail = 1
for (impl, T, gated, train), outs in got.items():
    layer = make(impl, gated)
    want = step(layer, layer, T, train)
    exact = not cuda and train and impl.startswith("triton")
    for i, (a, b) in enumerate(zip(outs, want, strict=True)):
        a, b = a.float(), b.float()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        # mxfp8: a rounding flip inside a quantised block moves an element by an e4m3 step
        tol = 0.125 if impl == "mxfp8" else 2e-2 if dt == torch.bfloat16 else 1e-4
        ok = torch.equal(a, b) if exact else err <= tol
        if not ok:
            print(f"{impl} T={T} train={train}: FAIL output {i}: {err:.2e} from eager")
            fail = 1
    print(f"{impl} T={T} train={train}: done")
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
# CUDA: issue 44's seed-moe, a few frames; CPU: the tiny preset past its window's wrap
if cuda:
    cfg, n = WorldModelConfig.from_preset("seed-moe", moe_impl=impl), 3
else:
    cfg = WorldModelConfig.from_preset("tiny", moe_impl=impl, n_layers=1, denoise_steps=1)
    n = cfg.window + 2
dt = torch.bfloat16 if cuda else torch.float32
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
# The engine in CUDA graphs (its default) for every impl, and the default impl without graphs.
GPU_CASES = (
    [("layer", impl, "-") for impl in GPU_IMPLS]
    + [("engine", impl, "1") for impl in GPU_IMPLS]
    + [("engine", "triton_bf16", "0")]
)


def _workers() -> int:
    """Processes side by side: MOE_COLD_WORKERS, else one per 14 GiB of GPU memory (a seed-moe
    engine or the large layer compiles in about 12), at most 8."""
    if "MOE_COLD_WORKERS" in os.environ:
        return int(os.environ["MOE_COLD_WORKERS"])
    total = torch.cuda.get_device_properties(0).total_memory
    return max(1, min(8, total // (14 * 2**30)))


@pytest.fixture(scope="module")
def gpu_runs(request):
    """case -> FreshRun, ``_workers`` processes side by side (``fresh_runs``)."""

    def one(case):
        kind, impl, graphs = case
        if kind == "layer":
            return run_fresh(LAYER, "cuda", impl)
        return run_fresh(ENGINE, "cuda", impl, graphs)

    return fresh_runs(request, "case", one, _workers())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def test_compiles_cold_on_cuda(case, gpu_runs):
    _check(gpu_runs[case])
