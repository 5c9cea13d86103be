"""Presentation: the environment header, aligned tables, JSON documents, plots, markdown pages.

Rows are plain dicts (column name -> value); every command returns a list of them and this module
turns them into text, JSON or a figure. Nothing here measures anything.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

Row = dict[str, Any]


@dataclass
class Result:
    """What a command returns: its rows, the columns to print (in order), and extra data that is
    not a row (a ceiling, a per-frame series), all JSON-able. ``text``, when set, is printed
    instead of the rows' table (a sweep's compact pivot); the JSON keeps the rows."""

    command: str
    rows: list[Row]
    columns: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    text: str | None = None


SCHEMA = "moe-bench/1"
PACKAGES = ("moe-kernels", "moe-model", "moe-tools", "triton", "fbgemm-gpu", "torchao", "numpy")


# ----------------------------------------------------------------------------------------------
# environment


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """What the numbers were measured on: versions, GPU, OS (a flat JSON-able dict)."""
    device = torch.device(device) if device is not None else None
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "os": platform.platform(),
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device) if device is not None else None,
        "gpu": None,
        "gpu_memory_gib": None,
        "gpu_capability": None,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "MOE_KERNELS_BACKEND": os.environ.get("MOE_KERNELS_BACKEND"),
    }
    for dist in PACKAGES:
        env[dist] = _version(dist)
    if torch.cuda.is_available():
        idx = device.index if device is not None and device.type == "cuda" else None
        props = torch.cuda.get_device_properties(idx if idx is not None else 0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / float(1 << 30), 1)
        env["gpu_capability"] = f"{props.major}.{props.minor}"
    return env


def machine_slug(device: torch.device | str | None = None) -> str:
    """A folder-friendly machine name: the GPU's name on CUDA ("nvidia-h200"), else "cpu-<arch>"."""
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    name = torch.cuda.get_device_name(device) if use_cuda else f"cpu-{platform.machine()}"
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "unknown"


def results_folder(root: str | os.PathLike[str] = "benchmarks/results") -> Path:
    """``<root>/<machine>-<UTC date>``: where a benchmark run's JSON files go."""
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return Path(root) / f"{machine_slug()}-{day}"


def format_environment(env: Mapping[str, Any]) -> str:
    """A few aligned lines: the header every command prints before its table."""
    gpu = "none"
    if env.get("gpu"):
        gpu = f"{env['gpu']} ({env['gpu_memory_gib']} GiB, sm {env['gpu_capability']})"
    pkgs = ", ".join(f"{p} {env[p]}" for p in PACKAGES if env.get(p) and p != "triton")
    lines = [
        ("torch", f"{env.get('torch')} (CUDA {env.get('cuda') or 'none'})"),
        ("triton", str(env.get("triton") or "not installed")),
        ("device", f"{env.get('device')}  GPU: {gpu}"),
        ("os", f"{env.get('os')}, Python {env.get('python')}, {env.get('cpu_count')} CPUs"),
        ("packages", pkgs or "-"),
    ]
    flags = [f"{k}={env[k]}" for k in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND") if env.get(k)]
    if flags:
        lines.append(("env", " ".join(flags)))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"# {k.ljust(width)}  {v}" for k, v in lines)


def short_error(exc: BaseException, limit: int = 120) -> str:
    """One line naming the exception: 'Type: first line of the message' (clipped)."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# progress


class _NoBar:
    """Stands in for a tqdm bar when tqdm is missing or progress is off."""

    def __init__(self, iterable: Iterable[Any] | None = None, **_: Any) -> None:
        self._it = iterable

    def __iter__(self) -> Any:
        return iter(self._it if self._it is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable: Iterable[Any] | None = None, *, enabled: bool = True, **kw: Any) -> Any:
    """A tqdm progress bar on stderr (``leave=False``), or a silent stand-in."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is a dependency, but keep the commands usable without it
            pass
        else:
            return tqdm(iterable, leave=False, **kw)
    return _NoBar(iterable)


# ----------------------------------------------------------------------------------------------
# tables


def format_value(value: Any) -> str:
    """How one cell prints: '-' for missing, 3-4 significant digits, scientific for tiny errors."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "0"
        mag = abs(value)
        if mag < 1e-2 or mag >= 1e6:
            return f"{value:.2e}"
        if mag >= 100:
            return f"{value:.1f}"
        return f"{value:.3g}" if mag < 1 else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def _is_numeric(values: Iterable[Any]) -> bool:
    vals = [v for v in values if v is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """An aligned plain-text table: numbers right-aligned, text left-aligned."""
    cols = _columns(rows, columns)
    if not cols:
        return "(no rows)"
    cells = [[format_value(row.get(c)) for c in cols] for row in rows]
    numeric = [_is_numeric(row.get(c) for row in rows) for c in cols]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def line(vals: Sequence[str]) -> str:
        out = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cols), sep] + [line(r) for r in cells])


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The same table as GitHub markdown."""
    cols = _columns(rows, columns)
    if not cols:
        return "_(no rows)_"
    numeric = [_is_numeric(row.get(c) for row in rows) for c in cols]
    head = "| " + " | ".join(cols) + " |"
    align = "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"
    body = [
        "| " + " | ".join(format_value(row.get(c)).replace("|", "\\|") for c in cols) + " |"
        for row in rows
    ]
    return "\n".join([head, align, *body])


# ----------------------------------------------------------------------------------------------
# routing sweep tables (``moe-bench kernels --sweep routing``)

SWEEP_CLIFF = 1.15  # time(T) / time(4T) above this is a cliff
SWEEP_LEGEND = (
    "cell: eager us / graph us, speedup vs torch-native (eager); "
    f"! = cliff (time(T)/time(4T) > {SWEEP_CLIFF}, eager or graph); * = slower than fbgemm"
)


def _size_label(n: int) -> str:
    """1024 -> '1K', 1048576 -> '1M', 64 -> '64'."""
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _us(v: float | None) -> str:
    """Three significant digits at most, never an exponent: 7.74, 15.4, 151, 2850."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _sweep_cell(r: Mapping[str, Any]) -> str:
    if r.get("status") != "ok":
        return "FAIL"
    s = r.get("speedup_vs_torch")
    text = f"{_us(r.get('eager_us'))}/{_us(r.get('graph_us'))}"
    text += (f" {s:.1f}x" if s >= 1 else f" {s:.2f}x") if s else ""
    if any((r.get(c) or 0.0) > SWEEP_CLIFF for c in ("cliff_eager", "cliff_graph")):
        text += "!"
    if any((r.get(c) or 2.0) < 1.0 for c in ("vs_fbgemm", "vs_fbgemm_graph")):
        text += "*"
    return text


def sweep_pivot(rows: Sequence[Mapping[str, Any]]) -> tuple[list[Row], list[str]]:
    """A sweep's compact table: one row per (op, dtype, E, k), ops and dtypes in the order they
    were measured, one column per T."""
    first = {}
    for r in rows:
        first.setdefault(r["op"], len(first))
        first.setdefault(r["dtype"], len(first))
    table: dict[tuple, Row] = {}
    for r in sorted(rows, key=lambda r: (first[r["op"]], first[r["dtype"]], r["E"], r["k"])):
        key = (r["op"], r["dtype"], r["E"], r["k"])
        row = table.setdefault(key, dict(op=r["op"], dtype=r["dtype"], E=r["E"], k=r["k"]))
        row[f"T={_size_label(r['T'])}"] = _sweep_cell(r)
    Ts = sorted({r["T"] for r in rows})
    return list(table.values()), ["op", "dtype", "E", "k", *(f"T={_size_label(T)}" for T in Ts)]


def sweep_summary_lines(s: Mapping[str, Any]) -> list[str]:
    """The summary (``routing_sweep.summarize``) as lines of text."""

    def extreme(key: str, label: str, cliff: bool = False) -> str:
        e = s.get(key)
        if not e:
            return f"{label}: -"
        mark = (" (a cliff)" if e["value"] > SWEEP_CLIFF else " (no cliff)") if cliff else ""
        return f"{label}: {format_value(e['value'])} at {e['where']}{mark}"

    slower = s.get("slower_than_fbgemm", [])
    return [
        f"points: {s['points']}, failed: {s['failed']}, cliffs (> {SWEEP_CLIFF}): {s['cliffs']}",
        extreme("worst_cliff_eager", "worst cliff eager", cliff=True),
        extreme("worst_cliff_graph", "worst cliff graph", cliff=True),
        extreme("min_speedup_eager", "min speedup vs torch eager"),
        extreme("min_speedup_graph", "min speedup vs torch graph"),
        f"slower than fbgemm: {len(slower)} of {s['fbgemm_points']} point(s) fbgemm ran"
        + ("" if slower else " (none)"),
        *(
            f"  {d['where']}: vs_fbgemm {format_value(d['vs_fbgemm'])}, "
            f"graph {format_value(d['vs_fbgemm_graph'])}"
            for d in slower
        ),
    ]


def format_sweep(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """The sweep's stdout: the compact table, the legend, the summary."""
    table, cols = sweep_pivot(rows)
    notes = [SWEEP_LEGEND, *sweep_summary_lines(summary)]
    return "\n".join([format_table(table, cols), *(f"# {x}" for x in notes)])


def markdown_sweep(doc: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md body of a saved sweep: the compact table, the legend, the summary."""
    extra = doc.get("extra") or {}
    table, cols = sweep_pivot(doc.get("rows", []))
    parts = [markdown_table(table, cols), "", SWEEP_LEGEND + "."]
    if extra.get("partial"):
        parts += ["", "**Partial: the run stopped before the end of the grid.**"]
    if extra.get("summary"):
        parts += ["", *(f"* {x}" for x in sweep_summary_lines(extra["summary"]))]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# rollout profile (``moe-bench rollout --profile``: ``rollout_profile.Breakdown.to_dict``)

PROFILE_COLUMNS = ["category", "ms_per_frame", "share_pct", "kernels_per_frame"]


def _count(value: float | None) -> float | int | None:
    """A per-frame count: an int when whole (1 and 0.5, not 1.0 and 0.5)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def profile_rows(profile: Mapping[str, Any]) -> list[Row]:
    """One row per category (its share of the total in percent), then the total."""
    rows: list[Row] = [
        {
            "category": c["category"],
            "ms_per_frame": c["ms_per_frame"],
            "share_pct": 100.0 * c["share"],
            "kernels_per_frame": _count(c["kernels_per_frame"]),
        }
        for c in profile.get("categories", [])
    ]
    total: Row = {
        "category": "total",
        "ms_per_frame": profile.get("device_ms_per_frame"),
        "share_pct": None,
        "kernels_per_frame": _count(profile.get("kernels_per_frame")),
    }
    return [*rows, total]


def profile_lines(profile: Mapping[str, Any]) -> list[str]:
    """What the profile's table measured, host time, launches, how kernels were attributed."""
    if profile.get("status") != "ok":
        return [f"profile: {profile.get('status')}"]
    if profile.get("basis") == "cpu_self":
        basis = "self CPU time of the ATen ops, kernels = op calls (device time needs CUDA)"
    else:
        basis = "device time of every kernel, memcpy and memset"
    launches = profile.get("launches_per_frame")
    lines = [
        f"profile of {profile['frames']} steady frame(s), per frame: {basis}",
        f"host {format_value(profile['host_ms_per_frame'])} ms/frame (CPU time inside the frame "
        "and decode ranges, under the profiler); device "
        f"{format_value(profile['device_ms_per_frame'])} ms/frame"
        + ("" if launches is None else f"; {format_value(launches)} launch calls/frame"),
    ]
    counts = profile.get("attribution") or {}
    if counts.get("name_rules"):
        lines.append(
            f"{counts['name_rules']} of {sum(counts.values())} device activities placed by name "
            "rules alone (no launch found in the profile's CPU events, or none in a range)"
        )
    return lines


def format_profile(profile: Mapping[str, Any]) -> str:
    """The profile's stdout: the breakdown table (when measured), then its summary lines."""
    lines = [f"# {x}" for x in profile_lines(profile)]
    if profile.get("status") != "ok":
        return "\n".join(lines)
    return "\n".join([format_table(profile_rows(profile), PROFILE_COLUMNS), *lines])


def markdown_profile(profile: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md body of a rollout profile: the breakdown table and its summary."""
    notes = [f"* {x}" for x in profile_lines(profile)]
    if profile.get("status") != "ok":
        return "\n".join(notes)
    return "\n".join([markdown_table(profile_rows(profile), PROFILE_COLUMNS), "", *notes])


# ----------------------------------------------------------------------------------------------
# JSON


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/inf
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (torch.device, torch.dtype, Path)):
        return str(value)
    return value


def make_document(
    command: str,
    rows: Sequence[Mapping[str, Any]],
    env: Mapping[str, Any],
    *,
    columns: Sequence[str] | None = None,
    args: Mapping[str, Any] | None = None,
    cmdline: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document a command writes with ``--json``: rows plus the environment."""
    return _jsonable(
        {
            "schema": SCHEMA,
            "command": command,
            "cmdline": cmdline if cmdline is not None else " ".join(["moe-bench", *sys.argv[1:]]),
            "args": dict(args or {}),
            "env": dict(env),
            "columns": _columns(rows, columns),
            "rows": [dict(r) for r in rows],
            "extra": dict(extra or {}),
        }
    )


def write_json(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write ``document`` (strict JSON, indented) to ``path``, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(document), indent=2, allow_nan=False) + "\n")
    return out


# ----------------------------------------------------------------------------------------------
# plots


def require_matplotlib() -> None:
    """Raise a clear RuntimeError when the optional ``plot`` extra is missing."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'moe-tools[plot]' (or matplotlib>=3.7)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Write a matplotlib figure to ``path`` (folders created), close it, return the path."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot_kernels(
    rows: Sequence[Mapping[str, Any]], ceiling_gbps: float | None, path: str | os.PathLike[str]
) -> Path:
    """GB/s against bytes moved, one series per implementation, the copy ceiling as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    series: dict[str, list[tuple[float, float, str]]] = {}
    for r in rows:
        if r.get("gbps") and r.get("bytes"):
            series.setdefault(str(r["impl"]), []).append(
                (float(r["bytes"]), float(r["gbps"]), str(r["op"]))
            )
    markers = "os^vD<>xP*"
    for i, (impl, pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax.scatter(
            [p[0] for p in pts], [p[1] for p in pts], label=impl, marker=markers[i % len(markers)]
        )
        if impl != "clone":
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


def plot_routing_sweep(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Heatmaps of a routing sweep: one panel per (op, dtype, eager/graph), rows (E, k), columns
    T, colour = speedup vs torch-native on a log scale (diverging around 1 where the speedups lie on
    both sides of it, else sequential over their range), each cell annotated."""
    import numpy as np

    plt = _pyplot()
    from matplotlib.colors import LogNorm

    def uniq(key: str) -> list[Any]:
        return list(dict.fromkeys(r[key] for r in rows))

    Ts = sorted(set(uniq("T")))
    eks = sorted({(r["E"], r["k"]) for r in rows})
    modes = (("eager", "speedup_vs_torch"), ("graph", "graph_speedup_vs_torch"))
    panels = [(op, dt, m) for op in uniq("op") for dt in uniq("dtype") for m in modes]
    speedups = [r[c] for r in rows for _, c in modes if r.get(c)] or [0.5, 2.0]
    lo, hi = min(speedups), max(speedups)
    if lo < 1.0 < hi:  # both sides of parity: a diverging map centred on 1
        span = max(hi, 1 / lo)
        norm, cmap = LogNorm(1 / span, span), plt.get_cmap("RdYlGn")
    else:  # one side only: a sequential map over the range, for contrast
        norm, cmap = LogNorm(lo, max(hi, lo * 1.01)), plt.get_cmap("viridis")
    cmap = cmap.with_extremes(bad="0.88")  # grey: no number
    ncols = min(4, len(panels)) or 1
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(ncols * (1.6 + 0.7 * len(Ts)), nrows * (1.0 + 0.26 * len(eks))),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, (op, dt, (mode, col)) in zip(axes.flat, panels, strict=False):
        grid = np.full((len(eks), len(Ts)), np.nan)
        for r in rows:
            if r["op"] == op and r["dtype"] == dt and r.get(col):
                grid[eks.index((r["E"], r["k"])), Ts.index(r["T"])] = r[col]
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):
                r, g, b, _ = cmap(norm(v))
                ink = "black" if 0.3 * r + 0.6 * g + 0.1 * b > 0.5 else "white"
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6, color=ink)
        if not np.isfinite(grid).any():
            ax.text((len(Ts) - 1) / 2, (len(eks) - 1) / 2, "no data", ha="center", va="center")
        ax.set_xticks(range(len(Ts)), [_size_label(t) for t in Ts], fontsize=7)
        ax.set_yticks(range(len(eks)), [f"E={e} k={k}" for e, k in eks], fontsize=6)
        ax.set_xlabel("T", fontsize=7)
        ax.set_title(f"{op} {dt} {mode}", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.5, label="speedup vs torch-native (x, log)")
    fig.suptitle("moe-bench kernels --sweep routing: speedup vs torch-native")
    return save_figure(fig, path, dpi=110)


def plot_profile(
    profile: Mapping[str, Any], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """A rollout profile as horizontal bars, ms per frame: one per category (labelled with its
    share), then the device total and the host time, to compare the two."""
    plt = _pyplot()
    cats = list(profile.get("categories", []))
    labels = [c["category"] for c in cats]
    values = [c["ms_per_frame"] for c in cats]
    colors = ["C0"] * len(cats)
    notes = [f"{c['ms_per_frame']:.3g} ms ({100 * c['share']:.1f}%)" for c in cats]
    cpu = profile.get("basis") == "cpu_self"
    for label, key, color in (
        ("op total" if cpu else "device total", "device_ms_per_frame", "C1"),
        ("host", "host_ms_per_frame", "C2"),
    ):
        if profile.get(key) is not None:
            labels.append(label)
            values.append(profile[key])
            colors.append(color)
            notes.append(f"{profile[key]:.3g} ms")
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.4 * max(len(labels), 1)))
    if labels:
        ax.barh(labels, values, color=colors)
        ax.invert_yaxis()
        for i, (v, note) in enumerate(zip(values, notes, strict=True)):
            ax.annotate(f" {note}", (v, i), va="center", fontsize=8)
        ax.set_xlim(0, 1.25 * max(values) or 1.0)
    else:
        ax.text(0.5, 0.5, f"profile: {profile.get('status')}", ha="center", va="center")
    basis = "CPU self time" if cpu else "device time"
    ax.set_xlabel(f"ms per frame ({basis}; host: enqueueing one frame)")
    ax.set_title(title or "moe-bench rollout --profile: where a frame's time goes")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_rollout(
    frame_ms: Sequence[float], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Per-frame time over the rollout."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(range(len(frame_ms)), list(frame_ms), linewidth=1, label="frame time")
    if frame_ms:
        med = statistics.median(frame_ms)
        ax.axhline(med, color="k", linestyle="--", linewidth=1, label=f"median {med:.3g} ms")
        ax.legend(fontsize=8)
    ax.set_xlabel("frame")
    ax.set_ylabel("ms per frame")
    ax.set_title(title or "moe-bench rollout: time per frame")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# markdown page from saved JSON


def _load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _pytest_benchmark_groups(doc: Mapping[str, Any]) -> dict[str, list[Row]]:
    """pytest-benchmark results as rows, one table per test function (its own extra_info)."""
    groups: dict[str, list[Row]] = {}
    for b in doc.get("benchmarks", []):
        stats = b.get("stats", {})
        name = str(b.get("name"))
        row: Row = {
            "benchmark": name,
            "median_ms": 1e3 * stats["median"] if "median" in stats else None,
            "min_ms": 1e3 * stats["min"] if "min" in stats else None,
            "rounds": stats.get("rounds"),
        }
        for k, v in (b.get("extra_info") or {}).items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                row[k] = v
        groups.setdefault(name.split("[")[0], []).append(row)
    return groups


def _env_from_pytest_benchmark(doc: Mapping[str, Any]) -> dict[str, Any]:
    mi = doc.get("machine_info", {})
    return {
        "date": doc.get("datetime"),
        "machine": mi.get("node"),
        "os": f"{mi.get('system', '')} {mi.get('release', '')}".strip(),
        "python": mi.get("python_version"),
        **{k: v for k, v in (mi.get("moe_bench") or {}).items()},
    }


def markdown_report(
    results_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    title: str | None = None,
) -> str:
    """A markdown page from every moe-bench and pytest-benchmark JSON file under ``results_dir``
    (one folder, or several: their files in the order given, e.g. the newest results first):
    the environment, then per file the command that reproduces it and its table."""
    if isinstance(results_dir, (str, os.PathLike)):
        results_dir = [results_dir]
    roots = [Path(r) for r in results_dir]
    files = [(root, p) for root in roots for p in sorted(root.rglob("*.json")) if p.is_file()]
    parts = [f"# {title or 'Benchmarks'}", ""]
    flags = " ".join(f"--results {root.as_posix()}" for root in roots)
    parts.append(
        f"Generated by `moe-bench report {flags}` from {len(files)} "
        "JSON file(s). Regenerate after re-running the commands below."
    )
    first_env = True
    for root, path in files:
        doc = _load(path)
        if doc is None:
            continue
        rel = path.relative_to(root if len(roots) == 1 else root.parent).as_posix()
        if doc.get("schema") == SCHEMA and (doc.get("extra") or {}).get("sweep") == "routing":
            env = doc.get("env", {})
            sections = [("`moe-bench kernels --sweep routing`", doc, None)]
            cmd = doc.get("cmdline")
        elif doc.get("schema") == SCHEMA:
            env = doc.get("env", {})
            sections = [
                (f"`moe-bench {doc.get('command')}`", doc.get("rows", []), doc.get("columns"))
            ]
            cmd = doc.get("cmdline")
        elif "benchmarks" in doc and "machine_info" in doc:
            env = _env_from_pytest_benchmark(doc)
            sections = [
                (f"pytest-benchmark `{name}`", rows, None)
                for name, rows in _pytest_benchmark_groups(doc).items()
            ]
            cmd = "nox -s benchmarks"
        else:
            continue
        if first_env and env:
            parts += ["", "## Environment", "", "```", format_environment(env), "```"]
            first_env = False
        for i, (heading, rows, cols) in enumerate(sections):
            parts += ["", f"## {heading} ({rel})", ""]
            if cmd and i == 0:
                parts += ["```bash", str(cmd), "```", ""]
            if isinstance(rows, Mapping):  # a sweep: its own table and summary
                parts.append(markdown_sweep(rows))
            else:
                parts.append(markdown_table(rows, cols))
        extra = doc.get("extra") or {}
        profiles = extra.get("profiles")  # moe-bench rollout --modes ... --profile: one each
        if isinstance(profiles, list) and profiles:
            for prof in profiles:
                parts += ["", f"Profile, mode {prof.get('mode')}:", "", markdown_profile(prof)]
        elif isinstance(extra.get("profile"), Mapping):  # moe-bench rollout --profile
            parts += ["", markdown_profile(extra["profile"])]
        if doc.get("schema") == SCHEMA and doc.get("command") == "train":
            from moe_tools.train_report import markdown_train

            parts += ["", markdown_train(doc, path)]
        scalars = {
            k: v for k, v in extra.items() if isinstance(v, (int, float, str)) and k != "sweep"
        }
        if scalars:
            parts += ["", ", ".join(f"{k}: {format_value(v)}" for k, v in scalars.items())]
    return "\n".join(parts) + "\n"
