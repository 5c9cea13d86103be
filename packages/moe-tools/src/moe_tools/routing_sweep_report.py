"""Presentation of ``moe-bench kernels --sweep routing`` (``moe_tools.routing_sweep``): the
compact table (one row per op, dtype, E and k, one cell per T), the summary, the heatmaps."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tools.plots import pyplot, save_figure
from moe_tools.tables import Row, format_table, format_value, markdown_table

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


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Heatmaps of a routing sweep: one panel per (op, dtype, eager/graph), rows (E, k), columns
    T, colour = speedup vs torch-native on a log scale (diverging around 1 where the speedups lie on
    both sides of it, else sequential over their range), each cell annotated."""
    import numpy as np

    plt = pyplot()
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
