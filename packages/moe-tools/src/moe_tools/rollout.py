"""``moe-bench rollout``: a world-model rollout, frame by frame: throughput, latency, VRAM.

Building the engine and a few warm-up frames first (they include compilation and CUDA-graph
capture, reported together as ``setup_s``), then ``engine.reset()`` and the timed rollout: every
frame bracketed by CUDA events (perf_counter on CPU), frames per second from the wall time of the
whole timed rollout, the peak allocator figures over it, and the allocated memory after frame 16
and after the last frame. With ``profile``, :mod:`moe_tools.rollout_profile` then profiles a few
steady frames of the same engine: ``extra["profile"]``, printed after the row, with the frame's
roofline (:mod:`moe_tools.rollout_roofline`) joined to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moe_tools import command as cmd
from moe_tools import rollout_profile, rollout_roofline, tables
from moe_tools.plots import pyplot, save_figure
from moe_tools.results import Result, slug
from moe_tools.tables import Row, format_table, short_error
from moe_tools.timing import (
    EventTimer,
    default_device,
    memory_gib,
    peak_memory_gib,
    reset_peak_memory,
    synchronize,
)

COLUMNS = [
    "preset",
    "impl",
    "mode",
    "compile",
    "cuda_graph",
    "images",
    "frames",
    "fps",
    "frame_ms_median",
    "frame_ms_p99",
    "peak_alloc_gib",
    "peak_reserved_gib",
    "vram_f16_gib",
    "vram_last_gib",
    "params",
    "active_params",
    "setup_s",
    "status",
]

SNAPSHOT_FRAME = 16  # VRAM is read after this frame (1-based) and after the last one

# ``--modes``: the engine's runtimes, (compile, cuda_graph) each. One engine serves them all in
# one process (``WorldEngine.set_runtime``; the compiled passes are kept from "compile" to
# "graph"), so their rows compare the same weights, run and machine state.
MODES: dict[str, tuple[bool, bool]] = {
    "eager": (False, False),
    "compile": (True, False),
    "graph": (True, True),
}


def build_engine(
    preset: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    impl: str | None,
    compile: bool,
    cuda_graph: bool | None,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A ``moe_model.WorldEngine`` for ``preset`` with config ``overrides`` (``cuda_graph=None``:
    the engine's default, graphs when compiled on CUDA)."""
    from moe_model import WorldEngine, WorldModelConfig

    config = WorldModelConfig.from_preset(preset, **(overrides or {}))
    return WorldEngine(
        config,
        device=device,
        dtype=dtype,
        impl=impl,
        compile=compile,
        cuda_graph=cuda_graph,
        seed=seed,
    )


def measure_rollout(
    engine: Any,
    frames: int,
    *,
    device: torch.device,
    warmup_frames: int,
    progress: bool = False,
    images: bool = True,
) -> dict[str, Any]:
    """Warm up, reset, then roll out ``frames`` frames (decoded to images on the host, or the
    latent kept on the device when not ``images``); returns the figures and per-frame times."""
    t0 = time.perf_counter()
    for _ in range(warmup_frames):
        engine.gen_frame(return_img=images)
    synchronize(device)
    warmup_s = time.perf_counter() - t0

    engine.reset()
    reset_peak_memory(device)
    timer = EventTimer(device)
    vram_snap: float | None = None
    synchronize(device)
    t0 = time.perf_counter()
    bar = tables.progress(range(frames), enabled=progress, desc="rollout", unit="frame")
    for i in bar:
        with timer:
            engine.gen_frame(return_img=images)
        if i + 1 == SNAPSHOT_FRAME:
            vram_snap = memory_gib(device)[0]
    synchronize(device)
    wall_s = time.perf_counter() - t0
    timing = timer.result()
    peak_alloc, peak_reserved = peak_memory_gib(device)
    return {
        "fps": frames / wall_s if wall_s > 0 else None,
        "frame_ms_median": timing.median_ms,
        "frame_ms_p99": timing.p99_ms,
        "peak_alloc_gib": peak_alloc,
        "peak_reserved_gib": peak_reserved,
        "vram_f16_gib": vram_snap,
        "vram_last_gib": memory_gib(device)[0],
        "setup_s": warmup_s,
        "frame_ms": timing.times_ms,
    }


def _title(preset: str, impl: str | None, compile: bool, cuda_graph: bool | None) -> str:
    return f"rollout {preset} impl={impl} compile={compile} cuda_graph={cuda_graph}"


def run(
    *,
    device: torch.device | str | None = None,
    preset: str | None = None,
    frames: int | None = None,
    warmup_frames: int | None = None,
    impl: str | None = None,
    compile: bool = False,
    cuda_graph: bool | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    progress: bool = True,
    overrides: dict[str, Any] | None = None,
    profile: bool = False,
    profile_frames: int | None = None,
    modes: Sequence[str] | None = None,
    images: bool = True,
    peak_tflops: float | None = None,
    peak_gbps: float | None = None,
) -> Result:
    """One row per runtime: the rollout's figures; ``extra["frame_ms"]`` holds the last row's
    per-frame times.

    ``modes``: names of ``MODES``, measured in that order on one engine (switched with
    ``set_runtime``); without them, the one runtime ``compile`` / ``cuda_graph`` gives
    (``cuda_graph=None`` leaves it to the engine: graphs when compiled on CUDA; the row shows what
    the engine did). ``images``: frames decoded to host images (False: the latent stays on the
    device, no decode). ``profile``: then ``profile_frames`` steady frames (default 16 on CUDA, 2
    on CPU) of each runtime under ``torch.profiler``: ``extra["profiles"]`` per row (the last in
    ``extra["profile"]``; ``rollout_profile.Breakdown.to_dict``, or a failed status), printed
    after the rows (``text``), each with the frame's roofline (``rollout_roofline``: the device's
    peaks from its table, ``peak_tflops`` / ``peak_gbps`` replacing them)."""
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    preset = preset or ("seed-moe" if cuda else "tiny")
    frames = frames or (256 if cuda else 16)
    warmup_frames = warmup_frames if warmup_frames is not None else (8 if cuda else 2)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    unknown = [m for m in modes or () if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
    runtimes = [(m, *MODES[m]) for m in modes] if modes else [(None, compile, cuda_graph)]
    rows: list[Row] = []
    for mode, c, g in runtimes:
        row: Row = {col: None for col in COLUMNS}
        row.update(preset=preset, impl=impl, mode=mode, compile=c, cuda_graph=g, frames=frames)
        row["images"] = images
        rows.append(row)
    extra: dict[str, Any] = {
        "title": _title(preset, impl or "default", compile, cuda_graph),
        "dtype": str(dtype).removeprefix("torch."),
        "warmup_frames": warmup_frames,
        "overrides": overrides or {},
    }

    def done(text: str | None = None) -> Result:
        return Result("rollout", rows, COLUMNS, extra, text=text)

    if not cuda and any(g for _, _, g in runtimes):
        for row in rows:
            row["status"] = "unavailable: --cuda-graph needs a CUDA device"
        return done()
    if profile:
        rollout_profile.prepare_cuda_graphs(device)  # before the engine captures its graphs
    t0 = time.perf_counter()
    try:
        engine = build_engine(
            preset,
            device=device,
            dtype=dtype,
            impl=impl,
            compile=runtimes[0][1],
            cuda_graph=runtimes[0][2],
            seed=seed,
            overrides=overrides,
        )
    except Exception as exc:
        for row in rows:
            row["status"] = f"unavailable: {short_error(exc)}"
        return done()
    setup_s = time.perf_counter() - t0
    profiles: list[dict[str, Any]] = []
    for row, (mode, c, g) in zip(rows, runtimes, strict=True):
        try:
            if row is not rows[0]:
                t0 = time.perf_counter()
                engine.set_runtime(compile=c, cuda_graph=g)
                setup_s = time.perf_counter() - t0
            with torch.no_grad():
                figures = measure_rollout(
                    engine,
                    frames,
                    device=device,
                    warmup_frames=warmup_frames,
                    progress=progress,
                    images=images,
                )
        except Exception as exc:
            row["status"] = f"failed: {short_error(exc)}"
            continue
        row["impl"] = impl or getattr(getattr(engine, "config", None), "moe_impl", None)
        row["cuda_graph"] = engine.cuda_graph
        row["params"] = int(engine.num_parameters())
        row["active_params"] = int(engine.num_active_parameters())
        extra["frame_ms"] = figures.pop("frame_ms")
        row.update(figures)
        row["setup_s"] = setup_s + figures["setup_s"]
        row["status"] = "ok"
        extra["title"] = _title(preset, row["impl"], c, engine.cuda_graph)
        if profile:
            try:
                with torch.no_grad():
                    found = rollout_profile.profile_engine(
                        engine, profile_frames or (16 if cuda else 2), device=device
                    )
                prof = found.to_dict()
                peak = rollout_roofline.find_peak(
                    torch.cuda.get_device_name(device) if cuda else None,
                    tflops=peak_tflops,
                    gbps=peak_gbps,
                )
                ops = rollout_roofline.frame_ops(
                    engine.config, itemsize=engine.dtype.itemsize, images=images
                )
                prof = rollout_roofline.attach(prof, rollout_roofline.roofline(ops, peak))
            except Exception as exc:
                prof = {"status": f"failed: {short_error(exc)}"}
            profiles.append(prof if mode is None else {"mode": mode, **prof})
    if not profile:
        return done()
    extra["profiles"] = profiles
    extra["profile"] = profiles[-1] if profiles else {"status": "failed: no runtime ran"}
    parts = [format_table(rows, COLUMNS)]
    for prof in profiles:
        head = f"# profile: {prof['mode']}" if prof.get("mode") else None
        parts.append("\n".join(filter(None, [head, rollout_profile.format_profile(prof)])))
    return done("\n\n".join(parts))


# ----------------------------------------------------------------------------------------------
# the command


def world_preset(text: str) -> str:
    from moe_model import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; choose from {', '.join(PRESETS)}"
        )
    return text


def impl_name(text: str) -> str:
    from moe_tools.matrix import impl_names

    if text not in impl_names():
        raise argparse.ArgumentTypeError(
            f"unknown impl {text!r}; choose from {', '.join(impl_names())}"
        )
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", type=world_preset, help="world model (moe_model.PRESETS); default: seed-moe "
        "on CUDA, tiny on CPU"
    )  # fmt: skip
    p.add_argument(
        "--frames", type=cmd.positive, help="timed frames (default: 256 on CUDA, 16 on CPU)"
    )
    p.add_argument(
        "--warmup-frames",
        type=cmd.non_negative,
        help="untimed frames first (default 8 on CUDA, 2 on CPU)",
    )
    p.add_argument("--impl", type=impl_name, help="MoE implementation (default: the preset's)")
    p.add_argument(
        "--set",
        type=config_overrides,
        metavar="KEY=V,..",
        help="the preset's config with these WorldModelConfig fields replaced, e.g. "
        "d_model=4096,n_experts=32 or window=4 (a cliff check)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (on CUDA with CUDA graphs, unless --no-cuda-graph)",
    )
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=True,
        default=None,
        help="replay every frame from CUDA graphs (default: with --compile on CUDA)",
    )
    graphs.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=False,
        help="no CUDA graphs, even with --compile",
    )
    p.add_argument(
        "--modes",
        type=cmd.choices_csv(tuple(MODES)),
        metavar="M,..",
        help="runtimes measured on one engine, in order: eager, compile (no graphs), graph "
        "(compile + CUDA graphs); replaces --compile / --cuda-graph",
    )
    p.add_argument(
        "--no-images", action="store_true", help="keep each frame's latent: no decode, no copy"
    )
    cmd.dtype_option(p)
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile steady frames: device time per kernel category, host time, launches",
    )
    p.add_argument(
        "--profile-frames",
        type=cmd.positive,
        metavar="N",
        help="frames profiled with --profile (default 16 on CUDA, 2 on CPU)",
    )
    for name, unit in (("--peak-tflops", "dense bf16 TFLOP/s"), ("--peak-gbps", "memory GB/s")):
        p.add_argument(
            name,
            type=cmd.positive_float,
            metavar="X",
            help=f"--profile's roofline: the device's {unit} (default: its table, H100/H200)",
        )
    cmd.plot_option(p, "per-frame time over the rollout (--profile: the breakdown)")


def config_overrides(text: str) -> dict[str, Any]:
    """``KEY=VALUE[,KEY=VALUE..]`` of ``moe_model.WorldModelConfig`` fields, each value read as
    its field's type (int, float, bool: true/false, str); argparse's error names the bad one."""
    import dataclasses

    from moe_model import WorldModelConfig

    types = {f.name: f.type for f in dataclasses.fields(WorldModelConfig)}
    out: dict[str, Any] = {}
    for item in cmd.csv(text):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE with KEY a WorldModelConfig field ({', '.join(types)}), "
                f"got {item!r}"
            )
        kind = types[key] if isinstance(types[key], str) else types[key].__name__
        try:
            if kind == "bool":
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                out[key] = value.lower() == "true"
            else:
                out[key] = {"int": int, "float": float}.get(kind, str)(value)
        except ValueError as exc:
            article = "an" if kind == "int" else "a"
            raise argparse.ArgumentTypeError(
                f"{key} takes {article} {kind}, got {value!r}"
            ) from exc
    return out


def _runtime(args: argparse.Namespace) -> str:
    """The runtimes a command line measures: its modes, or the one --compile / --cuda-graph
    give (graphs by default when compiled on CUDA)."""
    if args.modes:
        return "+".join(args.modes)
    graph = args.cuda_graph if args.cuda_graph is not None else args.device.type == "cuda"
    if not args.compile:
        return "eager-graph" if args.cuda_graph else "eager"
    return "graph" if graph else "compile"


def result_name(args: argparse.Namespace) -> str:
    preset = args.preset or ("seed-moe" if args.device.type == "cuda" else "tiny")
    return slug(
        "rollout",
        preset,
        args.impl,
        _runtime(args),
        [f"{k}={v}" for k, v in (args.set or {}).items()],
        "latents" if args.no_images else None,
        "profile" if args.profile else None,
    )


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    for flag in ("profile_frames", "peak_tflops", "peak_gbps"):
        if getattr(args, flag) and not args.profile:
            raise cmd.UsageError(f"--{flag.replace('_', '-')} needs --profile")
    if args.modes and (args.compile or args.cuda_graph is not None):
        raise cmd.UsageError("--modes replaces --compile / --cuda-graph / --no-cuda-graph")
    if args.set:  # the config checked before anything is built
        from moe_model import WorldModelConfig

        preset = args.preset or ("seed-moe" if args.device.type == "cuda" else "tiny")
        try:
            WorldModelConfig.from_preset(preset, **args.set)
        except (TypeError, ValueError) as exc:
            raise cmd.UsageError(f"--set: {exc}") from exc
    graphs = args.cuda_graph or "graph" in (args.modes or ())
    if graphs and args.device.type != "cuda":
        raise cmd.UsageError(
            f"CUDA graphs (--cuda-graph, mode graph) need a CUDA device, not {args.device}"
        )
    return run(
        device=args.device,
        preset=args.preset,
        frames=args.frames,
        warmup_frames=args.warmup_frames,
        impl=args.impl,
        compile=args.compile,
        cuda_graph=args.cuda_graph,
        dtype=cmd.dtype_of(args.dtype, args.device),
        seed=args.seed,
        progress=not args.no_progress,
        profile=args.profile,
        modes=args.modes,
        images=not args.no_images,
        profile_frames=args.profile_frames,
        peak_tflops=args.peak_tflops,
        peak_gbps=args.peak_gbps,
        overrides=args.set,
    )


def markdown(doc: Mapping[str, Any], path: Path) -> str:
    """The rows, then each runtime's profile (``--profile``), then the scalar extras."""
    parts = [cmd.markdown_rows({**doc, "extra": {}}, path)]
    extra = doc.get("extra") or {}
    profiles = extra.get("profiles")
    if isinstance(profiles, list) and profiles:
        for prof in profiles:
            head = f"Profile, mode {prof.get('mode')}:" if prof.get("mode") else "Profile:"
            parts += ["", head, "", rollout_profile.markdown_profile(prof)]
    elif isinstance(extra.get("profile"), Mapping):
        parts += ["", rollout_profile.markdown_profile(extra["profile"])]
    if cmd.scalars_line(extra):
        parts += ["", cmd.scalars_line(extra)]
    return "\n".join(parts)


def plot(result: Result, path: str | os.PathLike[str]) -> Path:
    """The breakdown of the profiled frames (with --profile), else the per-frame time."""
    title = result.extra.get("title", "")
    if isinstance(result.extra.get("profile"), Mapping):
        return rollout_profile.plot_profile(result.extra["profile"], path, title=title)
    return plot_frames(result.extra.get("frame_ms", []), path, title=title)


def plot_frames(
    frame_ms: Sequence[float], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Per-frame time over the rollout, with its median."""
    plt = pyplot()
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


COMMAND = cmd.Command(
    name="rollout",
    help="a world-model rollout: fps, latency and VRAM (--profile: where a frame's time goes)",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=result_name,
    markdown=markdown,
    plot=plot,
)
