"""Training on the GPU (issue 22): the MoE layer's forward + backward per impl (eager, compiled,
the compiled step in a CUDA graph) beside its six grouped GEMMs alone, with profiles. Each op's
backward against the CPU reference, and the layer's repeatability: ``tests/gpu/
test_backward_gpu.py`` and moe-model's ``tests/gpu/test_gpu.py``; the weight-gradient GEMM:
``grouped_weight_grad_gpu.py``.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/train_gpu.py [--shapes=seed,train] [--profile] [--dry-run]
        python3 benchmarks/gpu/train_gpu.py --impls=torch,triton_bf16 \
            --no-compile --profile     # eager rows, each profiled by host (self CPU) time

``--dry-run``: tiny shapes on the CPU (run it under ``TRITON_INTERPRET=1`` for the kernels).
Shapes: seed = 2048 tokens, E=16, top-8, d_model 2048, hidden 1024; train = 16384 tokens,
E=128, top-8, d_model 2048, hidden 768 (both bf16, SiLU experts; ``gated`` rows add SwiGLU).
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import bench_us

import moe_kernels as mk
from moe_kernels.testing import capture
from moe_model import MoELayer

SHAPES = {  # name: (tokens, experts, top_k, d_model, hidden)
    "seed": (2048, 16, 8, 2048, 1024),
    "qwen3": (8192, 128, 8, 2048, 768),
    "train": (16384, 128, 8, 2048, 768),
}
TINY = {"seed": (64, 8, 2, 64, 32), "train": (96, 8, 2, 64, 64), "qwen3": (64, 40, 4, 64, 32)}


# ------------------------------------------------------------------------------------ layer


def six_gemms(xs, w1, w2, offs, dy):
    """The layer's six grouped GEMMs alone (``torch._grouped_mm``): two forward, four backward
    (the activation's input and output stand in as fixed tensors: no pointwise work timed)."""
    o = offs[1:]
    a = torch.randn(xs.shape[0], w2.shape[2], device=xs.device, dtype=xs.dtype)
    dh = torch.randn(xs.shape[0], w1.shape[1], device=xs.device, dtype=xs.dtype)

    def run():
        torch._grouped_mm(xs, w1.mT, offs=o)  # h
        y = torch._grouped_mm(a, w2.mT, offs=o)
        da = torch._grouped_mm(dy, w2, offs=o)
        dw2 = torch._grouped_mm(dy.mT, a, offs=o)
        dx = torch._grouped_mm(dh, w1, offs=o)
        dw1 = torch._grouped_mm(dh.mT, xs, offs=o)
        return y, da, dx, dw1, dw2

    return run


def layer_rows(
    dev: str,
    shapes: list[str],
    dry: bool,
    profile: bool,
    impls: list[str],
    compiled: bool,
    py_profile: bool = False,
    profile_sort: str = "self_cpu_time_total",
) -> None:
    print("\n## MoE layer forward + backward (bf16 params and activations, fp32 router)")
    print(f"{'shape':<14}{'impl':<13}{'eager ms':>10}{'compiled ms':>13}{'graph ms':>10}")
    dt = torch.float32 if dry else torch.bfloat16
    for name in shapes:
        for gated in (False, True):
            T, E, k, D, H = (TINY if dry else SHAPES)[name]
            torch.manual_seed(0)
            base = MoELayer(D, E, k, H, gated=gated, impl="torch").to(dev)
            base.in_proj.data = base.in_proj.data.to(dt)
            base.out_proj.data = base.out_proj.data.to(dt)
            x = torch.randn(T, D, device=dev, dtype=dt)
            dy = torch.randn(T, D, device=dev, dtype=dt) / D**0.5
            tag = f"{name}{'-gated' if gated else ''}"
            for impl in impls:
                if impl == "baseline" and not dry and name == "train":
                    continue  # the host-syncing loop: seed shape only
                layer = copy.deepcopy(base)
                layer.impl = impl

                def step(m=layer):
                    m.zero_grad(set_to_none=True)
                    xx = x.detach().requires_grad_()
                    m(xx).backward(dy)
                    return [xx.grad, m.router.weight.grad, m.in_proj.grad, m.out_proj.grad]

                step()
                eager = bench_us(step, dry=dry) / 1e3
                if profile and impl in ("torch", "triton_bf16") and not dry:
                    profile_step(step, f"{tag} {impl} eager", profile_sort)
                if py_profile and impl == "triton_bf16":
                    py_profile_step(step, f"{tag} {impl} eager")
                comp_ms, graph_ms = float("nan"), float("nan")
                if impl != "baseline" and compiled:
                    torch._dynamo.reset()  # one compiled layer at a time: no recompile limit
                    cl = copy.deepcopy(base)
                    cl.impl = impl
                    cm = torch.compile(cl, fullgraph=True)

                    def cstep(m=cl, f=cm):
                        m.zero_grad(set_to_none=True)
                        xx = x.detach().requires_grad_()
                        f(xx).backward(dy)
                        return [xx.grad, m.router.weight.grad, m.in_proj.grad, m.out_proj.grad]

                    cstep()
                    comp_ms = bench_us(cstep, dry=dry) / 1e3
                    if dev == "cuda" and impl in ("torch", "triton_bf16"):
                        try:
                            graph, _ = capture(cstep, warmup=2)
                            graph_ms = bench_us(graph.replay) / 1e3
                        except Exception as exc:  # noqa: BLE001
                            print(f"{tag} {impl}: no CUDA graph of the compiled step: {exc}"[:200])
                    if profile and impl == "triton_bf16" and not dry:
                        profile_step(cstep, f"{tag} {impl} compiled")
                print(f"{tag:<14}{impl:<13}{eager:>10.3f}{comp_ms:>13.3f}{graph_ms:>10.3f}")
            if dev == "cuda" and not dry:
                plan = mk.route(base.scores(x), k)
                xs = mk.dispatch(x, plan)
                gemms = six_gemms(
                    xs, base.in_proj, base.out_proj, plan.offsets, mk.dispatch(dy, plan)
                )  # noqa: E501
                print(f"{tag:<14}{'6 GEMMs':<13}{bench_us(gemms) / 1e3:>10.3f}")


def profile_step(fn, title: str, sort_by: str = "self_cuda_time_total") -> None:
    """The ops of a few steps of ``fn`` by ``sort_by`` (torch.profiler): kernels by CUDA time,
    or the host's share of an eager step by ``self_cpu_time_total``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as prof:  # noqa: E501
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"\n### profile: {title} (5 steps), by {sort_by}, with input shapes")
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort_by, row_limit=30, max_name_column_width=60,
        max_shapes_column_width=70,
    )  # fmt: skip
    print(table)


def py_profile_step(fn, title: str, steps: int = 20) -> None:
    """The Python functions of ``steps`` eager steps of ``fn`` by their own time (cProfile):
    where an eager step's host time goes below the op level."""
    import cProfile
    import pstats

    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    print(f"\n### Python profile: {title} ({steps} steps), by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"\n### Python profile: {title} ({steps} steps), by cumulative time")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="seed,train")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--py-profile", action="store_true", help="cProfile of triton_bf16 eager")
    ap.add_argument(
        "--profile-sort",
        default="self_cpu_time_total",
        help="the eager profile's order (self_cuda_time_total: kernels)",
    )
    ap.add_argument("--impls", default="baseline,torch,triton_bf16,mxfp8")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument("--skip", default="", help="layer: nothing timed (ops, wgrad: accepted, gone)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    skip = set(filter(None, args.skip.split(",")))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}")
    if "layer" not in skip:
        impls = args.impls.split(",")
        layer_rows(dev, args.shapes.split(","), args.dry_run, args.profile, impls,
                   not args.no_compile, args.py_profile, args.profile_sort)  # fmt: skip


if __name__ == "__main__":
    main()
