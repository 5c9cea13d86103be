"""``moe-bench kernels --sweep routing``: ``index_shuffling`` and ``route`` over a grid of token
counts T, expert counts E, top-k and score dtypes, against torch-native routing and fbgemm_gpu.

One row per (op, dtype, T, E, k), times in microseconds: ``eager_us`` (ours, do_bench median, L2
flushed between calls), ``graph_us`` (ours, ``graph_calls`` calls captured in one CUDA graph and
replayed: no host launch cost, inputs warm in L2 when they fit), ``torch_us`` (torch-native topk +
stable sort + bincount, eager only: it syncs), ``fbgemm_us`` / ``fbgemm_graph_us`` (index_shuffling
rows: ``torch.ops.fbgemm.index_shuffling``). Derived: ``speedup_vs_torch`` = torch / eager,
``graph_speedup_vs_torch`` = torch / graph, ``vs_fbgemm`` = fbgemm / eager, ``vs_fbgemm_graph``
= fbgemm graph / graph (> 1: ours is faster), ``cliff_eager`` / ``cliff_graph`` = time(T) /
time(4T) along each (op, dtype, E, k) series (> 1.15: a cliff). Statuses: ``status`` (ours),
``graph_status``, ``torch_status``, ``fbgemm_status``.

Every timing is bounded by time, not by a count. ``jobs`` > 0 first compiles every launch plan in
that many spawned processes (Triton's on-disk cache), so the timing process only loads kernels.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache, partial
from itertools import product
from typing import Any

import torch

from moe_tools.memory import check_fits
from moe_tools.ops.routing import torch_route
from moe_tools.ops.spec import fbgemm_ops
from moe_tools.results import Result
from moe_tools.routing_sweep_report import SWEEP_CLIFF as CLIFF
from moe_tools.routing_sweep_report import format_sweep
from moe_tools.tables import Row, short_error
from moe_tools.timing import bench_us, default_device, graph_time_fn, synchronize

FULL_T = (1024, 4096, 16384, 65536, 262144, 1048576)
FULL_E = (8, 16, 32, 64, 128, 256, 320)
FULL_K = (1, 2, 4, 8)
QUICK_T, QUICK_E, QUICK_K = (64, 256), (8, 16), (1, 2)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OPS = ("index_shuffling", "route")

# Device-time bounds of one measurement (milliseconds).
EAGER_WARMUP_MS, EAGER_REP_MS = 2, 20  # do_bench window (it adds 5 estimate calls)
MIN_SAMPLES, MAX_REP_MS = 5, 150  # slow calls: widen the window to 5 calls, at most 150 ms
GRAPH_MS, GRAPH_REPLAY_US, GRAPH_MAX_CALLS = 5.0, 200.0, 10  # replay window, calls per graph

COLUMNS = [
    *("op", "dtype", "T", "E", "k", "eager_us", "graph_us", "graph_calls", "torch_us"),
    *("fbgemm_us", "fbgemm_graph_us", "speedup_vs_torch", "graph_speedup_vs_torch"),
    *("vs_fbgemm", "vs_fbgemm_graph", "cliff_eager", "cliff_graph"),
    *("status", "graph_status", "torch_status", "fbgemm_status"),
]

Point = tuple[str, int, int, int]  # (dtype, E, T, k)
Thunk = Callable[[], object]


# ----------------------------------------------------------------------------------------------
# the grid


@dataclass(frozen=True)
class Grid:
    T: tuple[int, ...]
    E: tuple[int, ...]
    k: tuple[int, ...]
    dtypes: tuple[str, ...]
    ops: tuple[str, ...] = OPS

    def points(self) -> list[Point]:
        """Every (dtype, E, T, k) with k <= E, in measuring order."""
        axes = product(self.dtypes, self.E, self.T, self.k)
        return [(d, E, T, k) for d, E, T, k in axes if k <= E]


def make_grid(
    *,
    quick: bool,
    T: Sequence[int] | None = None,
    E: Sequence[int] | None = None,
    k: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
) -> Grid:
    """The full grid, or the tiny ``quick`` one; any axis given replaces that axis."""
    for name, given, known in (("dtypes", dtypes, DTYPES), ("ops", ops, OPS)):
        unknown = sorted(set(given or ()) - set(known))
        if unknown:
            raise ValueError(f"unknown {name} {unknown}; known: {', '.join(known)}")
    for name, given in (("T", T), ("E", E), ("k", k)):
        if given is not None and min(given, default=0) < 1:
            raise ValueError(f"--sweep-{name} values must be positive, got {list(given)}")

    def axis(given: Sequence[int] | None, full: tuple[int, ...], small: tuple[int, ...]):
        return tuple(sorted(set(given))) if given else (small if quick else full)

    return Grid(
        axis(T, FULL_T, QUICK_T),
        axis(E, FULL_E, QUICK_E),
        axis(k, FULL_K, QUICK_K),
        tuple(d for d in DTYPES if d in (dtypes or DTYPES)),
        tuple(o for o in OPS if o in (ops or OPS)),
    )


def check_grid(grid: Grid, device: torch.device) -> None:
    """ValueError naming the flags before anything is measured: no point with k <= E, or the
    largest point's scores and outputs (about 16 bytes per score, 16 per routed pair) would not
    fit ``device``'s free memory."""
    if not grid.points():
        raise ValueError(
            f"--sweep-k {','.join(map(str, grid.k))}: every k is more than every E "
            f"({','.join(map(str, grid.E))}, --sweep-E): nothing to measure"
        )
    T, E, k = max(grid.T), max(grid.E), max(grid.k)
    check_fits(
        f"the sweep's largest point (T={T}, E={E})",
        16 * T * E + 16 * T * min(k, E),
        device,
        "its scores, their softmax and the routed indices",
        "Smaller --sweep-T or --sweep-E.",
    )


def make_scores(T: int, E: int, dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Softmax of fresh normal logits, (T, E) row-major, on ``gen``'s device."""
    logits = torch.randn(T, E, generator=gen, device=gen.device)
    return logits.softmax(dim=-1).to(DTYPES[dtype])


def op_thunks(scores: torch.Tensor, k: int) -> dict[str, Thunk]:
    """The public ops, as the sweep calls them."""
    import moe_kernels as mk

    return {
        "index_shuffling": lambda: mk.index_shuffling(scores, None, None, None, k),
        "route": lambda: mk.route(scores, k),
    }


@cache
def _fbgemm() -> tuple[Callable[..., Any] | None, str]:
    try:
        return fbgemm_ops().index_shuffling, "ok"
    except Exception as exc:
        return None, f"unavailable: {short_error(exc)}"


# ----------------------------------------------------------------------------------------------
# timing


@dataclass
class Timed:
    eager_us: float | None = None
    graph_us: float | None = None
    graph_calls: int | None = None
    status: str = "ok"
    graph_status: str = "-"


def _wall_ms(fn: Thunk, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def eager_us(fn: Thunk, device: torch.device, call_ms: float, warm: bool = False) -> float:
    """do_bench median in a window of EAGER_REP_MS, widened to MIN_SAMPLES calls for slow ones
    (``call_ms``: one call's wall time) up to MAX_REP_MS (``warm``: 1 ms, the path alone);
    perf_counter over 3 calls on CPU."""
    if device.type != "cuda":
        return bench_us(fn, device, cpu_iters=3)
    rep = 1 if warm else int(min(max(EAGER_REP_MS, MIN_SAMPLES * call_ms), MAX_REP_MS))
    return bench_us(fn, device, warmup_ms=1 if warm else EAGER_WARMUP_MS, rep_ms=rep)


def graph_plan(est_us: float) -> tuple[int, int]:
    """(calls per graph, replays): a replay lasts about GRAPH_REPLAY_US (amortising the graph's own
    launch over fast kernels), the replays about GRAPH_MS, at least 3."""
    est = max(est_us, 1.0)
    calls = max(1, min(GRAPH_MAX_CALLS, int(GRAPH_REPLAY_US // est)))
    return calls, max(3, min(50, int(GRAPH_MS * 1e3 / (calls * est))))


def _recover(device: torch.device) -> None:
    """After a failed call: drain the stream and give cached memory back (best effort)."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception:
            pass


def time_impl(
    fn: Thunk, device: torch.device, *, graph: bool, fail: str = "FAIL", warm: bool = False
) -> Timed:
    """Eager median, and the graph replay time when ``graph`` (CUDA only). The first call (plan
    compilation or load) is not timed; its errors give ``status`` = '<fail>: <error>'. ``warm``:
    the same calls with the shortest windows (the plan warm-up)."""
    out = Timed(graph_status="skipped: no CUDA" if graph and device.type != "cuda" else "-")
    try:
        fn()
        call_ms = _wall_ms(fn, device) if device.type == "cuda" else 0.0
        out.eager_us = eager_us(fn, device, call_ms, warm)
    except Exception as exc:
        out.status, out.graph_status = f"{fail}: {short_error(exc)}", "-"
        _recover(device)
        return out
    if graph and device.type == "cuda":
        calls, iters = graph_plan(out.eager_us)
        iters = 1 if warm else iters
        try:
            timing = graph_time_fn(fn, device, warmup=1, iters=iters, calls=calls)
            assert timing is not None
            out.graph_us, out.graph_calls, out.graph_status = 1e3 * timing.median_ms, calls, "ok"
        except Exception as exc:
            out.graph_status = f"capture failed: {short_error(exc)}"
            _recover(device)
    return out


def _fbgemm_timed(scores: torch.Tensor, k: int, device: torch.device) -> tuple[Timed, str]:
    if device.type != "cuda":
        return Timed(), "skipped: no CUDA"
    op, why = _fbgemm()
    if op is None:
        return Timed(), why
    peer = time_impl(partial(op, scores, top_k=k), device, graph=True, fail="unsupported")
    if peer.status != "ok":
        return peer, peer.status
    return peer, "ok" if peer.graph_status == "ok" else f"ok (graph {peer.graph_status})"


def measure_point(
    point: Point, scores: torch.Tensor, device: torch.device, ops: Sequence[str]
) -> list[Row]:
    """The raw rows (times and statuses) of one grid point, one per op."""
    dtype, E, T, k = point
    native = time_impl(partial(torch_route, scores, k), device, graph=False, fail="failed")
    thunks = op_thunks(scores, k)
    rows = []
    for op in ops:
        ours = time_impl(thunks[op], device, graph=True)
        peer, peer_status = Timed(), "n/a: fbgemm has no route"
        if op == "index_shuffling":
            peer, peer_status = _fbgemm_timed(scores, k, device)
        rows.append(
            {
                **dict(op=op, dtype=dtype, T=T, E=E, k=k),
                **dict(eager_us=ours.eager_us, graph_us=ours.graph_us),
                **dict(graph_calls=ours.graph_calls, torch_us=native.eager_us),
                **dict(fbgemm_us=peer.eager_us, fbgemm_graph_us=peer.graph_us),
                **dict(status=ours.status, graph_status=ours.graph_status),
                **dict(torch_status=native.status, fbgemm_status=peer_status),
            }
        )
    return rows


def failed_rows(point: Point, ops: Sequence[str], exc: BaseException) -> list[Row]:
    dtype, E, T, k = point
    return [
        dict(op=op, dtype=dtype, T=T, E=E, k=k, status=f"FAIL: {short_error(exc)}") for op in ops
    ]


# ----------------------------------------------------------------------------------------------
# derived columns and the summary


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def derive(rows: list[Row]) -> list[Row]:
    """Fill the speedup, vs_fbgemm and cliff columns of ``rows`` in place (and return them)."""
    series = {(r["op"], r["dtype"], r["E"], r["k"], r["T"]): r for r in rows}
    for r in rows:
        get = r.get
        r["speedup_vs_torch"] = _ratio(get("torch_us"), get("eager_us"))
        r["graph_speedup_vs_torch"] = _ratio(get("torch_us"), get("graph_us"))
        r["vs_fbgemm"] = _ratio(get("fbgemm_us"), get("eager_us"))
        r["vs_fbgemm_graph"] = _ratio(get("fbgemm_graph_us"), get("graph_us"))
        up = series.get((r["op"], r["dtype"], r["E"], r["k"], 4 * r["T"]), {})
        r["cliff_eager"] = _ratio(get("eager_us"), up.get("eager_us"))
        r["cliff_graph"] = _ratio(get("graph_us"), up.get("graph_us"))
    return rows


def where(r: Row, *, cliff: bool = False) -> str:
    T = f"T={r['T']}->{4 * r['T']}" if cliff else f"T={r['T']}"
    return f"{r['op']} {r['dtype']} E={r['E']} k={r['k']} {T}"


def _extreme(rows: Sequence[Row], col: str, pick: Callable, cliff: bool = False) -> dict | None:
    found = [r for r in rows if r.get(col) is not None]
    if not found:
        return None
    r = pick(found, key=lambda r: r[col])
    return {"value": r[col], "where": where(r, cliff=cliff)}


def summarize(rows: Sequence[Row]) -> dict[str, Any]:
    """Worst cliffs, least speedups vs torch-native, every point slower than fbgemm."""
    slower = [
        {
            "where": where(r),
            "vs_fbgemm": r.get("vs_fbgemm"),
            "vs_fbgemm_graph": r.get("vs_fbgemm_graph"),
        }
        for r in rows
        if any(r.get(c) is not None and r[c] < 1.0 for c in ("vs_fbgemm", "vs_fbgemm_graph"))
    ]
    return {
        "points": len(rows),
        "failed": sum(r.get("status") != "ok" for r in rows),
        "cliffs": sum(
            (r.get(c) or 0.0) > CLIFF for r in rows for c in ("cliff_eager", "cliff_graph")
        ),
        "worst_cliff_eager": _extreme(rows, "cliff_eager", max, cliff=True),
        "worst_cliff_graph": _extreme(rows, "cliff_graph", max, cliff=True),
        "min_speedup_eager": _extreme(rows, "speedup_vs_torch", min),
        "min_speedup_graph": _extreme(rows, "graph_speedup_vs_torch", min),
        "fbgemm_points": sum(r.get("fbgemm_us") is not None for r in rows),
        "slower_than_fbgemm": slower,
    }


# ----------------------------------------------------------------------------------------------
# plan warm-up in worker processes


def warm_points(points: Sequence[Point], device: str, ops: Sequence[str]) -> list[str]:
    """Time our ops at each point as the sweep does, with the shortest windows (the same scores
    for every k of a shape; no torch or fbgemm), compiling every launch plan the timing reaches
    into Triton's on-disk cache; returns one line per failure."""
    dev, errors = torch.device(device), []
    gen = torch.Generator(device=dev).manual_seed(0)
    shape, scores = None, None
    with torch.no_grad():
        for point in points:
            dtype, E, T, k = point
            try:
                if shape != (dtype, E, T):
                    shape, scores = None, None  # free the last shape's scores first
                    scores, shape = make_scores(T, E, dtype, gen), (dtype, E, T)
                thunks = op_thunks(scores, k)
                for op in ops:
                    timed = time_impl(thunks[op], dev, graph=True, warm=True)
                    if timed.status != "ok" or timed.graph_status not in ("ok", "skipped: no CUDA"):
                        errors.append(f"{point} {op}: {timed.status}, graph {timed.graph_status}")
            except Exception as exc:
                errors.append(f"{point}: {short_error(exc)}")
                _recover(dev)
    return errors


def warm_plans(grid: Grid, device: torch.device, jobs: int) -> dict[str, Any]:
    """:func:`warm_points` over the grid in ``jobs`` spawned processes (the shapes (dtype, E, T)
    dealt round-robin, all k of a shape to one process); returns what happened: seconds,
    failures (the first 20 of them)."""
    t0, points = time.perf_counter(), grid.points()
    shapes = list(dict.fromkeys(p[:3] for p in points))
    dealt = [set(shapes[i::jobs]) for i in range(min(jobs, len(shapes)))]
    chunks = [c for c in ([p for p in points if p[:3] in d] for d in dealt) if c]
    ctx = multiprocessing.get_context("spawn")
    errors: list[str] = []
    with ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        futures = [pool.submit(warm_points, c, str(device), grid.ops) for c in chunks]
        for f in futures:
            try:
                errors += f.result()
            except Exception as exc:  # a worker died: the timing process compiles the rest
                errors.append(f"worker: {short_error(exc)}")
    seconds = time.perf_counter() - t0
    return {"jobs": len(chunks), "seconds": seconds, "failed": len(errors), "errors": errors[:20]}


# ----------------------------------------------------------------------------------------------
# the sweep


def spin_up(device: torch.device, ms: float = 300.0) -> None:
    """Keep the GPU busy for ``ms`` so that its clocks leave idle before the first timing."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            a @ a
        synchronize(device)


def triton_cache_entries() -> int | None:
    """Entries in Triton's on-disk cache (one per compiled kernel), or None where unreadable."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    try:
        return len(os.listdir(path))
    except OSError:
        return None


def _say(text: str) -> None:
    print(f"[sweep routing] {text}", file=sys.stderr, flush=True)


def run(
    *,
    device: torch.device | str | None = None,
    quick: bool = False,
    T: Sequence[int] | None = None,
    E: Sequence[int] | None = None,
    k: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
    jobs: int = 0,
    seed: int = 0,
    checkpoint: Callable[[Result], None] | None = None,
) -> Result:
    """Measure the grid (the tiny one off CUDA); ``checkpoint`` gets the partial Result after each
    (dtype, E) group, so that a killed run leaves its rows behind."""
    device = torch.device(device) if device is not None else default_device()
    quick = quick or device.type != "cuda"
    grid = make_grid(quick=quick, T=T, E=E, k=k, dtypes=dtypes, ops=ops)
    check_grid(grid, device)
    extra: dict[str, Any] = {"sweep": "routing", "quick": quick, "grid": asdict(grid)}
    if jobs > 0 and device.type == "cuda":
        _say(f"compiling the plans of {len(grid.points())} points in {jobs} processes")
        extra["warmup"] = warm_plans(grid, device, jobs)
        warm = extra["warmup"]
        _say(f"plans ready in {warm['seconds']:.1f} s, {warm['failed']} failure(s)")
    spin_up(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = [(d, e) for d in grid.dtypes for e in grid.E]
    rows: list[Row] = []
    t0, extra["groups"] = time.perf_counter(), []
    for i, (dtype, e) in enumerate(groups, 1):
        _say(f"{dtype} E={e} ({i}/{len(groups)}), {time.perf_counter() - t0:.1f} s so far")
        t1, n1 = time.perf_counter(), triton_cache_entries()
        rows += _measure_group(grid, dtype, e, gen, device)
        n2 = triton_cache_entries()
        compiled = n2 - n1 if n1 is not None and n2 is not None else None
        log = dict(dtype=dtype, E=e, seconds=time.perf_counter() - t1, new_kernels=compiled)
        extra["groups"].append(log)
        if compiled:  # the warm-up (or none) left these to compile here, inside the timing
            _say(f"{dtype} E={e}: {compiled} kernel(s) compiled while timing")
        extra["seconds"] = time.perf_counter() - t0
        if checkpoint is not None:
            checkpoint(_result(rows, dict(extra, partial=i < len(groups))))
    _say(f"done: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    return _result(rows, dict(extra, partial=False))


def _measure_group(
    grid: Grid, dtype: str, E: int, gen: torch.Generator, device: torch.device
) -> list[Row]:
    rows: list[Row] = []
    with torch.no_grad():
        for T in grid.T:
            points = [(dtype, E, T, k) for k in grid.k if k <= E]
            try:
                scores = make_scores(T, E, dtype, gen)
            except Exception as exc:
                rows += [r for p in points for r in failed_rows(p, grid.ops, exc)]
                _recover(device)
                continue
            for p in points:
                try:
                    rows += measure_point(p, scores, device, grid.ops)
                except Exception as exc:
                    rows += failed_rows(p, grid.ops, exc)
                    _recover(device)
            del scores  # freed here (refcount); no gc.collect: it costs ~0.2 s with torch loaded
            _recover(device)
    return rows


def _result(rows: list[Row], extra: dict[str, Any]) -> Result:
    rows = derive([{c: r.get(c) for c in COLUMNS} for r in rows])
    extra["summary"] = summarize(rows)
    return Result("kernels", rows, COLUMNS, extra, text=format_sweep(rows, extra["summary"]))
