"""Host cost of the pieces an eager routing call is made of, one by one (GPU only).

PYTHONPATH=$PWD/packages/moe-kernels/src python3 packages/moe-kernels/gpu/host_micro.py

Each figure is the host's wall time per call over 300 back-to-back calls (fewer than the launch
queue holds, so the host never waits for the GPU), median of 9 repeats, us. It shows what an
eager call at T=4096 could still shed: tensor creation, the launch, the checks.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode

import moe_kernels._triton.launch as launch
import moe_kernels._triton.routing as R
import moe_kernels._triton.routing_eager as lane
import moe_kernels.routing as MR


def host_us(fn, n: int = 300, repeats: int = 9) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        times.append((t1 - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def ab_us(fa, fb, n: int = 300, rounds: int = 21) -> tuple[float, float]:
    """``fa`` and ``fb`` timed in alternating blocks of ``n`` calls (so both see the host in
    the same state), ``rounds`` blocks each: medians per call, us."""
    ta, tb = [], []
    for f in (fa, fb):
        for _ in range(50):
            f()
    for _ in range(rounds):
        for f, t in ((fa, ta), (fb, tb)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            t.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ta), statistics.median(tb)


@triton.jit
def _null(x_ptr):
    pass


@triton.jit
def _null_many(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, i0, i1, i2, i3, i4,
               i5, i6, i7, i8, C0: tl.constexpr, C1: tl.constexpr):  # fmt: skip
    pass


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, python {sys.version.split()[0]}")  # fmt: skip
    rows: list[tuple[str, float]] = []

    def row(name, fn, **kw):
        try:
            us = host_us(fn, **kw)
        except Exception as exc:  # a piece that fails is reported, not fatal
            print(f"| {name} | failed: {type(exc).__name__}: {exc} |", flush=True)
            return
        rows.append((name, us))
        print(f"| {name} | {us:.2f} |", flush=True)

    print("| piece | host us/call |\n| --- | ---: |")
    T, k = 4096, 8
    for E in (16, 128):
        x = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
        row(f"public index_shuffling E={E}", lambda x=x: MR.index_shuffling(x, top_k=k))
        row(f"public route E={E}", lambda x=x: MR.route(x, k))
    E = 128
    x = torch.randn(T, E, device="cuda").softmax(-1).to(torch.bfloat16)
    lane._BOUND = {}
    args = (x, k, None, 0, E, False, False, False, True, None, True)
    R.routing_triton(*args)
    e = next(iter(lane._BOUND.values()))
    row("routing_triton, bound (IS E=128)", lambda: R.routing_triton(*args))
    row("_check", lambda: MR._check(x, "routing_scores", k, None, None, None))
    row("eager_direct", lambda: MR.eager_direct(x, None))
    row("eager_key", lambda: lane.eager_key(x, k, None, 0, E, False, False, False, True, None))

    n = e.n
    dev = x.device
    i32 = torch.int32
    row(f"torch.empty({n}) device=torch.device", lambda: torch.empty(n, dtype=i32, device=dev))
    row(f"torch.empty({n}) device='cuda'", lambda: torch.empty(n, dtype=i32, device="cuda"))
    buf = torch.empty(n, dtype=i32, device=dev)
    row(f"buf.split_with_sizes({len(e.split)} pieces)", lambda: buf.split_with_sizes(e.split))
    for m in (8, 32):
        big = torch.empty(m * n, dtype=i32, device=dev)
        sp = e.split * m
        row(f"split_with_sizes({len(sp)} pieces) / {m}",
            lambda big=big, sp=sp: big.split_with_sizes(sp), n=300 // m + 1)  # fmt: skip
        row(f"empty({m}n) + split({len(sp)}) / {m}, as one",
            lambda m=m, sp=sp: torch.empty(m * n, dtype=i32, device=dev).split_with_sizes(sp),
            n=300 // m + 1)  # fmt: skip
    row("buf[:4096] slice", lambda: buf[:4096])
    row("buf.view(torch.float32)", lambda: buf.view(torch.float32))
    row("buf[:32768].view(4096, 8)", lambda: buf[:32768].view(4096, 8))
    row("buf.unflatten / as_strided((4096,8),(8,1))", lambda: buf.as_strided((4096, 8), (8, 1)))
    row("buf.data_ptr()", lambda: buf.data_ptr())
    row("x.stride()", lambda: x.stride())
    row("x.shape", lambda: x.shape)
    row("x.get_device()", lambda: x.get_device())
    row("x.is_cuda", lambda: x.is_cuda)
    row("x.requires_grad", lambda: x.requires_grad)
    row("type(x) is Tensor", lambda: type(x) is torch.Tensor)
    row("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    row("torch._C._cuda_isCurrentStreamCapturing()", torch._C._cuda_isCurrentStreamCapturing)
    row("torch.compiler.is_compiling()", torch.compiler.is_compiling)
    row("_get_current_dispatch_mode()", _get_current_dispatch_mode)
    fa = getattr(torch._C, "_are_functorch_transforms_active", None)
    if fa is not None:
        row("torch._C._are_functorch_transforms_active()", fa)
    row("launch.current_stream(0)", lambda: launch.current_stream(0))
    row("torch.cuda.current_stream().cuda_stream",
        lambda: torch.cuda.current_stream().cuda_stream)  # fmt: skip
    row("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
    stream = launch.current_stream(0)
    row("barrier_words", lambda: R.barrier_words(0, stream))

    # launches
    bar = 0 if e.barrier is None else e.barrier(0, stream).data_ptr()
    bases = (buf.data_ptr(), x.data_ptr(), 0, bar)
    row(f"the bound launches ({'fused' if e.barrier is not None else 'A, C'})",
        lambda: e.launches(bases, stream))  # fmt: skip
    kn = _null[(1,)](buf)
    fnull = kn.function, kn.packed_metadata
    row("null kernel, k.run, 1 int ptr",
        lambda: kn.run(1, 1, 1, stream, *fnull, None, None, None, bases[0]))  # fmt: skip
    km = _null_many[(1,)](*([buf] * 14), *range(1, 10), C0=1, C1=2)
    fm = km.function, km.packed_metadata
    many = (*([bases[0]] * 14), *range(1, 10), 1, 2)
    row("null kernel, k.run, 14 ptrs + 9 ints + 2 constexprs",
        lambda: km.run(1, 1, 1, stream, *fm, None, None, None, *many))  # fmt: skip
    # k.run against launch.launcher's pick (the C function on triton 3.5 / 3.6), interleaved
    for name, kern, a in (("1 int ptr", kn, (bases[0],)),
                          ("14 ptrs + 9 ints + 2 constexprs", km, many)):  # fmt: skip
        go, pre = launch.launcher(kern)
        via = "C function" if go is not kern.run else "k.run"
        meta = (kern.function, kern.packed_metadata, None, None, None)
        t_run, t_go = ab_us(lambda k=kern, m=meta, a=a: k.run(1, 1, 1, stream, *m, *a),
                            lambda g=go, p=pre, a=a: g(1, 1, 1, stream, *p, *a))  # fmt: skip
        print(f"| null kernel, {name}: k.run / launch.launcher ({via}), interleaved | "
              f"{t_run:.2f} / {t_go:.2f} |", flush=True)  # fmt: skip
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
