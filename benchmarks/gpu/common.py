"""Shared by the GPU sweep scripts: CUDA-graph timing and an sm_90a compile report."""

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


def compile_sm90(kern, sig: dict, consts: dict, divisible: list[str], num_warps: int,
                 num_stages: int) -> tuple[object, str, str, str]:  # fmt: skip
    """Compile ``kern`` for sm_90a on this machine (no GPU needed) and run ptxas on its PTX.
    ``divisible``: arguments given the 16-divisibility attribute (constexprs are skipped).
    Returns (compiled kernel, ptx, registers, spill-store bytes); '?' where ptxas says nothing."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (kern.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in divisible
        if sig.get(n) != "constexpr"
    }
    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    finally:
        os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return compiled, ptx, regs[0] if regs else "?", spills[0] if spills else "?"
