"""``moe-bench train --sweep``: the training layer's forward + backward against its six grouped
GEMMs over a grid of shapes, one axis at a time around a centre (to find cliffs), with a plot.

The default centre is the Qwen3-30B-A3B layer at 8192 tokens (d_model 2048, hidden 768, E=128,
top-8); the axes are the issue's ranges: tokens 2048-32768, hidden 256-1536, experts 16-256,
top_k 2-8. Each point is one :func:`moe_tools.train.roofline.measure` per impl on a fresh seeded
layer, beside :func:`moe_tools.train.roofline.time_six_gemms` on its expert groups.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from moe_tools.plots import pyplot, save_figure
from moe_tools.results import Result
from moe_tools.tables import Row, format_table, short_error
from moe_tools.train import roofline as train_roofline

CENTER: dict[str, int] = dict(tokens=8192, d_model=2048, n_experts=128, top_k=8, hidden=768)
GRID: dict[str, tuple[int, ...]] = {
    "tokens": (2048, 4096, 8192, 16384, 32768),
    "hidden": (256, 512, 768, 1024, 1536),
    "n_experts": (16, 32, 64, 128, 256),
    "top_k": (2, 4, 6, 8),
}
IMPLS = ("triton_bf16", "torch")
COLUMNS = ["axis", *CENTER, "impl", "six_gemms_ms", "fb_best_ms", "tflops", "vs_gemms", "status"]


def points(center: Mapping[str, int], grid: Mapping[str, Sequence[int]]) -> Iterator[tuple]:
    """(axis, shape): the centre once (axis ``"center"``), then each axis' other values with
    the rest of the centre."""
    yield "center", dict(center)
    for axis, values in grid.items():
        for v in values:
            if v != center[axis]:
                yield axis, {**center, axis: v}


def run(
    *,
    device: torch.device,
    dtype: torch.dtype,
    impls: Sequence[str] | None = None,
    gated: bool = False,
    modes: tuple[str, ...] = ("eager", "compiled", "graph"),
    backend: str = "inductor",
    warmup: int = 3,
    iters: int = 10,
    seed: int = 0,
    center: Mapping[str, int] | None = None,
    grid: Mapping[str, Sequence[int]] | None = None,
    plot: str | None = None,
) -> Result:
    """One row per (point, impl); a point that does not fit or fails says so in ``status``."""
    from moe_tools.train.step import build_layer, check_training_fits

    center, grid = dict(center or CENTER), dict(grid or GRID)
    modes = tuple(m for m in modes if m != "graph" or device.type == "cuda")
    impls = list(impls or IMPLS)
    rows: list[Row] = []
    for axis, shape in points(center, grid):
        cfg = dict(shape, gated=gated, renormalize=False)
        base_row: Row = dict(axis=axis, **shape)
        try:
            check_training_fits(cfg, device, dtype)
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(cfg["tokens"], cfg["d_model"], generator=gen).to(device, dtype)
            dy = torch.randn(cfg["tokens"], cfg["d_model"], generator=gen).to(device, dtype)
            base = build_layer(cfg, device, dtype, seed)
            counts = train_roofline.group_counts(base, x)
            gemms = train_roofline.time_six_gemms(counts, cfg, device, dtype, warmup, iters)
        except Exception as exc:
            rows += [dict(base_row, impl=i, status=f"skipped: {short_error(exc)}") for i in impls]
            continue
        flops = train_roofline.expert_flops(cfg)
        for impl in impls:
            m = train_roofline.measure(
                base, impl, x, dy, modes=modes, backend=backend, warmup=warmup, iters=iters,
                flops=flops, gemms_ms=gemms,
            )  # fmt: skip
            rows.append(dict(base_row, impl=impl, six_gemms_ms=gemms, fb_best_ms=m["fb_best_ms"],
                             tflops=m["tflops"], vs_gemms=m["vs_gemms"],
                             status=m["roofline_status"]))  # fmt: skip
        del base, x, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    extra: dict[str, Any] = dict(
        sweep=True, center=center, grid={k: list(v) for k, v in grid.items()}, gated=gated,
        modes=list(modes), dtype=str(dtype).removeprefix("torch."), warmup=warmup, iters=iters,
        notes=[
            "one axis at a time around the centre; fb_best_ms: the best of "
            f"{', '.join(modes)} forward + backward; vs_gemms: over the six grouped GEMMs "
            "(torch._grouped_mm on the layer's expert groups) timed at the same point",
        ],
    )  # fmt: skip
    if plot:
        extra["plot"] = str(plot)
    return Result("train", rows, COLUMNS, extra, text=format_table(rows, COLUMNS))


def plot(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """vs_gemms against each swept axis (one panel an axis, one line an impl; the centre is a
    point of every panel)."""
    plt = pyplot()
    axes_names = [a for a in GRID if any(r["axis"] == a for r in rows)]
    fig, axes = plt.subplots(1, max(len(axes_names), 1), figsize=(4 * max(len(axes_names), 1), 3.4))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    center = [r for r in rows if r["axis"] == "center"]
    for ax, name in zip(axes, axes_names, strict=False):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted(
                (r[name], r["vs_gemms"]) for r in [*center, *[r for r in rows if r["axis"] == name]]
                if r["impl"] == impl and r.get("vs_gemms")
            )  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.axhline(1.15, color="grey", linestyle="--", linewidth=0.8, label="1.15x target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(name)
        ax.set_ylabel("fwd+bwd / six GEMMs")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
