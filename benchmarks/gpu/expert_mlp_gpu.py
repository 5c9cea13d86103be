"""The routed experts alone (issue 33): ``moe_kernels.expert_mlp`` forward + backward, keeping
the gathered rows for backward or gathering them again, beside the chain of ops it replaced
(``dispatch``, ``gather_grouped_mm``, ``expert_activation``, ``gather_grouped_mm``) and the six
grouped GEMMs alone; each in a CUDA graph (device time) and eager (host time included), with
the peak memory a forward + backward adds (gradients against the op chain and repeatability:
``tests/gpu/test_backward_gpu.py``). Then the forward alone (no grad: the Triton GEMM that
gathers in its loads, and the op chain) beside its two grouped GEMMs.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/expert_mlp_gpu.py [--shapes=seed,qwen3,sonic,sonic_mem] [--dry-run]

``--dry-run``: tiny shapes on the CPU (under ``TRITON_INTERPRET=1`` for the kernels).
"""

from __future__ import annotations

import argparse

import torch
from common import bench_us

import moe_kernels as mk
from moe_kernels.testing import capture

SHAPES = {  # name: (tokens, d_model, hidden, experts, top_k, gated)
    "seed": (2048, 2048, 1024, 16, 8, False),
    "qwen3": (8192, 2048, 768, 128, 8, True),
    "sonic": (32768, 4096, 1024, 128, 8, True),
    "sonic_mem": (24576, 1536, 256, 128, 8, True),
}
TINY = (64, 32, 16, 4, 2, True)


def problem(shape, dev, dtype):
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(T, E, device=dev, generator=g).softmax(-1)
    plan = mk.route(scores, k)
    x = torch.randn(T, D, device=dev, generator=g).to(dtype)
    w_in = (torch.randn(E, 2 * H if gated else H, D, device=dev, generator=g) / D**0.5).to(dtype)
    w_out = (torch.randn(E, D, H, device=dev, generator=g) / H**0.5).to(dtype)
    dy = (torch.randn(T * k, D, device=dev, generator=g) / D**0.5).to(dtype)
    return plan, x, w_in, w_out, dy


def variants(plan, gated):
    def node(save_rows):
        def fn(x, w_in, w_out):
            return mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                                 gated=gated, save_rows=save_rows)  # fmt: skip

        return fn

    def chain(x, w_in, w_out):
        h = mk.gather_grouped_mm(mk.dispatch(x, plan), w_in, plan.offsets)
        return mk.gather_grouped_mm(mk.expert_activation(h, gated), w_out, plan.offsets)

    return {"node (save rows)": node(True), "node (regather)": node(False), "op chain": chain}


def six_gemms(plan, x, w_in, w_out, dy, gated):
    o = plan.offsets[1:].to(torch.int32)
    xs = mk.dispatch(x, plan)
    a = torch.randn(xs.shape[0], w_out.shape[2], device=x.device, dtype=x.dtype)
    dh = torch.randn(xs.shape[0], w_in.shape[1], device=x.device, dtype=x.dtype)

    def run():
        torch._grouped_mm(xs, w_in.mT, offs=o)
        torch._grouped_mm(a, w_out.mT, offs=o)
        torch._grouped_mm(dy, w_out, offs=o)
        torch._grouped_mm(dy.mT, a, offs=o)
        torch._grouped_mm(dh, w_in, offs=o)
        torch._grouped_mm(dh.mT, xs, offs=o)

    def forward():
        torch._grouped_mm(xs, w_in.mT, offs=o)
        torch._grouped_mm(a, w_out.mT, offs=o)

    return run, forward


def grad_step(fn, params, dy):
    """One forward + backward of ``fn(*params)`` against dy (the gradients cleared first): returns
    the parameters' gradients."""

    def step():
        for p in params:
            p.grad = None
        fn(*params).backward(dy)
        return [p.grad for p in params]

    return step


def peak_and_graph_ms(step) -> tuple[float, float]:
    """(GiB one ``step()`` adds above what is allocated now, its CUDA-graph device time ms)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return peak, bench_us(capture(step, warmup=2)[0].replay) / 1e3


def run_shape(name: str, shape: tuple, dev: str, dtype: torch.dtype, dry: bool) -> None:
    plan, x, w_in, w_out, dy = problem(shape, dev, dtype)
    gated = shape[5]
    gemm_ms = fwd_gemm_ms = float("nan")
    if not dry:
        run, fwd = six_gemms(plan, x, w_in, w_out, dy, gated)
        gemm_ms = bench_us(capture(run, warmup=2)[0].replay) / 1e3
        fwd_gemm_ms = bench_us(capture(fwd, warmup=2)[0].replay) / 1e3
        print(f"{name:<10}{'six GEMMs':<18}{gemm_ms:>10.3f}")
    params = [t.detach().requires_grad_() for t in (x, w_in, w_out)]
    for vname, fn in variants(plan, gated).items():
        step = grad_step(fn, params, dy)
        step()
        graph_ms, peak = float("nan"), float("nan")
        if not dry:
            peak, graph_ms = peak_and_graph_ms(step)
        eager_ms = bench_us(step, dry=dry) / 1e3
        print(f"{name:<10}{vname:<18}{graph_ms:>10.3f}{eager_ms:>10.3f}{peak:>10.3f}"
              f"{graph_ms / gemm_ms:>9.2f}")  # fmt: skip
    with torch.no_grad():
        forwards = {"forward, no grad": variants(plan, gated)["node (save rows)"],
                    "chain, no grad": variants(plan, gated)["op chain"]}  # fmt: skip
        for fname, fwd_fn in forwards.items():
            fwd_ms = float("nan")
            if not dry:
                graph = capture(lambda f=fwd_fn: f(x, w_in, w_out), warmup=2)[0]
                fwd_ms = bench_us(graph.replay) / 1e3
            eager = bench_us(lambda f=fwd_fn: f(x, w_in, w_out), dry=dry) / 1e3
            print(f"{name:<10}{fname:<18}{fwd_ms:>10.3f}{eager:>10.3f}{'':>10}"
                  f"{fwd_ms / fwd_gemm_ms:>9.2f}  (2 GEMMs {fwd_gemm_ms:.3f} ms)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="seed,qwen3,sonic,sonic_mem")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    dry = args.dry_run
    print(f"{'shape':<10}{'variant':<18}{'graph ms':>10}{'eager ms':>10}{'peak GiB':>10}"
          f"{'vs GEMMs':>9}")  # fmt: skip
    for name in args.shapes.split(","):
        run_shape(name, TINY if dry else SHAPES[name], dev, dtype, dry)
        if not dry:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
