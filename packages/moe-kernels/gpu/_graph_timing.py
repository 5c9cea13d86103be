"""Shared by the GPU sweep scripts: device time of a call, replayed from a CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int, replays: int, dry: bool = False) -> float:
    """Median over ``replays`` of (one graph of ``calls`` calls of fn) / ``calls``, in us.
    ``dry`` (CPU runs of the scripts): one timed eager call instead."""
    if dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # warm up: compile, allocator
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
