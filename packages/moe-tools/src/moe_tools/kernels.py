"""``moe-bench kernels``: every public op of moe-kernels (the op registry, ``moe_tools.ops``) at
its benchmark shapes, beside the torch-native version it replaces, its peers (FBGEMM, torchao)
when they import, and a clone of the same bytes.

One row per (op, shape). Columns: ``us`` (median, ``do_bench`` on CUDA: L2 flushed between
calls), ``graph_us`` (device time of one call replayed from a CUDA graph: no host launch cost),
``gbps`` (bytes read + written, the minimum traffic, over the time), ``pct_ceiling`` (of the copy
ceiling: ``clone()`` of a 1 GiB buffer, measured once per run), ``tflops`` (GEMMs),
``torch_us`` and ``speedup`` (torch-native time / ours), ``fbgemm_us`` / ``vs_fbgemm`` and
``torchao_us`` / ``vs_torchao`` (the peer's time / ours: > 1, ours is faster), ``clone_us``,
``vs_clone`` and ``graph_vs_clone`` (a same-bytes clone's time / ours: 1.0 = as fast as a copy).

On a CPU the public ops run their torch reference (the Triton kernels need CUDA; Triton's
interpreter, ``TRITON_INTERPRET=1``, runs them for correctness, not speed): the times say
nothing about the kernels, and there is no copy ceiling or clone to compare with.
``--sweep routing`` measures a grid of routing problems instead (``moe_tools.routing_sweep``).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moe_tools import command as cmd
from moe_tools import routing_sweep, routing_sweep_report, tables
from moe_tools.ops import REGISTRY, OpSpec, Problem, fbgemm_ops
from moe_tools.ops.spec import execution_path
from moe_tools.plots import pyplot, save_figure
from moe_tools.results import Result, slug
from moe_tools.tables import Row, format_table, markdown_table, non_empty, short_error
from moe_tools.timing import bench_us, default_device, graph_time_fn

PEERS = ("torch", "fbgemm", "torchao")
COLUMNS = [
    *("op", "shape", "us", "graph_us", "gbps", "pct_ceiling", "tflops", "torch_us", "speedup"),
    *("fbgemm_us", "vs_fbgemm", "torchao_us", "vs_torchao", "clone_us", "vs_clone"),
    *("graph_vs_clone", "bytes", "status"),
]
CPU_NOTE = (
    "CPU: moe_kernels ran its torch reference path (its Triton kernels run on CUDA; "
    "TRITON_INTERPRET=1 runs them in Triton's interpreter, to test, not to time): these times "
    "say nothing about the kernels' speed; no copy ceiling or clone on a CPU"
)
INTERPRETER_NOTE = (
    "the Triton kernels ran in Triton's interpreter (TRITON_INTERPRET=1): numpy on the CPU, "
    "times meaningless as speed"
)


# ----------------------------------------------------------------------------------------------
# measurement


def copy_ceiling_gbps(device: torch.device) -> float:
    """Bytes read + written per second by ``clone()`` of a buffer far larger than the caches
    (1 GiB, at most 1/8 of the GPU's memory; 32 MiB on a CPU)."""
    if device.type == "cuda":
        n = min(1 << 30, torch.cuda.get_device_properties(device).total_memory // 8)
    else:
        n = 32 << 20
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    buf.fill_(1)
    us = bench_us(buf.clone, device)
    del buf
    return 2 * n / us / 1e3


def clone_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer whose clone reads + writes ``nbytes``."""
    return torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device=device)


def graph_us(fn: Callable[[], object], device: torch.device, calls: int) -> float | None:
    """Median device time of one call replayed from a CUDA graph of ``calls`` calls, or None on
    CPU or when capture fails."""
    try:
        timing = graph_time_fn(fn, device, warmup=2, iters=50, calls=calls)
    except Exception:
        return None
    return None if timing is None else 1e3 * timing.median_ms


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def peer_makers(spec: OpSpec, device: torch.device) -> dict[str, Callable[[Problem], Any]]:
    """The peers of ``spec`` that can run on ``device``, each a maker of a thunk: the
    torch-native version everywhere, FBGEMM and torchao on CUDA (FBGEMM when it imports)."""
    makers: dict[str, Callable[[Problem], Any] | None] = {"torch": spec.native}
    if device.type == "cuda":
        fbgemm = spec.fbgemm
        makers["fbgemm"] = fbgemm and (lambda p: fbgemm(fbgemm_ops(), p))
        makers["torchao"] = spec.torchao
    return {name: make for name, make in makers.items() if make is not None}


def measure(
    spec: OpSpec,
    problem: Problem,
    device: torch.device,
    ceiling: float | None,
    missing: dict[str, str] | None = None,
) -> tuple[Row, list[str]]:
    """One row: ours, its peers and a same-bytes clone; and a line per peer that did not run.
    A peer that does not import is recorded once in ``missing`` (and skipped from then on)."""
    missing = {} if missing is None else missing
    nbytes = spec.bytes_moved(problem)
    row: Row = {c: None for c in COLUMNS}
    row.update(op=spec.name, shape=problem.label, bytes=nbytes, status="ok")
    ours = spec.thunk(problem)
    try:
        ours()  # first call: compiles / autotunes, and surfaces errors
        row["us"] = us = bench_us(ours, device)
    except Exception as exc:
        row["status"] = f"unavailable: {short_error(exc)}"
        return row, []
    cuda = device.type == "cuda"
    # small cases (under 64 MB moved) go 10 calls to a graph, so that the graph's own launch
    # (~10 us) does not swamp microsecond kernels; ours and the clone get the same count
    calls = 10 if nbytes < 64 * 2**20 else 1
    row["graph_us"] = graph_us(ours, device, calls) if cuda else None
    row["gbps"] = nbytes / us / 1e3
    row["pct_ceiling"] = 100.0 * row["gbps"] / ceiling if ceiling else None
    if spec.flops is not None:
        row["tflops"] = spec.flops(problem) / us / 1e6
    skipped = []
    for name, make in peer_makers(spec, device).items():
        if name in missing:
            continue
        try:
            fn = make(problem)
            fn()
            row[f"{name}_us"] = bench_us(fn, device)
        except ImportError as exc:
            missing[name] = short_error(exc)
        except Exception as exc:
            skipped.append(f"{spec.name} {problem.label}: {name}: {short_error(exc)}")
    row["speedup"] = _ratio(row["torch_us"], us)
    row["vs_fbgemm"] = _ratio(row["fbgemm_us"], us)
    row["vs_torchao"] = _ratio(row["torchao_us"], us)
    if cuda:
        buf = clone_buffer(nbytes, device)
        row["clone_us"] = bench_us(buf.clone, device)
        row["vs_clone"] = _ratio(row["clone_us"], us)
        row["graph_vs_clone"] = _ratio(graph_us(buf.clone, device, calls), row["graph_us"])
        del buf
    return row, skipped


INSTALL = {"fbgemm": "pip install fbgemm-gpu-genai", "torchao": "pip install torchao"}


def run(
    *,
    device: torch.device | str | None = None,
    quick: bool = False,
    ops: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Result:
    """One row per (op, shape) of the registry (``ops``: these only); ``quick`` (always on a
    CPU): the small shapes. ``extra``: the execution path, the copy ceiling (CUDA)."""
    device = torch.device(device) if device is not None else default_device()
    quick = quick or device.type != "cuda"
    unknown = sorted(set(ops or ()) - set(REGISTRY))
    if unknown:
        raise cmd.UsageError(f"unknown ops {unknown}; known: {', '.join(REGISTRY)}")
    path = execution_path(device)
    ceiling = copy_ceiling_gbps(device) if path == "triton" else None
    specs = [s for name, s in REGISTRY.items() if ops is None or name in ops]
    jobs = [(spec, sizes) for spec in specs for sizes in spec.sizes["quick" if quick else "full"]]
    gen = torch.Generator(device=device).manual_seed(seed)
    rows: list[Row] = []
    notes: list[str] = []
    missing: dict[str, str] = {}
    bar = tables.progress(jobs, enabled=progress, desc="kernels", unit="case")
    with torch.no_grad():
        for spec, sizes in bar:
            bar.set_postfix_str(spec.name)
            try:
                problem = spec.make(sizes, gen, device)
            except Exception as exc:
                status = f"unavailable: {short_error(exc)}"
                rows.append({**{c: None for c in COLUMNS}, "op": spec.name, "status": status})
                continue
            row, skipped = measure(spec, problem, device, ceiling, missing)
            rows.append(row)
            notes += skipped
            del problem
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    notes += [f"{p}: not measured ({why}; {INSTALL.get(p, '')})" for p, why in missing.items()]
    if path == "triton":
        notes.insert(0, f"copy ceiling (clone of a large buffer, read + write): {ceiling:.1f} GB/s")
    else:
        notes.insert(0, CPU_NOTE if path == "reference" else INTERPRETER_NOTE)
    extra = {"path": path, "ceiling_gbps": ceiling, "quick": quick, "notes": notes}
    return Result("kernels", rows, COLUMNS, extra, text=format_rows(rows))


def format_rows(rows: Sequence[Row]) -> str:
    """The table with only the columns that hold a value (peers that did not run drop out)."""
    return format_table(rows, non_empty(rows, COLUMNS))


# ----------------------------------------------------------------------------------------------
# the command

SWEEP_ONLY = ("sweep_T", "sweep_E", "sweep_k", "sweep_dtypes", "jobs")
MAX_JOBS = 1024  # --jobs: compile processes (the sweep starts at most one per shape)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small shapes (always on a CPU)")
    p.add_argument(
        "--ops", type=cmd.choices_csv(tuple(REGISTRY)), help="only these ops (e.g. route,combine)"
    )
    cmd.plot_option(p, "GB/s against bytes moved, with the copy ceiling (--sweep: heatmaps)")
    p.add_argument(
        "--sweep",
        choices=("routing",),
        help="a grid instead of the op list: routing = index_shuffling and route over "
        "T x E x k x dtype, vs torch-native and fbgemm (--ops route narrows it)",
    )
    sweep = p.add_argument_group("--sweep routing")
    sweep.add_argument("--sweep-T", type=cmd.int_csv, metavar="T,..", help="token counts")
    sweep.add_argument("--sweep-E", type=cmd.int_csv, metavar="E,..", help="expert counts")
    sweep.add_argument("--sweep-k", type=cmd.int_csv, metavar="K,..", help="top-k values")
    sweep.add_argument(
        "--sweep-dtypes",
        type=cmd.choices_csv(tuple(routing_sweep.DTYPES)),
        metavar="bf16,fp32",
        help="score dtypes",
    )
    sweep.add_argument(
        "--jobs",
        type=cmd.integer(0, MAX_JOBS, "a process count"),
        default=0,
        metavar="N",
        help="on CUDA: compile every plan first in N processes (default 0: inline)",
    )


def result_name(args: argparse.Namespace) -> str:
    if args.sweep:
        grid = [
            f"{a}={'+'.join(map(str, v))}"
            for a in ("T", "E", "k")
            if (v := getattr(args, f"sweep_{a}"))
        ]
        return slug("kernels-sweep", args.sweep, grid, args.sweep_dtypes, args.ops)
    return slug("kernels", "quick" if args.quick else None, args.ops)


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    if args.sweep is None:
        given = [n for n in SWEEP_ONLY if getattr(args, n)]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise cmd.UsageError(f"{flags} need(s) --sweep routing")
        return run(
            device=args.device,
            quick=args.quick,
            ops=args.ops,
            seed=args.seed,
            progress=not args.no_progress,
        )
    bad = sorted(set(args.ops or ()) - set(routing_sweep.OPS))
    if bad:
        raise cmd.UsageError(
            f"--ops {','.join(bad)}: the routing sweep measures {', '.join(routing_sweep.OPS)}"
        )
    return routing_sweep.run(
        device=args.device,
        quick=args.quick,
        T=args.sweep_T,
        E=args.sweep_E,
        k=args.sweep_k,
        dtypes=args.sweep_dtypes,
        ops=args.ops,
        jobs=args.jobs,
        seed=args.seed,
        checkpoint=checkpoint,
    )


def markdown(doc: Mapping[str, Any], path: Path) -> str:
    """A sweep's compact table and summary, or the op table (without the empty columns)."""
    extra = doc.get("extra") or {}
    if extra.get("sweep") == "routing":
        return routing_sweep_report.markdown_sweep(doc)
    rows = doc.get("rows", [])
    parts = [markdown_table(rows, non_empty(rows, doc.get("columns") or COLUMNS))]
    notes = extra.get("notes") or []
    if notes:
        parts += ["", *(f"* {n}" for n in notes)]
    return "\n".join(parts)


def plot(result: Result, path: str | os.PathLike[str]) -> Path:
    if result.extra.get("sweep") == "routing":
        return routing_sweep_report.plot_sweep(result.rows, path)
    return plot_bandwidth(result.rows, result.extra.get("ceiling_gbps"), path)


def plot_bandwidth(
    rows: Sequence[Mapping[str, Any]], ceiling_gbps: float | None, path: str | os.PathLike[str]
) -> Path:
    """GB/s against bytes moved, one series per implementation, the copy ceiling as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    series = {"moe_kernels": "us", **{p: f"{p}_us" for p in PEERS}, "clone": "clone_us"}
    markers = "os^vD<>xP*"
    for i, (impl, col) in enumerate(series.items()):
        pts = sorted(
            (float(r["bytes"]), r["bytes"] / r[col] / 1e3, str(r["op"]))
            for r in rows
            if r.get(col) and r.get("bytes")
        )
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=impl, marker=markers[i])
        if impl == "moe_kernels":
            for x, y, op in pts:
                ax.annotate(
                    op, (x, y), fontsize=6, alpha=0.7, xytext=(3, 3), textcoords="offset points"
                )
    if ceiling_gbps:
        ax.axhline(
            ceiling_gbps, color="k", linestyle="--", label=f"copy ceiling {ceiling_gbps:.0f} GB/s"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per call (read + written)")
    ax.set_ylabel("GB/s")
    ax.set_title("moe-bench kernels: effective bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


COMMAND = cmd.Command(
    name="kernels",
    help="each moe-kernels op vs torch-native, FBGEMM / torchao and a clone of the same bytes",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=result_name,
    markdown=markdown,
    plot=plot,
)
