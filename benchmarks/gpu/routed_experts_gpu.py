"""The routed experts and their combine (issue 33): ``moe_kernels.routed_experts`` (one node,
no expert outputs kept) beside ``expert_mlp`` followed by ``combine`` (two nodes, the combine
keeping the (R, D) outputs for the router weights' gradient) and the six grouped GEMMs alone:
forward + backward of a fixed dY with gradients to x, both weights and the router weights, in a
CUDA graph (device time) and eager, and the peak memory one pass adds (the two nodes' gradients
agreeing, repeatable: ``tests/gpu/test_backward_gpu.py``).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/routed_experts_gpu.py [--shapes=seed,qwen3,...] [--dry-run]
"""

from __future__ import annotations

import argparse

import torch
from common import bench_us
from expert_mlp_gpu import SHAPES, TINY, grad_step, peak_and_graph_ms, six_gemms

import moe_kernels as mk
from moe_kernels.testing import capture


def problem(shape, dev, dtype):
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(T, E, device=dev, generator=g).softmax(-1)
    plan = mk.route(scores, k)
    x = torch.randn(T, D, device=dev, generator=g).to(dtype)
    w_in = (torch.randn(E, 2 * H if gated else H, D, device=dev, generator=g) / D**0.5).to(dtype)
    w_out = (torch.randn(E, D, H, device=dev, generator=g) / H**0.5).to(dtype)
    dy = (torch.randn(T, D, device=dev, generator=g) / D**0.5).to(dtype)
    dy_R = (torch.randn(T * k, D, device=dev, generator=g) / D**0.5).to(dtype)
    return plan, x, w_in, w_out, dy, dy_R


def variants(plan, gated):
    def fused(x, w_in, w_out, s):
        return mk.routed_experts(x, w_in, w_out, plan._replace(weights=s), gated=gated)

    def two_nodes(x, w_in, w_out, s):
        o = mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                          gated=gated)  # fmt: skip
        return mk.combine(o, plan._replace(weights=s), out_dtype=x.dtype)

    return {"routed_experts": fused, "expert_mlp+combine": two_nodes}


def run_shape(name, shape, dev, dtype, dry):
    plan, x, w_in, w_out, dy, dy_R = problem(shape, dev, dtype)
    gated = shape[5]
    gemm_ms = float("nan")
    if not dry:
        run, _ = six_gemms(plan, x, w_in, w_out, dy_R, gated)
        gemm_ms = bench_us(capture(run, warmup=2)[0].replay) / 1e3
        print(f"{name:<10}{'six GEMMs':<20}{gemm_ms:>10.3f}")
    params = [t.detach().requires_grad_() for t in (x, w_in, w_out, plan.weights)]
    for vname, fn in variants(plan, gated).items():
        step = grad_step(fn, params, dy)
        step()
        graph_ms, peak = float("nan"), float("nan")
        if not dry:
            for p in params:  # (the gradients count in the peak)
                p.grad = None
            peak, graph_ms = peak_and_graph_ms(step)
        eager_ms = bench_us(step, dry=dry) / 1e3
        print(f"{name:<10}{vname:<20}{graph_ms:>10.3f}{eager_ms:>10.3f}{peak:>10.3f}"
              f"{graph_ms / gemm_ms:>9.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="seed,qwen3,sonic,sonic_mem")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    print(f"{'shape':<10}{'variant':<20}{'graph ms':>10}{'eager ms':>10}{'peak GiB':>10}"
          f"{'vs GEMMs':>9}")  # fmt: skip
    for name in args.shapes.split(","):
        run_shape(name, TINY if args.dry_run else SHAPES[name], dev, dtype, args.dry_run)
        if not args.dry_run:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
