"""One timer for every command: medians over repeated calls, and memory peaks.

* CUDA: each call is bracketed by CUDA events recorded on the current stream; the host
  synchronizes once, after the last call, then reads every event pair. ``do_bench`` style timing
  (Triton's ``triton.testing.do_bench``, which flushes the L2 cache between calls) is used for the
  kernel benchmarks through :func:`bench_us`.
* CPU: ``time.perf_counter`` around each call.

Memory figures are GiB read from the CUDA caching allocator; on CPU they are ``None``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

GIB = float(1 << 30)


def default_device() -> torch.device:
    """CUDA when a GPU is present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for every queued kernel on ``device`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """Per-call times in milliseconds, in call order."""

    times_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def p99_ms(self) -> float:
        return percentile(self.times_ms, 99.0)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.times_ms) if self.times_ms else math.nan

    @property
    def total_ms(self) -> float:
        return math.fsum(self.times_ms)


class EventTimer:
    """Times a sequence of calls without a host sync between them.

    ``with timer: fn()`` brackets one call; :meth:`result` synchronizes once and returns the
    :class:`Timing` of every bracketed call so far.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_ms: list[float] = []
        self._t0 = 0.0

    def __enter__(self) -> EventTimer:
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pairs.append((start, end))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda:
            self._pairs[-1][1].record()
        else:
            self._cpu_ms.append((time.perf_counter() - self._t0) * 1e3)

    def result(self) -> Timing:
        if self._cuda:
            synchronize(self.device)
            return Timing([s.elapsed_time(e) for s, e in self._pairs])
        return Timing(list(self._cpu_ms))


def time_fn(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    warmup: int = 3,
    iters: int = 10,
) -> Timing:
    """Call ``fn`` ``warmup`` times, then time ``iters`` calls (CUDA events or perf_counter)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    timer = EventTimer(device)
    for _ in range(iters):
        with timer:
            fn()
    return timer.result()


def graph_time_fn(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    warmup: int = 3,
    iters: int = 20,
    calls: int = 1,
) -> Timing | None:
    """Capture ``calls`` back-to-back calls of ``fn`` in one CUDA graph and time ``iters``
    replays (CUDA events), divided by ``calls``: the device time of one call without the host's
    launch cost (several calls also amortise the graph launch, ~10 us, over small kernels).
    None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    timing = time_fn(graph.replay, device, warmup=1, iters=iters)
    return Timing([ms / calls for ms in timing.times_ms]) if calls > 1 else timing


def bench_us(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    cpu_iters: int = 5,
) -> float:
    """Median time of one call of ``fn`` in microseconds.

    CUDA: ``triton.testing.do_bench(return_mode="median")`` (L2 flushed between calls); falls back
    to CUDA events when Triton's benchmarker is unavailable. CPU: perf_counter over ``cpu_iters``
    calls after one warm-up.
    """
    device = torch.device(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
            do_bench = None
        if do_bench is not None:
            return 1e3 * float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return 1e3 * time_fn(fn, device, warmup=5, iters=50).median_ms
    return 1e3 * time_fn(fn, device, warmup=1, iters=cpu_iters).median_ms


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window (CUDA); a no-op on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device | str) -> tuple[float | None, float | None]:
    """(allocated, reserved) GiB now on ``device``; (None, None) on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    return (
        torch.cuda.memory_allocated(device) / GIB,
        torch.cuda.memory_reserved(device) / GIB,
    )


def peak_memory_gib(device: torch.device | str) -> tuple[float | None, float | None]:
    """(peak allocated, peak reserved) GiB since the last :func:`reset_peak_memory`."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    synchronize(device)
    return (
        torch.cuda.max_memory_allocated(device) / GIB,
        torch.cuda.max_memory_reserved(device) / GIB,
    )
