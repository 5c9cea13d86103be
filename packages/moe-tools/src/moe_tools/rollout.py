"""``moe-bench rollout``: a world-model rollout, frame by frame: throughput, latency, VRAM.

Building the engine and a few warm-up frames first (they include compilation and CUDA-graph
capture, reported together as ``setup_s``), then ``engine.reset()`` and the timed rollout: every
frame bracketed by CUDA events (perf_counter on CPU), frames per second from the wall time of the
whole timed rollout, the peak allocator figures over it, and the allocated memory after frame 16
and after the last frame. With ``profile``, :mod:`moe_tools.rollout_profile` then profiles a few
steady frames of the same engine: ``extra["profile"]``, printed after the row.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moe_tools import report
from moe_tools.report import Result, Row, short_error
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
    "compile",
    "cuda_graph",
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
) -> dict[str, Any]:
    """Warm up, reset, then roll out ``frames`` frames; returns the figures and per-frame times."""
    t0 = time.perf_counter()
    for _ in range(warmup_frames):
        engine.gen_frame()
    synchronize(device)
    warmup_s = time.perf_counter() - t0

    engine.reset()
    reset_peak_memory(device)
    timer = EventTimer(device)
    vram_snap: float | None = None
    synchronize(device)
    t0 = time.perf_counter()
    bar = report.progress(range(frames), enabled=progress, desc="rollout", unit="frame")
    for i in bar:
        with timer:
            engine.gen_frame()
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
) -> Result:
    """One row: the rollout's figures; ``extra["frame_ms"]`` holds the per-frame times.
    ``cuda_graph=None`` leaves it to the engine (graphs when compiled on CUDA); the row shows what
    the engine did. ``profile``: then ``profile_frames`` steady frames (default 16 on CUDA, 2 on
    CPU) under ``torch.profiler``, ``extra["profile"]`` (``rollout_profile.Breakdown.to_dict``, or
    a failed status) and the breakdown printed after the row (``text``)."""
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    preset = preset or ("seed-moe" if cuda else "tiny")
    frames = frames or (256 if cuda else 16)
    warmup_frames = warmup_frames if warmup_frames is not None else (8 if cuda else 2)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    row: Row = {c: None for c in COLUMNS}
    row.update(preset=preset, impl=impl, compile=compile, cuda_graph=cuda_graph, frames=frames)
    extra: dict[str, Any] = {
        "title": _title(preset, impl or "default", compile, cuda_graph),
        "dtype": str(dtype).removeprefix("torch."),
        "warmup_frames": warmup_frames,
        "overrides": overrides or {},
    }
    if cuda_graph and not cuda:
        row["status"] = "unavailable: --cuda-graph needs a CUDA device"
        return Result("rollout", [row], COLUMNS, extra)
    if profile:
        from moe_tools import rollout_profile

        rollout_profile.prepare_cuda_graphs(device)  # before the engine captures its graphs
    t0 = time.perf_counter()
    try:
        engine = build_engine(
            preset,
            device=device,
            dtype=dtype,
            impl=impl,
            compile=compile,
            cuda_graph=cuda_graph,
            seed=seed,
            overrides=overrides,
        )
    except Exception as exc:
        row["status"] = f"unavailable: {short_error(exc)}"
        return Result("rollout", [row], COLUMNS, extra)
    build_s = time.perf_counter() - t0
    row["impl"] = impl or getattr(getattr(engine, "config", None), "moe_impl", None)
    row["cuda_graph"] = engine.cuda_graph
    extra["title"] = _title(preset, row["impl"], compile, engine.cuda_graph)
    row["params"] = int(engine.num_parameters())
    row["active_params"] = int(engine.num_active_parameters())
    try:
        with torch.no_grad():
            figures = measure_rollout(
                engine, frames, device=device, warmup_frames=warmup_frames, progress=progress
            )
    except Exception as exc:
        row["status"] = f"failed: {short_error(exc)}"
        return Result("rollout", [row], COLUMNS, extra)
    extra["frame_ms"] = figures.pop("frame_ms")
    row.update(figures)
    row["setup_s"] = build_s + figures["setup_s"]
    row["status"] = "ok"
    if not profile:
        return Result("rollout", [row], COLUMNS, extra)
    try:
        with torch.no_grad():
            found = rollout_profile.profile_engine(
                engine, profile_frames or (16 if cuda else 2), device=device
            )
        extra["profile"] = found.to_dict()
    except Exception as exc:
        extra["profile"] = {"status": f"failed: {short_error(exc)}"}
    text = f"{report.format_table([row], COLUMNS)}\n\n{report.format_profile(extra['profile'])}"
    return Result("rollout", [row], COLUMNS, extra, text=text)
