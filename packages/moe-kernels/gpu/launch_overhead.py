"""Host cost of eager routing calls at T=4096: the full launch path against the bound relaunch.

PYTHONPATH=packages/moe-kernels/src:packages/moe-tools/src \
    python3 packages/moe-kernels/gpu/launch_overhead.py [--stub]

On a GPU: per call, back-to-back eager calls (no L2 flush, so the host's launch cost shows),
``do_bench`` medians (L2 flushed between calls, as ``moe-bench kernels`` times them) and
torch-native routing (topk + stable sort + bincount), once with the bound relaunch
(``_triton/routing_eager.py``'s ``_BOUND``) and once with it off.
Without a GPU (or with ``--stub``): the host time of a public eager call, with stand-in kernels
whose launches do nothing, on CPU tensors.
``--host-bound`` (GPU): ``do_bench``'s loop timed from the host and from the GPU side by side
(whether the GPU waits for the host), beside do_bench's own median and torch's.
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
import moe_kernels._triton.routing_eager as lane
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
    MR._LANE_ON_CPU = True
    MR.use_triton = lambda device: True


def _breakdown(T: int = 4096, E: int = 128, k: int = 8) -> None:
    """Where an eager index_shuffling call's host time goes (GPU only): the public call, the
    launcher alone, its pieces, and a one-kernel torch op for scale."""
    x = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
    lane._BOUND = {}
    args = (x, 8, None, 0, E, False, False, False, True, None, True)
    R.routing_triton(*args)
    e = next(iter(lane._BOUND.values()))
    buf = torch.empty(e.n, dtype=torch.int32, device="cuda")
    stream = launch.current_stream(0)
    bar = 0 if e.barrier is None else e.barrier(0, stream).data_ptr()
    bases = (buf.data_ptr(), x.data_ptr(), 0, bar)
    small = torch.zeros(16, device="cuda")
    parts = {
        "public index_shuffling": lambda: MR.index_shuffling(x, top_k=k),
        "argument checks (_check)": lambda: MR._check(x, "routing_scores", k, None, None, None),
        "eager_direct": lambda: MR.eager_direct(x, None),
        "routing_triton, bound": lambda: R.routing_triton(*args),
        "the key (eager_key)": lambda: lane.eager_key(x, k, None, 0, E, False, False, False, True,
                                                     None),  # fmt: skip
        f"torch.empty({e.n}, int32)": lambda: torch.empty(e.n, dtype=torch.int32, device="cuda"),
        "current_stream": lambda: launch.current_stream(0),
        f"the launches ({'one, fused' if e.barrier is not None else 'bound'})": (
            lambda: e.launches(bases, stream)
        ),
        "outputs (split, assemble)": lambda: lane.assemble(buf.split_with_sizes(e.split),
                                                          e.pieces, T, k),
        "torch small.add_(1)": lambda: small.add_(1),
    }  # fmt: skip
    print(f"\n# host time per call, T={T} E={E} k={k} bf16")
    print("| piece | us |\n| --- | ---: |")
    for name, fn in parts.items():
        print(f"| {name} | {_per_call_us(fn):.1f} |", flush=True)


_OURS = ("_topk_", "_scan", "_place", "_expert_runs", "_fused")


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
            ("index_shuffling", "eager, unfused"): lambda s=s, E=E, k=k: R.routing_triton(
                s, k, None, 0, E, False, False, False, True, {"FUSED": 0}, True
            ),
            ("route", "eager, unfused"): lambda s=s, E=E, k=k: R.routing_triton(
                s, k, None, 0, E, False, True, True, False, {"FUSED": 0}, True
            ),
        }
        for (op, path), fn in paths.items():
            t = _timeline(fn)
            print(f"| {op} | {E} | {path} | {t['kernels']:.1f} | {t['span']:.1f} | "
                  f"{t['gap']:.1f} |", flush=True)  # fmt: skip


def _bench_loop(fn, n: int = 400) -> dict[str, float]:
    """``do_bench``'s loop (flush, start event, call, end event) timed from both sides: the
    host's wall time per iteration to enqueue it, the GPU's time per iteration (events around the
    whole loop), the flush alone, and the median of the per-call events (what do_bench reports).
    Host per iteration above the GPU's means the GPU waits for the host: host-bound."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(20):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]  # fmt: skip
    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g0.record()
    t0 = time.perf_counter()
    for s, e in ev:
        flush.zero_()
        s.record()
        fn()
        e.record()
    t1 = time.perf_counter()
    g1.record()
    torch.cuda.synchronize()
    f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f0.record()
    for _ in range(50):
        flush.zero_()
    f1.record()
    torch.cuda.synchronize()
    return {
        "host_iter": (t1 - t0) / n * 1e6,
        "gpu_iter": g0.elapsed_time(g1) / n * 1e3,
        "flush": f0.elapsed_time(f1) / 50 * 1e3,
        "call": statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3,
    }


def _host_bound_table() -> None:
    """Per op and shape at T=4096: the public eager call's host time back to back, the
    do_bench-style loop from both sides, do_bench's median, and torch-native routing's."""
    from triton.testing import do_bench

    from moe_tools.kernels import torch_route

    print("\n# do_bench-style loops, T=4096, k=8, bf16, us (host_iter > gpu_iter: host-bound)")
    print("| op | E | host per call | loop host/iter | loop GPU/iter | flush | loop call median "
          "| do_bench | torch do_bench | speedup |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T, E, k in SHAPES:
        s = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
        ref = do_bench(lambda s=s, k=k: torch_route(s, k), return_mode="median") * 1e3
        for op, fn in (("index_shuffling", lambda s=s, k=k: MR.index_shuffling(s, top_k=k)),
                       ("route", lambda s=s, k=k: MR.route(s, k))):  # fmt: skip
            host = _per_call_us(fn, n=1000, repeats=3)
            loop = _bench_loop(fn)
            med = do_bench(fn, return_mode="median") * 1e3
            print(f"| {op} | {E} | {host:.1f} | {loop['host_iter']:.1f} | {loop['gpu_iter']:.1f} "
                  f"| {loop['flush']:.1f} | {loop['call']:.1f} | {med:.1f} | {ref:.1f} | "
                  f"{ref / med:.1f}x |", flush=True)  # fmt: skip


def main() -> int:
    if "--eager-profile" in sys.argv:
        _eager_profile()
        return 0
    if "--host-bound" in sys.argv:
        _host_bound_table()
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
            lane._BOUND = _NoStore()
            full = _per_call_us(fn)
            lane._BOUND = {}
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
