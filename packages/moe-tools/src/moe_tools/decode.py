"""``moe-bench decode``: the MoE layer from one token up, where its time is reading the touched
experts' weights.

Per preset, token count T and implementation: the layer's forward all in (router, routing,
experts, combine, shared experts; no gradient), on CUDA one call captured in a CUDA graph and
replayed (``--compile``: ``torch.compile(fullgraph=True)`` first, one compile per T), on CPU
eager. Beside the time: the experts the T tokens touched (read from ``last_counts`` after the
measured call), the bytes a call must read at least (``decode_bytes``: the touched experts'
weights, the router, the shared experts, x and y), that over the time (GB/s) and as a share of
the device's HBM bandwidth (``--peak-gbps`` or the spec sheet of ``rollout_roofline.PEAKS``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from moe_tools import command as cmd
from moe_tools.matrix import build_layer, impl_names, layer_sizes, preset_name
from moe_tools.results import Result, slug
from moe_tools.rollout_roofline import find_peak
from moe_tools.tables import Row, short_error
from moe_tools.timing import graph_time_fn, time_fn

COLUMNS = ["preset", "tokens", "impl", "ms", "touched", "read_mb", "gbps", "hbm_pct", "status"]
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CUDA_PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
IMPLS = ("triton_bf16", "torch", "fp8")  # ours in bf16, torch's, ours with FP8 experts


def decode_bytes(layer: torch.nn.Module, counts_E: torch.Tensor, tokens: int) -> int:
    """The bytes one forward of ``tokens`` tokens must read or write at least: the in and out
    projections of every expert with a routed pair (``counts_E`` > 0), the router's weight, the
    shared experts' weights, x in and y out (in the expert weights' dtype). An impl that runs
    the layer's FP8 experts reads those (one byte a weight, and their fp32 scales)."""
    from moe_model.impls import IMPLS as MOE_IMPLS

    touched = int((counts_E > 0).sum())
    expert = (layer.in_proj[0].numel() + layer.out_proj[0].numel()) * layer.in_proj.element_size()
    if MOE_IMPLS[layer.impl].fp8_experts:
        expert = sum(t[0].numel() * t.element_size() for w in layer.fp8.get() for t in w)
    router = sum(p.numel() * p.element_size() for p in layer.router.parameters())
    shared = 0
    if layer.shared_experts is not None:
        shared = sum(p.numel() * p.element_size() for p in layer.shared_experts.parameters())
    io = 2 * tokens * layer.d_model * layer.in_proj.element_size()
    return touched * expert + router + shared + io


def _row(preset: str, tokens: int, impl: str, status: str = "ok") -> Row:
    row: Row = dict.fromkeys(COLUMNS)
    row.update(preset=preset, tokens=tokens, impl=impl, status=status)
    return row


def _measure(layer, preset, impl, tokens, device, dtype, gbps_peak, compile_, seed) -> Row:
    row = _row(preset, tokens, impl)
    gen = torch.Generator(device=device).manual_seed(seed + tokens)
    x_TD = torch.randn(tokens, layer.d_model, generator=gen, device=device, dtype=dtype)
    try:
        layer.impl = impl
        fn = layer
        if compile_:
            torch._dynamo.reset()
            fn = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            fn(x_TD)
            graph = graph_time_fn(lambda: fn(x_TD), device)
            timing = graph if graph is not None else time_fn(lambda: fn(x_TD), device)
    except Exception as exc:
        row["status"] = f"failed: {short_error(exc, limit=80)}"
        return row
    finally:
        if compile_:
            torch._dynamo.reset()
    row["ms"] = timing.median_ms
    read = decode_bytes(layer, layer.last_counts, tokens)
    row["touched"] = int((layer.last_counts > 0).sum())
    row["read_mb"] = read / 1e6
    row["gbps"] = read / (timing.median_ms * 1e-3) / 1e9
    if gbps_peak is not None:
        row["hbm_pct"] = 100.0 * row["gbps"] / gbps_peak
    return row


def run(
    *,
    device: torch.device,
    presets: Sequence[str],
    tokens: Sequence[int],
    impls: Sequence[str],
    dtype: torch.dtype,
    seed: int = 0,
    compile_: bool = False,
    peak_gbps: float | None = None,
    layer_overrides: dict[str, Any] | None = None,
) -> Result:
    """One row per (preset, T, impl), in that order; the layer of each preset built once."""
    peak = None
    if device.type == "cuda":
        peak = find_peak(torch.cuda.get_device_name(device), tflops=1.0, gbps=peak_gbps)
    gbps = peak_gbps if peak is None else peak.gbps
    rows = []
    for preset in presets:
        sizes = layer_sizes(preset, **(layer_overrides or {}))
        layer = build_layer(sizes, device, dtype, seed, impl=impls[0])
        for t in tokens:
            for impl in impls:
                rows.append(_measure(layer, preset, impl, t, device, dtype, gbps, compile_, seed))
        del layer
    mode = "compiled" if compile_ else "eager"
    where = "in a CUDA graph" if device.type == "cuda" else "no graph"
    extra = {"peak_gbps": gbps, "mode": f"{mode}, {where}"}
    return Result("decode", rows, COLUMNS, extra)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--presets",
        type=_presets,
        help=f"comma-separated layer presets (default: {','.join(CUDA_PRESETS)} on CUDA, tiny on "
        "CPU)",
    )
    p.add_argument(
        "--tokens",
        type=cmd.int_csv,
        help=f"comma-separated token counts (default: {','.join(map(str, TOKENS))})",
    )
    p.add_argument(
        "--impls",
        type=cmd.choices_csv(impl_names),
        help=f"comma-separated MoELayer impls (default: {','.join(IMPLS)})",
    )
    cmd.dtype_option(p)
    p.add_argument("--compile", action="store_true", help="torch.compile each T (slow)")
    p.add_argument(
        "--peak-gbps",
        type=cmd.positive_float,
        metavar="X",
        help="HBM bandwidth for the share column (default: the device's spec sheet)",
    )
    cmd.plot_option(p, "the HBM share (GB/s without a peak) over token counts")


def _presets(text: str) -> list[str]:
    """Comma-separated layer presets (``matrix.preset_name``'s)."""
    return [preset_name(name) for name in cmd.csv(text)]


def _defaults(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    cuda = args.device.type == "cuda"
    presets = args.presets or (list(CUDA_PRESETS) if cuda else ["tiny"])
    return presets, args.tokens or list(TOKENS), args.impls or list(IMPLS)


def result_name(args: argparse.Namespace) -> str:
    presets, tokens, impls = _defaults(args)
    return slug("decode", presets, "compiled" if args.compile else None, impls)


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    presets, tokens, impls = _defaults(args)
    return run(
        device=args.device,
        presets=presets,
        tokens=tokens,
        impls=impls,
        dtype=cmd.dtype_of(args.dtype, args.device),
        seed=args.seed,
        compile_=args.compile,
        peak_gbps=args.peak_gbps,
    )


def plot(result: Result, path: str):
    """HBM share (or GB/s) over T, a line per (preset, impl), log2 T axis."""
    from moe_tools.plots import pyplot, save_figure

    plt = pyplot()
    share = result.extra.get("peak_gbps") is not None
    key = "hbm_pct" if share else "gbps"
    fig, ax = plt.subplots(figsize=(7, 4))
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in result.rows:
        if row.get(key) is not None:
            lines.setdefault((row["preset"], row["impl"]), []).append((row["tokens"], row[key]))
    for (preset, impl), points in lines.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=f"{preset} {impl}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("% of HBM bandwidth" if share else "GB/s")
    ax.set_title(f"MoE layer forward ({result.extra.get('mode', '')})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


COMMAND = cmd.Command(
    name="decode",
    help="the MoE layer from one token up: time, touched experts' bytes, share of HBM bandwidth",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=result_name,
    plot=plot,
)
