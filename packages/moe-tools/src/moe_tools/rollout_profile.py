"""``moe-bench rollout --profile``: where a steady frame's time goes, by kernel category.

:func:`profile_engine` profiles a built ``WorldEngine`` with ``torch.profiler`` (CPU + CUDA
activities on CUDA): ``engine.reset()``, ``config.window + warmup_frames`` frames (the KV ring
fills, then the unmasked, steady variant runs and finishes compiling), then ``frames`` frames
under the profiler, the device synchronized before it stops. Every figure is a total over the
profiled frames divided by ``frames``.

Device time (CUDA) is the duration of every kernel, memcpy and memset the profiler records. Each
one is attributed to the range its launch was issued in, ``moe_model::frame`` or
``moe_model::decode`` (``WorldEngine.gen_frame`` enters them):

1. Correlation. The launching CPU event is the CUDA runtime / driver call with the activity's
   CUPTI correlation id (``cudaLaunchKernel``, ``cuLaunchKernel``; every kernel of a replayed
   CUDA graph shares the id of its ``cudaGraphLaunch``), else the ATen op kineto links the
   activity to (``linked_correlation_id``). Its range is the nearest ancestor in the profiler's
   CPU tree that is one, else the range whose CPU interval holds the launch's start (runtime
   calls that kineto links to no op keep their own thread id and stay out of the tree); a launch
   in the tree under neither is ``outside`` (e.g. the image's copy to the host).
2. No launching event, or one out of the tree that no range holds: ``unknown``; the name rules
   decide: :data:`DECODE_RULE` (convolution and upsampling kernels, which only the decoder runs)
   makes it ``decode``, else it is treated as a frame kernel.

A decode-range activity is ``decode``, an outside one ``other``; the others take the category of
the first rule of :data:`CATEGORY_RULES` whose pattern is found in their name (case-insensitive
``re.search``), ``other`` when none is.

On a CPU device there are no kernels: the same rules sort each ATen op's self CPU time (time in
the op, not in the ops it calls), ``kernels`` counts op calls and ``launches`` is None.

Host time per frame: the CPU wall time from entering to leaving ``moe_model::frame`` plus the same
for ``moe_model::decode`` (the profiler's own records of the two ranges), averaged over the
profiled frames: the Python side enqueueing one frame, without the image's copy to the host (which
waits for the device). It includes the profiler's per-op bookkeeping (it inflates eager frames
more than graph replays, which launch little) and any wait of the frame on the device (a host sync
inside the model, a full launch queue).

A profile joined with ``rollout_roofline.attach`` also carries each category's counted FLOPs,
bytes and floor and what it achieved: its table then has the roofline's columns too.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.autograd import DeviceType

from moe_model.engine import DECODE_SCOPE, FRAME_SCOPE
from moe_tools.plots import pyplot, save_figure
from moe_tools.tables import Row, format_table, format_value, markdown_table
from moe_tools.timing import synchronize

CATEGORIES = ("gemm", "attention", "routing", "pointwise", "decode", "other")
SCOPES = {FRAME_SCOPE: "frame", DECODE_SCOPE: "decode"}


class Rule(NamedTuple):
    """A kernel or op whose name contains ``regex`` (case-insensitive) is in ``category``."""

    category: str
    regex: re.Pattern[str]


def _rule(category: str, pattern: str) -> Rule:
    return Rule(category, re.compile(pattern, re.IGNORECASE))


# Ordered: the first match wins (cuDNN's "..._sdpa_sm90_..." is attention, not an sm90 GEMM;
# "_gather_grouped_mm_kernel" is a GEMM, not a routing gather). Each rule holds CUDA kernel names
# first, then the ATen / custom op names the CPU path sees.
CATEGORY_RULES: tuple[Rule, ...] = (
    # flash / memory-efficient / cuDNN SDPA kernels, flex attention templates; aten SDPA ops
    _rule("attention", r"flash|fmha|sdpa|attention|scaled_dot_product"),
    # cuBLAS(Lt) (gemm, gemv, nvjet, split-K reduce), CUTLASS/xmma (incl. torch._grouped_mm),
    # Inductor templates, moe_kernels' _gather_grouped_mm_kernel; aten mm ops
    _rule(
        "gemm",
        r"gemm|gemv|nvjet|cutlass|xmma|\bsm\d{2,3}_|splitkreduce|triton_tem_|grouped_mm"
        r"|aten::(addmm|mm|bmm|baddbmm|matmul|linear)$",
    ),
    # moe_kernels routing (topk_rows, topk_columns, scan, place, expert_runs, fused), router and
    # token kernels (Inductor adds a "_<n>" suffix); torch routing's sort / top-k / cumsum (only
    # the router sorts and scans in this model); the moe_kernels custom ops
    _rule(
        "routing",
        r"topk|sort|scan|cumsum|bincount|histc"
        r"|(^|\W)(place|expert_runs|fused|_router|_gather_rows|_combine|_scatter_add)_kernel"
        r"|moe_kernels::(route|router_scores|dispatch|combine|gather_scale|scatter_add|index_sh)",
    ),
    # Inductor pointwise / reductions, ATen elementwise, reduce, norm, softmax, index, copy and
    # fill kernels, memcpy / memset, the KV write, mxfp8 quantisers and scale layouts
    _rule(
        "pointwise",
        r"triton_(poi|red|per)_|elementwise|reduce|softmax|norm|index|gather|scatter|copy|memcpy"
        r"|memset|fill|cat|kv_write|mxfp8|_blocked_[23]d|_group_offsets"
        r"|aten::(add|sub|mul|div|neg|silu|gelu|sigmoid|tanh|exp|pow|rsqrt|sqrt|sin|cos|where"
        r"|eq|ne|lt|gt|clamp|round|sum|mean|amax|remainder|isnan)_?$",
    ),
)
# For an activity whose launch could not be found: the decoder's convolutions and upsampling.
DECODE_RULE = _rule("decode", r"conv(?!ert)|fprop|implicit_gemm|nchw|nhwc|upsample|im2col|winograd")

LAUNCH_CALLS = re.compile(r"Launch(Cooperative)?Kernel|GraphLaunch")
_DEVICE_KINDS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_CALL_KINDS = frozenset({"cuda_runtime", "cuda_driver"})
_OP_KINDS = frozenset({"cpu_op", "user_annotation"})
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, ...


def _kind(e: Any) -> str:
    """The event's kineto activity type; torch before 2.13 keeps none on its events (the device
    ones then carry their own correlation id as ``id``, like the runtime calls), so it is read
    off the device, the annotation flag and the name."""
    kind = getattr(e, "activity_type", None)
    if kind:
        return kind
    if e.device_type == DeviceType.CUDA:
        if e.name in SCOPES:
            return "gpu_user_annotation"
        return (
            "gpu_memcpy" if "Memcpy" in e.name else "gpu_memset" if "Memset" in e.name else "kernel"
        )
    if getattr(e, "is_user_annotation", False):
        return "user_annotation"
    return "cuda_runtime" if _RUNTIME_CALL.match(e.name) else "cpu_op"


def rule_category(name: str) -> str:
    """The category of a frame kernel / op named ``name``: the first matching rule, or other."""
    return next((r.category for r in CATEGORY_RULES if r.regex.search(name)), "other")


def categorize(name: str, scope: str) -> str:
    """The category of an activity launched in ``scope`` (frame, decode, outside, unknown)."""
    if scope == "decode" or (scope == "unknown" and DECODE_RULE.regex.search(name)):
        return "decode"
    return "other" if scope == "outside" else rule_category(name)


class Activity(NamedTuple):
    """One timed piece of work: a CUDA kernel / memcpy / memset, or an ATen op's self CPU time."""

    name: str
    us: float
    scope: str  # frame, decode, outside (launched out of both ranges), unknown (not placed)
    kernel: bool  # counts in kernels_per_frame (a CUDA kernel; on CPU every op call)


class CategoryTime(NamedTuple):
    category: str
    ms_per_frame: float
    share: float  # of device_ms_per_frame, in [0, 1]
    kernels_per_frame: float


@dataclass(frozen=True)
class Breakdown:
    """A profile's per-frame figures (ms; counts per frame). ``basis``: "device" (CUDA kernel
    time) or "cpu_self" (ATen ops' self CPU time). ``attribution``: activities placed by
    correlation and by name rules alone, over all profiled frames."""

    frames: int
    basis: str
    categories: tuple[CategoryTime, ...]
    device_ms_per_frame: float
    kernels_per_frame: float
    launches_per_frame: float | None
    host_ms_per_frame: float
    attribution: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``extra["profile"]`` of ``moe-bench rollout --profile --json``)."""
        return {
            "status": "ok",
            "frames": self.frames,
            "basis": self.basis,
            "categories": [c._asdict() for c in self.categories],
            "device_ms_per_frame": self.device_ms_per_frame,
            "kernels_per_frame": self.kernels_per_frame,
            "launches_per_frame": self.launches_per_frame,
            "host_ms_per_frame": self.host_ms_per_frame,
            "attribution": dict(self.attribution),
        }


def breakdown(
    activities: Iterable[Activity],
    frames: int,
    *,
    host_us: float,
    launches: int | None,
    basis: str,
) -> Breakdown:
    """Per-frame figures from the activities of ``frames`` profiled frames (times in us)."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    times: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    counts = dict.fromkeys(CATEGORIES, 0)
    attribution = {"correlated": 0, "name_rules": 0}
    for a in activities:
        category = categorize(a.name, a.scope)
        times[category].append(a.us)
        counts[category] += a.kernel
        attribution["name_rules" if a.scope == "unknown" else "correlated"] += 1
    totals = {c: math.fsum(ts) for c, ts in times.items()}
    device_us = math.fsum(totals.values())
    categories = tuple(
        CategoryTime(
            c,
            totals[c] / frames / 1e3,
            totals[c] / device_us if device_us else 0.0,
            counts[c] / frames,
        )
        for c in CATEGORIES
    )
    return Breakdown(
        frames=frames,
        basis=basis,
        categories=categories,
        device_ms_per_frame=device_us / frames / 1e3,
        kernels_per_frame=sum(counts.values()) / frames,
        launches_per_frame=None if launches is None else launches / frames,
        host_ms_per_frame=host_us / frames / 1e3,
        attribution=attribution,
    )


# ----------------------------------------------------------------------------------------------
# profiler events -> activities


class _Range(NamedTuple):
    start_us: float
    end_us: float
    scope: str


class CudaTrace(NamedTuple):
    activities: list[Activity]
    launches: int  # runtime / driver launch calls (kernels and graphs)


def _is_cpu(e: Any) -> bool:
    return e.device_type == DeviceType.CPU and not e.is_async


def _ranges(events: Sequence[Any]) -> list[_Range]:
    """The CPU intervals of the engine's frame and decode ranges."""
    return [
        _Range(e.time_range.start, e.time_range.end, SCOPES[e.name])
        for e in events
        if _is_cpu(e) and _kind(e) == "user_annotation" and e.name in SCOPES
    ]


def _scope(event: Any, ranges: Sequence[_Range]) -> str:
    """frame / decode: the nearest range among a CPU event's ancestors, else the one whose
    interval holds its start; when neither, outside if the event is in the CPU tree (an op, or a
    call with a parent), else unknown."""
    node = event
    while node is not None:
        if _kind(node) == "user_annotation" and node.name in SCOPES:
            return SCOPES[node.name]
        node = node.cpu_parent
    t = event.time_range.start
    scope = next((r.scope for r in ranges if r.start_us <= t <= r.end_us), None)
    in_tree = event.cpu_parent is not None or _kind(event) in _OP_KINDS
    return scope or ("outside" if in_tree else "unknown")


def host_us(events: Sequence[Any]) -> float:
    """CPU wall time (us) spent inside the frame and decode ranges."""
    return math.fsum(r.end_us - r.start_us for r in _ranges(events))


def cuda_activities(events: Sequence[Any]) -> CudaTrace:
    """Every kernel / memcpy / memset of a profile, with the range of its launch (see the module
    docstring), and the count of launch calls."""
    ranges = _ranges(events)
    cpu = [e for e in events if _is_cpu(e)]
    calls = {e.id: e for e in cpu if _kind(e) in _CALL_KINDS}
    ops = {e.id: e for e in cpu if _kind(e) in _OP_KINDS}
    activities = []
    for e in events:
        if e.device_type != DeviceType.CUDA or _kind(e) not in _DEVICE_KINDS:
            continue  # a device-side range (gpu_user_annotation) or a CPU event
        launcher = calls.get(e.id)
        if launcher is None and getattr(e, "linked_correlation_id", 0):
            launcher = ops.get(e.linked_correlation_id)
        scope = "unknown" if launcher is None else _scope(launcher, ranges)
        activities.append(Activity(e.name, e.time_range.elapsed_us(), scope, _kind(e) == "kernel"))
    launches = sum(1 for e in calls.values() if LAUNCH_CALLS.search(e.name))
    return CudaTrace(activities, launches)


def cpu_activities(events: Sequence[Any]) -> list[Activity]:
    """Every ATen / custom op of a CPU profile: its self CPU time and the range it ran in."""
    ranges = _ranges(events)
    return [
        Activity(e.name, e.self_cpu_time_total, _scope(e, ranges), True)
        for e in events
        if _is_cpu(e) and _kind(e) == "cpu_op"
    ]


# ----------------------------------------------------------------------------------------------
# the measurement


def _activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    cpu = [torch.profiler.ProfilerActivity.CPU]
    return cpu + [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else cpu


def prepare_cuda_graphs(device: torch.device) -> None:
    """Start and stop the profiler once before an engine captures CUDA graphs: profiling the
    replays of a graph captured before the profiler's first use is a known failure (PyTorch
    issue 75504; this is the workaround of ``torch.profiler._utils._init_for_cuda_graphs``).
    A no-op on CPU."""
    if device.type == "cuda":
        with torch.profiler.profile(activities=_activities(device)):
            pass


def profile_engine(
    engine: Any, frames: int, *, device: torch.device, warmup_frames: int = 1
) -> Breakdown:
    """Reset, fill the KV ring (``config.window`` frames), ``warmup_frames`` steady frames, then
    profile ``frames`` frames (see the module docstring); the engine is left mid-rollout."""
    engine.reset()
    for _ in range(engine.config.window + warmup_frames):
        engine.gen_frame()
    synchronize(device)
    with torch.profiler.profile(activities=_activities(device)) as prof:
        for _ in range(frames):
            engine.gen_frame()
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        trace = cuda_activities(events)
        activities, launches, basis = trace.activities, trace.launches, "device"
    else:
        activities, launches, basis = cpu_activities(events), None, "cpu_self"
    return breakdown(activities, frames, host_us=host_us(events), launches=launches, basis=basis)


# ----------------------------------------------------------------------------------------------
# presentation: the breakdown as a table, markdown and a figure

PROFILE_COLUMNS = ["category", "ms_per_frame", "share_pct", "kernels_per_frame"]
ROOFLINE_COLUMNS = ["flops", "bytes", "floor_ms", "achieved", "x_floor"]


def _count(value: float | None) -> float | int | None:
    """A per-frame count: an int when whole (1 and 0.5, not 1.0 and 0.5)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def profile_columns(profile: Mapping[str, Any]) -> list[str]:
    """The table's columns: the roofline's too when the profile carries one."""
    return PROFILE_COLUMNS + (ROOFLINE_COLUMNS if profile.get("roofline") else [])


def _achieved(c: Mapping[str, Any]) -> str | None:
    """The rate of the resource that bounds the category's floor (its unit says which): TFLOP/s
    when compute-bound, GB/s when memory-bound; without peaks TFLOP/s when it does FLOPs. The
    JSON holds both (``achieved_tflops``, ``achieved_gbps``)."""
    if c.get("achieved_tflops") is None:
        return None
    bound = c.get("bound") or ("compute" if c.get("flops") else "memory")
    if bound == "compute":
        return f"{format_value(c['achieved_tflops'])} TFLOP/s"
    return f"{format_value(c['achieved_gbps'])} GB/s"


def _roof(c: Mapping[str, Any]) -> Row:
    return {
        "flops": c.get("flops"),
        "bytes": c.get("bytes"),
        "floor_ms": c.get("floor_ms"),
        "achieved": _achieved(c),
        "x_floor": c.get("x_floor"),
    }


def profile_rows(profile: Mapping[str, Any]) -> list[Row]:
    """One row per category (its share of the total in percent), then the total; with a
    roofline (``rollout_roofline.attach``) its columns too (FLOPs and bytes per frame)."""
    roof = profile.get("roofline")
    rows: list[Row] = [
        {
            "category": c["category"],
            "ms_per_frame": c["ms_per_frame"],
            "share_pct": 100.0 * c["share"],
            "kernels_per_frame": _count(c["kernels_per_frame"]),
            **(_roof(c) if roof else {}),
        }
        for c in profile.get("categories", [])
    ]
    total: Row = {
        "category": "total",
        "ms_per_frame": profile.get("device_ms_per_frame"),
        "share_pct": None,
        "kernels_per_frame": _count(profile.get("kernels_per_frame")),
        **(_roof(roof) if roof else {}),
    }
    return [*rows, total]


def roofline_lines(roof: Mapping[str, Any] | None) -> list[str]:
    """The roofline's peaks and the frame's floors (``rollout_roofline``'s byte model)."""
    if not roof:
        return []
    head = (
        f"roofline: {format_value(roof['flops'] / 1e12)} TFLOP and "
        f"{format_value(roof['bytes'] / 1e9)} GB a frame, counted from the config's shapes"
    )
    peak = roof.get("peak")
    if not peak:
        return [head + "; no peaks known for this device (--peak-tflops, --peak-gbps)"]
    floor, bound = roof["floor_ms"], roof["frame_bound_ms"]
    return [
        f"{head}; at {peak['name']} peaks ({format_value(peak['tflops'])} TFLOP/s dense bf16, "
        f"{format_value(peak['gbps'])} GB/s): floor {format_value(floor)} ms/frame (sum of each "
        f"op's max(FLOPs/peak, bytes/bandwidth), {format_value(1e3 / floor)} fps); the frame as "
        f"one kernel {format_value(bound)} ms ({format_value(1e3 / bound)} fps)"
    ]


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
    return lines + roofline_lines(profile.get("roofline"))


def format_profile(profile: Mapping[str, Any]) -> str:
    """The profile's stdout: the breakdown table (when measured), then its summary lines."""
    lines = [f"# {x}" for x in profile_lines(profile)]
    if profile.get("status") != "ok":
        return "\n".join(lines)
    return "\n".join([format_table(profile_rows(profile), profile_columns(profile)), *lines])


def markdown_profile(profile: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md body of a rollout profile: the breakdown table and its summary."""
    notes = [f"* {x}" for x in profile_lines(profile)]
    if profile.get("status") != "ok":
        return "\n".join(notes)
    return "\n".join([markdown_table(profile_rows(profile), profile_columns(profile)), "", *notes])


def plot_profile(
    profile: Mapping[str, Any], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """A rollout profile as horizontal bars, ms per frame: one per category (labelled with its
    share), then the device total and the host time, to compare the two."""
    plt = pyplot()
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
