"""Presentation of ``moe-bench train`` results: the loss curves as a table, a figure, a markdown
section (``moe-bench report`` calls :func:`markdown_train` for a saved train result)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tools.command import scalars_line
from moe_tools.plots import pyplot, save_figure
from moe_tools.tables import Row, format_table, markdown_table

SIDE_STATUSES = ("compile_status", "graph_status")  # printed below the table, not in it


def format_rows(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """The train command's stdout: the table without the compiled / graph statuses, then one
    line per status that is not ``ok`` (one line for a status every measured row shares)."""
    table = format_table(rows, [c for c in columns if c not in SIDE_STATUSES])
    lines = []
    for col in SIDE_STATUSES:
        label = col.removesuffix("_status").replace("compile", "compiled")
        values = [r.get(col) for r in rows if r.get(col) is not None]
        if len(values) > 1 and len(set(values)) == 1:
            if values[0] != "ok":
                lines.append(f"# {label}, every impl measured: {values[0]}")
            continue
        lines += [
            f"# {label}, {r['impl']}: {r[col]}" for r in rows if r.get(col) not in (None, "ok")
        ]
    return "\n".join([table, *lines])


def notes(
    extra: Mapping[str, Any],
    curves: Mapping[str, Sequence[float]],
    error_measure: str,
    teacher_impl: str,
) -> list[str]:
    """The lines below the table: how a step, the errors and the convergence run are defined,
    then a few points of each loss curve."""
    backend = extra["compile_backend"]
    notes = [
        "step = zero_grad + forward + backward (fixed upstream gradient, x requires grad) + "
        f"AdamW; medians of {extra['iters']} after {extra['warmup']} warm-up; compiled: "
        + (f"torch.compile(layer, fullgraph=True, backend={backend!r})" if backend else "off")
        + "; graph: the eager step in one CUDA graph (AdamW capturable)",
        f"errors (*_err): {error_measure} vs impl {extra['reference']} on the same weights, "
        "x and dy; "
        "bitwise: two fwd+bwd passes give equal gradients",
        f"convergence: MSE to a random teacher (impl {teacher_impl}, another seed), "
        f"{extra['steps']} AdamW steps at lr {extra['lr']:g}, the same inputs for every impl"
        if extra["steps"]
        else "convergence: off (--steps 0)",
    ]
    roof = extra.get("roofline")
    if roof:
        gemms = roof.get("six_gemms_ms")
        notes.append(
            "roofline (fb_*): forward + backward of the layer alone (no optimizer) per mode, "
            f"best of them as fb_best_ms; tflops: the routed experts' {roof['expert_flops']:.4g} "
            "GEMM FLOPs over fb_best_ms; vs_gemms: fb_best_ms over the six grouped GEMMs "
            "(torch._grouped_mm on the layer's own expert groups) timed in this run: "
            + (f"{gemms:.4g} ms ({roof['six_gemms_tflops']:.4g} TFLOP/s)" if gemms else
               f"not run ({roof.get('six_gemms_error', 'unavailable')})")
        )  # fmt: skip
    for impl, curve in curves.items():
        picks = sorted({round(i * (len(curve) - 1) / 4) for i in range(5)})
        values = " ".join(f"{curve[i]:.4g}" for i in picks)
        notes.append(f"loss {impl} at steps {','.join(map(str, picks))}: {values}")
    return notes


def loss_rows(
    curves: Mapping[str, Sequence[float | None]], points: int = 6
) -> tuple[list[Row], list[str]]:
    """The curves sampled at ``points`` steps (first and last included): one row per step, one
    column per implementation."""
    n = max((len(c) for c in curves.values()), default=0)
    if n == 0:
        return [], ["step"]
    steps = sorted({round(i * (n - 1) / max(points - 1, 1)) for i in range(points)})
    rows = [
        {"step": s, **{impl: (c[s] if s < len(c) else None) for impl, c in curves.items()}}
        for s in steps
    ]
    return rows, ["step", *curves]


def plot_loss_curves(
    curves: Mapping[str, Sequence[float | None]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Every implementation's convergence-run loss against the step, in one figure (log y)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ("-", "--", "-.", ":")
    for i, (impl, curve) in enumerate(curves.items()):
        pts = [(s, v) for s, v in enumerate(curve) if v is not None]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            linestyle=styles[i % len(styles)],
            linewidth=1.2,
            label=impl,
        )
    if not curves:
        ax.text(0.5, 0.5, "no loss curve (no impl trained)", ha="center", va="center")
    else:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("AdamW step")
    ax.set_ylabel("MSE to the teacher")
    ax.set_title(title or "moe-bench train: student fitting a random teacher MoE layer")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_title(extra: Mapping[str, Any]) -> str:
    """'moe-bench train: ...' with the shape, dtype and step count of a result's ``extra``."""
    layer = extra.get("layer") or {}
    shape = (
        f"T={extra.get('tokens')} E={layer.get('n_experts')} top-{layer.get('top_k')} "
        f"D={layer.get('d_model')} H={layer.get('hidden')}"
    )
    return f"moe-bench train: loss, {shape}, {extra.get('dtype')}, lr {extra.get('lr', 0):.2g}"


def _figure(doc: Mapping[str, Any], json_path: Path) -> Path | None:
    """A PNG of the curves next to the JSON: the ``--plot`` file's name, else ``<stem>.png``."""
    plot = (doc.get("extra") or {}).get("plot")
    names = [Path(plot).name] if plot else []
    names.append(json_path.with_suffix(".png").name)
    for name in names:
        candidate = json_path.parent / name
        if candidate.is_file():
            return candidate
    return None


def markdown(doc: Mapping[str, Any], json_path: str | os.PathLike[str]) -> str:
    """A saved train result: the rows (the compiled / graph statuses below them), the loss
    curves, the figure and notes (:func:`markdown_train`), the settings."""
    rows, columns = doc.get("rows", []), doc.get("columns") or []
    extra = doc.get("extra") or {}
    if extra.get("sweep"):  # moe-bench train --sweep: the grid's rows, the figure, the notes
        parts = [markdown_table(rows, columns)]
        figure = _figure(doc, Path(json_path))
        if figure is not None:
            parts += ["", f"![moe-bench train --sweep]({figure.as_posix()})"]
        return "\n".join([*parts, "", *(f"* {n}" for n in extra.get("notes") or [])])
    parts = [markdown_table(rows, [c for c in columns if c not in SIDE_STATUSES])]
    side = [f"* {x[2:]}" for x in format_rows(rows, columns).splitlines() if x.startswith("# ")]
    if side:
        parts += ["", *side]
    parts += ["", markdown_train(doc, json_path)]
    settings = scalars_line(doc.get("extra") or {})
    return "\n".join([*parts, *(["", settings] if settings else [])])


def markdown_train(doc: Mapping[str, Any], json_path: str | os.PathLike[str]) -> str:
    """The loss curves of a saved train result (sampled steps as a table), the figure when one
    lies next to the JSON file (linked by its path as given to ``moe-bench report --results``),
    and the notes."""
    extra = doc.get("extra") or {}
    curves = extra.get("loss_curves") or {}
    parts = [f"Convergence run ({extra.get('steps')} AdamW steps), MSE to the teacher:", ""]
    if curves:
        rows, cols = loss_rows(curves)
        parts.append(markdown_table(rows, cols))
    else:
        parts.append("_(no loss curve: no implementation trained)_")
    figure = _figure(doc, Path(json_path))
    if figure is not None:
        parts += ["", f"![moe-bench train loss curves]({figure.as_posix()})"]
    notes = extra.get("notes") or []
    notes = [n for n in notes if not str(n).startswith("loss ")]  # the table shows the curves
    if notes:
        parts += ["", *(f"* {n}" for n in notes)]
    return "\n".join(parts)
