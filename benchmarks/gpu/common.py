"""The helpers the timing scripts in ``benchmarks/gpu/`` share: one copy of each.

How the scripts run (the one convention): as files, from the repository root, with the three
packages' sources on PYTHONPATH (they need not be installed)::

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/<script>.py

Python puts the script's own folder (``benchmarks/gpu``) first on ``sys.path``, so ``import
common`` (or one script importing another) resolves here with no ``sys.path`` edits. Importing a
script any other way (``python3 -c``, a test) needs ``benchmarks/gpu`` on PYTHONPATH as well.
``benchmarks/`` may import all three packages; the packages never import ``benchmarks/``.

The scripts time; correctness lives in the GPU tests (``pytest -m gpu``, ``nox -s gpu``). A
script checks in one line at most that what it timed is sane. The checks' helpers (no host
sync, poisoned outputs, bitwise equality, CUDA-graph capture) are ``moe_kernels.testing``'s.

The rule: a script drives kernel variants only through the library's typed override channel
(the configs and keyword overrides the launchers accept: ``config=``, ``block_c=``, ``warps=``,
``native_cast=``, ...), never by patching kernel source or module globals.

What is here:

* timing: :func:`bench_us` (``do_bench`` median, L2 flushed between calls; moe_tools.timing's),
  :func:`graph_us` (device time per call: a CUDA graph of N calls replayed; moe_tools.timing's
  ``graph_time_fn``), :func:`graph_bench_us` (``do_bench`` over the replay of a graph of one call),
  :func:`host_us` (the host's wall time per call, back to back), :func:`back_to_back_us` (the
  same loop timed by CUDA events), :func:`once_us` (one eager call: what the CPU dry runs time);
* yardsticks: :func:`clone_of` (a clone moving a given number of bytes),
  :func:`torch_router_scores` (the router's torch formula);
* :func:`compile_sm90`: a ``@triton.jit`` kernel compiled for sm_90a without a GPU, with ptxas's
  register and spill report;
* :func:`config_sweep_main`: the command line of a per-shape kernel sweep (``--shapes``,
  ``--configs``, ``--dry-run``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_kernels.testing import capture
from moe_tools.timing import bench_us as _bench_us
from moe_tools.timing import graph_time_fn

# ------------------------------------------------------------------------------------ timing


def once_us(fn: Callable[[], object]) -> float:
    """Wall time of one eager call of fn, us (the dry runs' stand-in for every timer)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def bench_us(
    fn: Callable[[], object], *, dry: bool = False, warmup_ms: int = 25, rep_ms: int = 100
) -> float:
    """Median time of one call, us: ``triton.testing.do_bench(return_mode="median")``, which
    flushes the L2 between calls (``moe_tools.timing.bench_us``). ``dry``: :func:`once_us`."""
    if dry:
        return once_us(fn)
    return _bench_us(fn, "cuda", warmup_ms=warmup_ms, rep_ms=rep_ms)


def graph_us(fn: Callable[[], object], calls: int, replays: int, dry: bool = False) -> float:
    """Median over ``replays`` of (one CUDA graph of ``calls`` calls of fn) / ``calls``, us: the
    device time of one call without the host's launch cost (``moe_tools.timing.graph_time_fn``,
    two warm-up calls first). ``dry``: :func:`once_us`."""
    if dry:
        return once_us(fn)
    timing = graph_time_fn(fn, "cuda", warmup=2, iters=replays, calls=calls)
    return timing.median_ms * 1e3


def graph_bench_us(fn: Callable[[], object], *, dry: bool = False, rep_ms: int = 100) -> float:
    """:func:`bench_us` of the replay of a CUDA graph holding one call of fn: the GPU time without
    launch gaps, L2 flushed between replays. ``dry``: :func:`once_us`."""
    if dry:
        return once_us(fn)
    graph, _ = capture(fn)
    return bench_us(graph.replay, rep_ms=rep_ms)


def host_us(
    fn: Callable[[], object],
    calls: int = 200,
    repeats: int = 5,
    warmup: int = 3,
    dry: bool = False,
) -> float:
    """The host's wall time per call of ``calls`` back-to-back eager calls, median of ``repeats``
    loops, us (the GPU synchronized before each loop, not inside it: where the GPU keeps up, this
    is the host's cost of a call). ``dry``: :func:`once_us`."""
    if dry:
        return once_us(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def back_to_back_us(fn: Callable[[], object], calls: int = 200, warmup: int = 10) -> float:
    """Time per call of ``calls`` back-to-back eager calls between two CUDA events, us: no L2
    flush, and the host's launch cost shows wherever the GPU waits for it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


# -------------------------------------------------------------------------------- yardsticks


def clone_of(nbytes: int, device: torch.device | str = "cuda") -> Callable[[], torch.Tensor]:
    """A call that clones a uint8 buffer of ``nbytes // 2``: ``nbytes`` moved (read + written),
    the copy ceiling of an op that moves that many bytes."""
    buf = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    return buf.clone


def torch_router_scores(
    x_TD: torch.Tensor, w_ED: torch.Tensor, score_fn: str = "softmax"
) -> torch.Tensor:
    """The router's torch formula: ``softmax`` (or ``sigmoid``) of ``F.linear(x.float(), w)``,
    fp32 (what ``moe_kernels.router_scores`` replaces)."""
    logits_TE = F.linear(x_TD.float(), w_ED.float())
    if score_fn == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    return torch.sigmoid(logits_TE)


# -------------------------------------------------------------------------- sm_90a compile


def compile_sm90(kern, sig: dict, consts: dict, divisible: list[str], num_warps: int,
                 num_stages: int) -> tuple[object, str, str, str]:  # fmt: skip
    """Compile ``kern`` (a ``@triton.jit`` function) for sm_90a on this machine (no GPU needed)
    and run ptxas on its PTX. ``sig``: argument name -> Triton type (``"*bf16"``, ``"i32"``,
    ``"constexpr"``, ...); ``consts``: the constexpr values; ``divisible``: arguments given the
    16-divisibility attribute (constexprs are skipped). Returns (compiled kernel, ptx, registers,
    spill-store bytes); '?' where ptxas says nothing."""
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
    try:  # the ptxas this Triton takes for sm_90 (3.9 takes its newer "ptxas-blackwell")
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    finally:
        os.unlink(f.name)
    out = run.stderr
    if run.returncode:
        raise RuntimeError(f"{ptxas} failed: {out.strip()[:300]}")
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return compiled, ptx, regs[0] if regs else "?", spills[0] if spills else "?"


# --------------------------------------------------------------------------- sweep scripts


def config_sweep_main(doc: str, shapes: dict, tiny: tuple, other_configs: list, run_shape,
                      header: str) -> None:  # fmt: skip
    """The command line of a kernel's per-shape config sweep: ``--shapes`` (names of ``shapes``,
    all by default), ``--configs`` (``other_configs`` beside the default, None), ``--dry-run``
    (the ``tiny`` shape in fp32 on the CPU). Prints ``header``, then calls ``run_shape(name,
    shape, configs, device, dtype, dry)`` per shape (bf16 on CUDA)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--shapes", default=",".join(shapes))
    p.add_argument("--configs", action="store_true", help="other launch configs beside the default")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    configs = [None] + (other_configs if args.configs else [])
    print(header)
    chosen = {"tiny": tiny} if args.dry_run else {s: shapes[s] for s in args.shapes.split(",")}
    for name, shape in chosen.items():
        run_shape(name, shape, configs, dev, dtype, args.dry_run)
