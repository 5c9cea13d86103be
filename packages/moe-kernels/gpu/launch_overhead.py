"""Host cost of eager routing calls at T=4096: the full launch path against the bound relaunch.

PYTHONPATH=packages/moe-kernels/src:packages/moe-tools/src \
    python3 packages/moe-kernels/gpu/launch_overhead.py [--stub]

On a GPU: per call, back-to-back eager calls (no L2 flush, so the host's launch cost shows),
``do_bench`` medians (L2 flushed between calls, as ``moe-bench kernels`` times them) and
torch-native routing (topk + stable sort + bincount), once with the bound relaunch
(``_triton/routing.py``'s ``_BOUND``) and once with it off.
Without a GPU (or with ``--stub``): the host time of a public eager call, with stand-in kernels
whose launches do nothing, on CPU tensors.
``--eager-profile`` (GPU): the kernel timeline of ``do_bench``-style calls (flush, call), eager
against the custom-op path: our kernels' device time, their span, and how long the GPU waits
for the host after the flush (whether the eager T=4096 rows are bound by the host or by the
eager plan's kernels).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import moe_kernels._triton.launch as launch
import moe_kernels._triton.routing as R
import moe_kernels.routing as MR

SHAPES = [(4096, 16, 8), (4096, 128, 8)]


class _NoStore(dict):
    """A ``_BOUND`` that never binds: every call takes the full launch path."""

    def __setitem__(self, key, value) -> None:
        pass


def _per_call_us(fn, n: int = 2000, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time of ``n`` back-to-back calls, per call."""
    for _ in range(200):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def _stub_kernels() -> None:
    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args) -> None:
            pass

    class Jit:
        def __init__(self, real) -> None:
            self.arg_names = real.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    class Driver:
        class active:  # noqa: N801 - mirrors triton.runtime.driver.active
            @staticmethod
            def get_current_stream(dev) -> int:
                return 0

    for name in ("_topk_rank", "_topk_cols", "_scan", "_place", "_expert_runs"):
        setattr(R, name, launch.FastKernel(Jit(getattr(R, name).fn)))
    launch.FastKernel.enabled = True
    launch.driver = Driver
    MR.eager_direct = lambda *tensors: True  # CPU tensors through the eager path
    MR.use_triton = lambda device: True


def _breakdown(T: int = 4096, E: int = 128, k: int = 8) -> None:
    """Where an eager index_shuffling call's host time goes (GPU only): the public call, the
    launcher alone, its pieces, and a one-kernel torch op for scale."""
    from triton.runtime import driver

    x = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
    R._BOUND = {}
    args = (x, 8, None, 0, E, False, False, False, True, None, True)
    R.routing_triton(*args)
    key, (ha, hb, hc, _) = next(iter(R._BOUND.items()))
    p = R._launch_plan(*key[0])
    n = sum(p.sizes)
    buf = torch.empty(n, dtype=torch.int32, device="cuda")
    addrs = [buf.data_ptr() + 4 * s for s in p.starts]
    a, _, c, _ = R._kernel_args(p, addrs, x.data_ptr(), x.stride(), None, T, E, 0, E, False, False,
                             True)  # fmt: skip
    small = torch.zeros(16, device="cuda")
    parts = {
        "public index_shuffling": lambda: MR.index_shuffling(x, top_k=k),
        "argument checks (_check)": lambda: MR._check(x, "routing_scores", k, None, None, None),
        "routing_triton, bound": lambda: R.routing_triton(*args),
        f"torch.empty({n}, int32)": lambda: torch.empty(n, dtype=torch.int32, device="cuda"),
        "get_current_stream": lambda: driver.active.get_current_stream(0),
        "kernel A relaunch (run)": lambda: launch.run(ha, (p.n_prog,), 0, a),
        "kernel C relaunch (run)": lambda: launch.run(hc, (p.n_prog,), 0, c),
        "output views (_outputs)": lambda: R._outputs(
            R._slicer(buf, p), T, k, E, False, False, True
        ),
        "torch small.add_(1)": lambda: small.add_(1),
    }
    print(f"\n# host time per call, T={T} E={E} k={k} bf16 (B {'fused' if hb is None else 'own'})")
    print("| piece | us |\n| --- | ---: |")
    for name, fn in parts.items():
        print(f"| {name} | {_per_call_us(fn):.1f} |", flush=True)


_OURS = ("_topk_", "_scan", "_place", "_expert_runs")


def _timeline(fn, iters: int = 50) -> dict[str, float]:
    """Kernel timeline of ``do_bench``-style calls (an L2 flush, then ``fn``), averaged over
    ``iters``: the device time of our kernels, the span from the first's start to the last's
    end, and the gap between the flush's end and our first kernel's start (GPU idle, waiting
    for the host: the eager rows' host cost)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return _per_call(kernels)


def _per_call(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """(name, start, end) of GPU kernels, us -> medians per call of ours (the kernels between
    two others): device time, span, and the idle time since the kernel before (the flush)."""
    busy, span, gap = [], [], []
    flush_end, first, last, total = None, None, None, 0.0
    for name, start, end in sorted(kernels, key=lambda e: e[1]) + [("", 0.0, 0.0)]:
        ours = any(k in name for k in _OURS)
        if not ours and first is not None:  # one call ended
            busy.append(total)
            span.append(last - first)
            if flush_end is not None:
                gap.append(max(0.0, first - flush_end))
            first, total = None, 0.0
        if ours:
            first = start if first is None else first
            last = end
            total += end - start
        else:
            flush_end = end
    med = statistics.median
    nan = float("nan")
    return {
        "kernels": med(busy) if busy else nan,
        "span": med(span) if span else nan,
        "gap": med(gap) if gap else nan,
    }


def _eager_profile() -> None:
    """Eager calls against the custom-op path (the plan CUDA graphs and compiled code take), at
    T=4096: device time, span and the GPU's wait for the host after the flush, us."""
    print("\n# do_bench-style timeline (flush, call), medians over 50 calls, us")
    print("| op | E | path | kernels | span | wait after flush |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for T, E, k in SHAPES:
        s = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
        paths = {
            ("index_shuffling", "eager"): lambda s=s, k=k: MR.index_shuffling(s, top_k=k),
            ("index_shuffling", "op"): lambda s=s, E=E, k=k: MR._index_shuffling_op(
                s, 0, E, None, k
            ),
            ("route", "eager"): lambda s=s, k=k: MR.route(s, k),
            ("route", "op"): lambda s=s, E=E, k=k: MR._route_op(s, k, None, 0, E, False),
        }
        for (op, path), fn in paths.items():
            t = _timeline(fn)
            print(f"| {op} | {E} | {path} | {t['kernels']:.1f} | {t['span']:.1f} | "
                  f"{t['gap']:.1f} |", flush=True)  # fmt: skip


def main() -> int:
    if "--eager-profile" in sys.argv:
        _eager_profile()
        return 0
    stub = "--stub" in sys.argv or not torch.cuda.is_available()
    if stub:
        _stub_kernels()
    dev = "cpu" if stub else "cuda"
    print(f"# {'stand-in kernels on the CPU' if stub else torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")  # fmt: skip
    print("| op | T | E | bound | full | ratio |" + ("" if stub else " do_bench bound | torch |"))
    print("| --- | ---: | ---: | ---: | ---: | ---: |" + ("" if stub else " ---: | ---: |"))
    for T, E, k in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(0)
        scores = torch.randn(T, E, generator=gen, device=dev).softmax(-1).to(torch.bfloat16)
        ops = {
            "route": lambda s=scores, k=k: MR.route(s, k),
            "index_shuffling": lambda s=scores, k=k: MR.index_shuffling(s, top_k=k),
        }
        for name, fn in ops.items():
            R._BOUND = _NoStore()
            full = _per_call_us(fn)
            R._BOUND = {}
            bound = _per_call_us(fn)
            row = f"| {name} | {T} | {E} | {bound:.1f} | {full:.1f} | {full / bound:.2f}x |"
            if not stub:
                from triton.testing import do_bench

                from moe_tools.kernels import torch_route

                med = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
                ref = do_bench(lambda s=scores, k=k: torch_route(s, k), warmup=25, rep=200,
                               return_mode="median") * 1e3  # fmt: skip
                row += f" {med:.1f} | {ref:.1f} |"
            print(row, flush=True)
    if not stub:
        _breakdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
