"""One-shot H200 timing of moe-model: the MoE layer at the seed's matrix shape per impl (eager,
compiled, compiled in a CUDA graph) beside its two grouped GEMMs, and the seed-moe rollout with
compile + CUDA graphs (frames per second, memory). Prints short tables; every section is guarded
so one failure does not hide the rest. Correctness (against the baseline, compiled against eager,
no host syncs, graph replay, rollout repeatability): ``packages/moe-model/tests/gpu/``.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/model_gpu.py            # H200
DRY=1 python3 benchmarks/gpu/model_gpu.py      # CPU smoke run, tiny sizes
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.nn.functional as F
from common import bench_us

from moe_kernels.testing import capture
from moe_model import MoELayer, WorldEngine, WorldModelConfig, count_parameters

T_START = time.time()
BUDGET_S = float(os.environ.get("BUDGET_S", "270"))
# DRY=1: a quick CPU pass over the same code (tiny sizes, no graphs) to catch script errors.
DRY = os.environ.get("DRY", "0") == "1"
DEV = "cpu" if DRY else "cuda"
D_MODEL, N_EXP, TOP_K, HIDDEN = (64, 4, 2, 32) if DRY else (2048, 16, 8, 1024)


def left() -> float:
    return BUDGET_S - (time.time() - T_START)


def us(fn) -> float:
    return bench_us(fn, dry=DRY, warmup_ms=10, rep_ms=60)


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def log(*a) -> None:
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def guarded(name):
    def deco(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            except Exception as e:  # report and continue
                log(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(limit=4)
                return None

        return run

    return deco


# ------------------------------------------------------------------------------------------------
# Part A: the MoE layer at 2048 tokens, E=16, top-8, 2048 -> 1024 -> 2048, bf16.


@guarded("moe layer")
def moe_layer(T: int = 2048, impls=("torch", "triton_bf16", "triton_fp32", "mxfp8")) -> None:
    torch.manual_seed(0)
    layer = MoELayer(D_MODEL, N_EXP, TOP_K, HIDDEN, impl="baseline").to(DEV).requires_grad_(False)
    layer.in_proj.data = layer.in_proj.data.bfloat16()
    layer.out_proj.data = layer.out_proj.data.bfloat16()
    x = torch.randn(T, D_MODEL, device=DEV).bfloat16()
    rows = []
    with torch.no_grad():
        t_base = us(lambda: layer(x))
        rows.append(("baseline", "eager", t_base))
        # The two grouped GEMMs alone, on the same routed rows (torch routing).
        from moe_model import IMPLS

        plan = IMPLS["torch"].route(layer.scores(x), TOP_K, layer.route_options())
        xs = x[plan.token_indices]
        ends = plan.offsets[1:].clone()
        w1, w2 = layer.in_proj.mT, layer.out_proj.mT
        gmm = torch._grouped_mm if not DRY else lambda a, b, offs: a @ b[0]
        a = F.silu(gmm(xs, w1, offs=ends))
        t_gemm = us(lambda: (gmm(xs, w1, offs=ends), gmm(a, w2, offs=ends)))
        t_clone_x = us(lambda: x.clone())
        t_clone_w = us(lambda: (layer.in_proj.clone(), layer.out_proj.clone()))
        log(
            f"T={T}: two grouped GEMMs alone {t_gemm:.1f} us; clone x {t_clone_x:.1f} us; "
            f"clone expert weights {t_clone_w:.1f} us"
        )
        for impl in impls:
            if left() < 45:
                log(f"skip {impl}: time")
                continue
            try:
                layer.impl = impl
                rows.append((impl, "eager", us(lambda: layer(x))))
                torch._dynamo.reset()
                comp = torch.compile(layer, fullgraph=True)
                comp(x)
                rows.append((impl, "compiled", us(lambda c=comp: c(x))))
                if DRY:
                    continue
                g, _ = capture(lambda c=comp: c(x), warmup=2)  # CUDA graph of the compiled layer
                rows.append((impl, "compiled+graph", us(g.replay)))
            except Exception as e:
                log(f"{impl} FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
    print(f"\nMoE layer T={T}, E=16, top-8, d 2048, hidden 1024, bf16 (do_bench medians)")
    print("| impl | mode | us | vs baseline | vs 2 GEMMs |")
    print("| --- | --- | --- | --- | --- |")
    for impl, mode, t in rows:
        print(f"| {impl} | {mode} | {t:.1f} | {t_base / t:.2f}x | {t / t_gemm:.2f}x |")
    print(f"| 2 grouped GEMMs | torch._grouped_mm | {t_gemm:.1f} | | 1.00x |")
    print(f"| clone x / clone weights | | {t_clone_x:.1f} / {t_clone_w:.1f} | | |\n", flush=True)


# ------------------------------------------------------------------------------------------------
# Part B: seed-moe rollout.


def fps(eng: WorldEngine, n: int, return_img: bool = False) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(n):
        eng.gen_frame(return_img=return_img)
    sync()
    return n / (time.perf_counter() - t)


@guarded("rollout")
def rollout(preset: str = "seed-moe", impl: str = "triton_bf16", n_frames: int = 256) -> None:
    cfg = WorldModelConfig.from_preset(preset)
    total, active = count_parameters(cfg)
    log(
        f"{preset}: {total:,} parameters, {active:,} active; tokens/frame {cfg.tokens_per_frame}, "
        f"window {cfg.window}, denoise steps {cfg.denoise_steps} + 1 cache pass"
    )
    mem = torch.cuda if not DRY else None
    if mem:
        mem.empty_cache()
        mem.reset_peak_memory_stats()
    t = time.time()
    eng = WorldEngine(cfg, device=DEV, dtype=torch.bfloat16, impl=impl, seed=0)
    log(
        f"built in {time.time() - t:.1f}s; "
        f"weights {mem.memory_allocated() / 2**30 if mem else 0:.2f} GiB"
    )
    res = {}
    eng.gen_frame(return_img=False)
    res["eager fps"] = fps(eng, 6)
    log(f"eager: {res['eager fps']:.1f} fps")
    t = time.time()
    eng.set_runtime(compile=True, cuda_graph=False)
    eng.reset()
    for _ in range(cfg.window + 2):  # compiles the masked and the unmasked variants
        eng.gen_frame(return_img=False)
    log(f"compiled in {time.time() - t:.1f}s")
    res["compiled fps (ring full)"] = fps(eng, 16)
    log(f"compiled: {res['compiled fps (ring full)']:.1f} fps")
    t = time.time()
    eng.set_runtime(compile=True, cuda_graph=not DRY)
    log(f"captured in {time.time() - t:.1f}s")
    eng.reset()
    sync()
    if mem:
        mem.reset_peak_memory_stats()
    res["graph fps frames 0-16 (ring filling, masked)"] = fps(eng, 16)
    mem16 = mem.memory_allocated() if mem else 0
    res[f"graph fps frames 16-{n_frames}"] = fps(eng, n_frames - 16)
    mem256 = mem.memory_allocated() if mem else 0
    peak = mem.max_memory_allocated() if mem else 0
    peak_res = mem.max_memory_reserved() if mem else 0
    res["graph fps with image to host"] = fps(eng, 32, return_img=True)
    img = eng.gen_frame()
    print(f"\n{preset} rollout, impl {impl}, bf16, {n_frames} frames")
    print("| what | value |")
    print("| --- | --- |")
    for k, v in res.items():
        print(f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(
        f"| memory allocated at frame 16 / {n_frames} | "
        f"{mem16 / 2**30:.3f} / {mem256 / 2**30:.3f} GiB "
        f"(flat: {mem16 == mem256}) |"
    )
    print(
        f"| peak VRAM allocated / reserved (graph rollout) | {peak / 2**30:.2f} / "
        f"{peak_res / 2**30:.2f} GiB |"
    )
    print(f"| image | {tuple(img.shape)} {img.dtype} mean {img.float().mean():.1f} |\n", flush=True)


if __name__ == "__main__":
    log(f"torch {torch.__version__}, {'cpu dry run' if DRY else torch.cuda.get_device_name()}")
    moe_layer(64 if DRY else 2048, impls=("triton_bf16",))
    rollout("tiny" if DRY else "seed-moe", "triton_bf16", 24 if DRY else 256)
    if left() > 60:
        moe_layer(64 if DRY else 2048, impls=("torch", "triton_fp32", "mxfp8"))
    if left() > 60:
        moe_layer(32 if DRY else 512, impls=("triton_bf16",))
    log("done")
