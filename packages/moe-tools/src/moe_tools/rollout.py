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
from collections.abc import Sequence
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
    bar = report.progress(range(frames), enabled=progress, desc="rollout", unit="frame")
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
    after the rows (``text``)."""
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
        from moe_tools import rollout_profile

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
            except Exception as exc:
                prof = {"status": f"failed: {short_error(exc)}"}
            profiles.append(prof if mode is None else {"mode": mode, **prof})
    if not profile:
        return done()
    extra["profiles"] = profiles
    extra["profile"] = profiles[-1] if profiles else {"status": "failed: no runtime ran"}
    parts = [report.format_table(rows, COLUMNS)]
    for prof in profiles:
        head = f"# profile: {prof['mode']}" if prof.get("mode") else None
        parts.append("\n".join(filter(None, [head, report.format_profile(prof)])))
    return done("\n\n".join(parts))
