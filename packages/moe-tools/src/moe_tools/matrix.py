"""``moe-bench matrix``: every ``moe_model.MoELayer`` implementation on the same weights and input.

Per implementation: eager and ``torch.compile(fullgraph=True)`` medians, the compiled layer's
time in a CUDA graph (``graph_ms``) and, on CUDA, that time over the two expert GEMMs alone with
the layer's own group sizes (``vs_gemms``), determinism (eager vs a second eager call), drift
from the eager ``baseline`` and between compiled and eager. Errors are measured in fp32 on the
layer outputs. One layer is built and its ``impl`` switched, so every implementation sees the
same parameters; Dynamo is reset between implementations.

``preset`` names a world-model preset (``moe_model.PRESETS``: its MoE layer) or an MoE preset
(``moe_model.MOE_PRESETS``: a published model's layer with all its routing options, e.g.
``deepseek-v3``); the layer is built directly on the device in the benchmark dtype.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_tools import command as cmd
from moe_tools import tables
from moe_tools.memory import check_fits, check_top_k, meta_bytes
from moe_tools.results import Result, slug
from moe_tools.tables import Row, short_error
from moe_tools.timing import default_device, graph_time_fn, time_fn

COLUMNS = [
    "impl",
    "eager_ms",
    "compiled_ms",
    "graph_ms",
    "vs_gemms",
    "speedup",
    "self_max",
    "self_mean",
    "vs_base_max",
    "vs_base_mean",
    "comp_vs_base_max",
    "comp_vs_base_mean",
    "comp_vs_eager_max",
    "comp_vs_eager_mean",
    "compile_s",
    "status",
]

BASELINE = "baseline"
# Why the baseline cannot be compiled with fullgraph=True (it is the reference, not a contender).
BASELINE_COMPILE_REASON = "host syncs"


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max, mean) absolute difference in fp32; inf when shapes differ or values are not finite."""
    if a.shape != b.shape:
        return float("inf"), float("inf")
    d = (a.float() - b.float()).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    return float(d.max()), float(d.mean())


def is_moe_preset(preset: str) -> bool:
    """Whether ``preset`` names an MoE layer preset (``moe_model.MOE_PRESETS``)."""
    from moe_model import MOE_PRESETS

    return preset in MOE_PRESETS


def layer_sizes(preset: str, **overrides: Any) -> dict[str, Any]:
    """MoELayer's constructor arguments (all but impl, device and dtype) of a preset: an MoE
    preset's own, or the MoE layer of a world-model preset; ``overrides`` replace any of them
    (e.g. a smaller ``d_model`` for a test)."""
    from moe_model import MOE_PRESETS, WorldModelConfig

    if preset in MOE_PRESETS:
        return {**MOE_PRESETS[preset], **overrides}
    cfg = WorldModelConfig.from_preset(preset)
    return {
        "d_model": cfg.d_model,
        "n_experts": cfg.n_experts,
        "top_k": cfg.top_k,
        "hidden": cfg.moe_hidden,
        "gated": cfg.gated,
        "score_fn": cfg.score_fn,
        "renormalize": cfg.renormalize,
        **overrides,
    }


def build_layer(
    sizes: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int, impl: str = BASELINE
) -> torch.nn.Module:
    """A ``MoELayer`` of ``sizes`` (its keyword arguments, see :func:`layer_sizes`) in eval mode,
    seeded, built directly on ``device`` with its expert weights in ``dtype`` (no fp32 copy on
    the host: a deepseek-v3 layer is 22 GB in bf16); the router stays fp32, as the layer keeps
    it."""
    from moe_model import MoELayer

    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cmd.derived_seed(seed))  # train's teacher: --seed + 1
        layer = MoELayer(**sizes, impl=impl, device=device, dtype=dtype)
    return layer.eval().requires_grad_(False)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _compile(fn: Callable[..., torch.Tensor], backend: str) -> Callable[..., torch.Tensor]:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def run(
    *,
    device: torch.device | str | None = None,
    preset: str | None = None,
    tokens: int | None = None,
    impls: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    warmup: int | None = None,
    iters: int | None = None,
    seed: int = 0,
    progress: bool = True,
    compile: bool = True,
    compile_backend: str = "inductor",
    layer_overrides: dict[str, Any] | None = None,
) -> Result:
    """Measure every implementation; one row each, in ``impls`` order (default: ``MOE_IMPLS``).

    ``preset``: a world-model or an MoE preset (default: seed-moe on CUDA, tiny on CPU), its
    layer's arguments replaced by ``layer_overrides`` (e.g. a small ``d_model`` for a test).
    ``tokens`` defaults to 2048 on CUDA (4096 for an MoE preset), 64 on CPU.
    ``compile=False`` skips the compiled columns; ``compile_backend`` is passed to
    ``torch.compile`` (the tests use "eager": Dynamo's fullgraph capture without Inductor).
    """
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    preset = preset or ("seed-moe" if cuda else "tiny")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    warmup = warmup or (5 if cuda else 1)
    iters = iters or (20 if cuda else 3)
    try:
        moe_preset = is_moe_preset(preset)
    except Exception:  # moe_model missing or broken: reported below
        moe_preset = False
    tokens = tokens or ((4096 if moe_preset else 2048) if cuda else 64)
    extra: dict[str, Any] = {
        "preset": preset,
        "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": warmup,
        "iters": iters,
    }
    try:
        from moe_model import MOE_IMPLS

        sizes = layer_sizes(preset, **(layer_overrides or {}))
    except Exception as exc:  # moe_model missing or broken: one row says so
        reason = f"unavailable: moe_model: {short_error(exc)}"
        return Result(
            "matrix", [_empty_row(i, reason) for i in (impls or [BASELINE])], COLUMNS, extra
        )
    extra["layer"] = sizes
    impls = list(impls or MOE_IMPLS)

    check_layer_fits(preset, sizes, tokens, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(tokens, sizes["d_model"], generator=gen).to(device=device, dtype=dtype)
    layer = build_layer(sizes, device, dtype, seed)

    with torch.no_grad():
        y_base = None
        try:
            y_base = layer(x_TD).clone()
        except Exception as exc:  # the reference itself failed: drift columns stay empty
            extra["baseline_error"] = short_error(exc)
        rows = []
        for impl in tables.progress(impls, enabled=progress, desc="matrix", unit="impl"):
            if impl not in impl_names():
                rows.append(
                    _empty_row(impl, f"unavailable: unknown impl (known: {', '.join(MOE_IMPLS)})")
                )
                continue
            backend = compile_backend if compile else None
            rows.append(_measure(layer, impl, x_TD, y_base, device, warmup, iters, backend=backend))
            _free(device)
        if device.type == "cuda":
            gemm_rows = _grouped_gemms_rows(layer, x_TD, device, warmup, iters)
            floor = gemm_rows[-1]["graph_ms"]  # the routed groups: the GEMMs the layer runs
            for row in rows + gemm_rows:
                if floor and row["graph_ms"]:
                    row["vs_gemms"] = row["graph_ms"] / floor
            rows += gemm_rows
    torch._dynamo.reset()
    return Result("matrix", rows, COLUMNS, extra)


SHRINK_HINT = (
    "Shrink it for a quick look: --experts, --hidden, --d-model (e.g. --experts 16 --hidden 256), "
    "or fewer --tokens."
)


def layer_bytes(sizes: dict[str, Any], tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """(weights, activations) bytes of a matrix run: the layer's parameters (built on the meta
    device), and its largest intermediates at ``tokens`` tokens in fp32 (x, the T*k dispatched
    rows, the expert hidden states, the outputs kept for the drift columns), twice over for the
    compiled variant's buffers."""
    check_top_k(sizes)
    weights = meta_bytes(
        lambda: build_layer(sizes, torch.device("meta"), dtype, seed=0),
        f"the layer (E={sizes['n_experts']}, d_model {sizes['d_model']}, hidden {sizes['hidden']})",
        SHRINK_HINT,
    )
    k, d = sizes["top_k"], sizes["d_model"]
    hidden = sizes["hidden"] * (3 if sizes.get("gated") else 2)
    activations = 2 * 4 * (tokens * k * (2 * d + hidden) + 6 * tokens * d)
    return weights, activations


def check_layer_fits(
    preset: str, sizes: dict[str, Any], tokens: int, device: torch.device, dtype: torch.dtype
) -> None:
    """UsageError with the layer's size when it would not fit in ``device``'s free memory."""
    weights, activations = layer_bytes(sizes, tokens, dtype)
    name = str(dtype).removeprefix("torch.")
    check_fits(
        f"the {preset} layer (E={sizes['n_experts']}, d_model {sizes['d_model']}, hidden "
        f"{sizes['hidden']})",
        weights + activations,
        torch.device(device),
        f"{weights / 2**30:.1f} GiB of weights in {name}, about {activations / 2**30:.1f} GiB of "
        f"activations at {tokens} tokens",
        SHRINK_HINT,
    )


def _empty_row(impl: str, status: str) -> Row:
    row: Row = {c: None for c in COLUMNS}
    row.update(impl=impl, status=status)
    return row


def _measure(
    layer: torch.nn.Module,
    impl: str,
    x_TD: torch.Tensor,
    y_base: torch.Tensor | None,
    device: torch.device,
    warmup: int,
    iters: int,
    *,
    backend: str | None,
) -> Row:
    row = _empty_row(impl, "ok")
    try:
        layer.impl = impl
        y1 = layer(x_TD).clone()
        y2 = layer(x_TD).clone()
    except Exception as exc:
        row["status"] = f"unavailable: {short_error(exc)}"
        return row
    row["self_max"], row["self_mean"] = diff_stats(y1, y2)
    if y_base is not None:
        row["vs_base_max"], row["vs_base_mean"] = diff_stats(y1, y_base)
    row["eager_ms"] = time_fn(lambda: layer(x_TD), device, warmup=warmup, iters=iters).median_ms
    if backend is None:
        return row

    import time

    try:
        t0 = time.perf_counter()
        compiled = _compile(layer, backend)
        yc = compiled(x_TD).clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_ms"] = time_fn(
            lambda: compiled(x_TD), device, warmup=warmup, iters=iters
        ).median_ms
    except Exception as exc:
        reason = short_error(exc, limit=80)
        if impl == BASELINE:
            row["status"] = f"expected: {BASELINE_COMPILE_REASON} ({reason})"
        else:
            row["status"] = f"compile failed: {reason}"
        return row
    finally:
        torch._dynamo.reset()
    try:  # the compiled layer replayed in a CUDA graph: its device time, no launch cost
        graph = graph_time_fn(lambda: compiled(x_TD), device, warmup=warmup, iters=iters)
        row["graph_ms"] = graph.median_ms if graph is not None else None
    except Exception as exc:
        row["status"] = f"ok (no CUDA graph: {short_error(exc, limit=60)})"
    row["speedup"] = row["eager_ms"] / row["compiled_ms"] if row["compiled_ms"] else None
    if y_base is not None:
        row["comp_vs_base_max"], row["comp_vs_base_mean"] = diff_stats(yc, y_base)
    row["comp_vs_eager_max"], row["comp_vs_eager_mean"] = diff_stats(yc, y1)
    return row


GEMMS_ROW = "grouped_gemms"  # groups of equal size: the floor with perfectly balanced routing
GEMMS_ROUTED_ROW = "grouped_gemms_routed"  # the group sizes the layer's router gives this input


def _grouped_gemms_rows(
    layer: torch.nn.Module, x_TD: torch.Tensor, device: torch.device, warmup: int, iters: int
) -> list[Row]:
    """The experts' two ``torch._grouped_mm`` calls alone on random rows (tokens * top_k of
    them), the yardstick of the sync-free implementations: once with the rows split evenly over
    the experts, once with the group sizes that ``moe_kernels.route`` gives for the layer's
    router scores of ``x_TD`` (the GEMMs the layer itself runs; on the H200 uneven groups made
    them ~15% slower, most likely from partial tiles and one more wave of tiles)."""
    rows = [_empty_row(GEMMS_ROW, "reference: the two expert GEMMs alone, equal groups")]
    rows.append(
        _empty_row(GEMMS_ROUTED_ROW, "reference: the two expert GEMMs alone, routed groups")
    )
    if not hasattr(torch, "_grouped_mm"):
        for row in rows:
            row["status"] = "unavailable: torch._grouped_mm missing"
        return rows
    from moe_kernels import route

    E, k = layer.n_experts, layer.top_k
    w_in, w_out = layer.in_proj.mT, layer.out_proj.mT  # (E, D, H'), (E, H, D)
    n_rows = x_TD.shape[0] * k
    gen = torch.Generator(device=device).manual_seed(1)
    xs = torch.randn(n_rows, w_in.shape[1], device=device, dtype=w_in.dtype, generator=gen)
    h = torch.randn(n_rows, w_out.shape[1], device=device, dtype=w_out.dtype, generator=gen)
    even = (torch.arange(1, E + 1, device=device) * n_rows // E).to(torch.int32)
    plan = route(layer.scores(x_TD), k, **layer.route_options())
    routed = plan.offsets[1:].to(torch.int32)  # every token routes k times: ends at n_rows
    for row, offs in zip(rows, (even, routed), strict=True):

        def gemms(offs: torch.Tensor = offs) -> None:
            torch._grouped_mm(xs, w_in, offs=offs)
            torch._grouped_mm(h, w_out, offs=offs)

        try:
            row["eager_ms"] = time_fn(gemms, device, warmup=warmup, iters=iters).median_ms
            graph = graph_time_fn(gemms, device, warmup=warmup, iters=iters)
            row["graph_ms"] = graph.median_ms if graph is not None else None
        except Exception as exc:
            row["status"] = f"unavailable: {short_error(exc)}"
    return rows


# ----------------------------------------------------------------------------------------------
# the command

WORLD_PRESETS = ("tiny", "seed-moe")  # world-model presets with an MoE layer
SHRINK = {"experts": "n_experts", "d_model": "d_model", "hidden": "hidden", "top_k": "top_k"}


def preset_name(text: str) -> str:
    """A world-model preset with an MoE layer, or an MoE preset (``moe_model.MOE_PRESETS``)."""
    from moe_model import MOE_PRESETS

    known = (*WORLD_PRESETS, *MOE_PRESETS)
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose from {', '.join(known)}")
    return text


def impl_names() -> tuple[str, ...]:
    """``moe_model.MOE_IMPLS``: the names the commands offer (not the former names in
    ``IMPL_ALIASES``, which MoELayer still accepts for old configs)."""
    from moe_model import MOE_IMPLS

    return tuple(MOE_IMPLS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        type=preset_name,
        help="the layer: a world model's (tiny, seed-moe) or a published model's with its "
        "routing options (moe_model.MOE_PRESETS: deepseek-v3, qwen3-30b-a3b, mixtral-8x7b); "
        "default: seed-moe on CUDA, tiny on CPU",
    )
    p.add_argument(
        "--tokens",
        type=cmd.positive,
        help="tokens per call (default: 2048 on CUDA, 4096 for an MoE preset; 64 on CPU)",
    )
    p.add_argument(
        "--impls", type=cmd.choices_csv(impl_names), help="comma-separated (default: all)"
    )
    cmd.dtype_option(p)
    p.add_argument("--warmup", type=cmd.positive, help="untimed calls per variant")
    p.add_argument("--iters", type=cmd.positive, help="timed calls per variant")
    p.add_argument("--no-compile", action="store_true", help="eager columns only")
    shrink = p.add_argument_group("shrink the preset's layer (a quick look on a small machine)")
    shrink.add_argument("--experts", type=cmd.positive, metavar="E", help="number of experts")
    shrink.add_argument("--hidden", type=cmd.positive, metavar="N", help="expert hidden size")
    shrink.add_argument("--d-model", type=cmd.positive, metavar="N", help="model width")
    shrink.add_argument("--top-k", type=cmd.positive, metavar="K", help="experts per token")


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, opt) for opt, key in SHRINK.items() if getattr(args, opt)}


def result_name(args: argparse.Namespace) -> str:
    preset = args.preset or ("seed-moe" if args.device.type == "cuda" else "tiny")
    shrunk = [f"{opt.replace('_', '-')}={v}" for opt in SHRINK if (v := getattr(args, opt))]
    return slug("matrix", preset, args.tokens, shrunk, args.impls)


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    return run(
        device=args.device,
        preset=args.preset,
        tokens=args.tokens,
        impls=args.impls,
        dtype=cmd.dtype_of(args.dtype, args.device),
        warmup=args.warmup,
        iters=args.iters,
        seed=args.seed,
        progress=not args.no_progress,
        compile=not args.no_compile,
        layer_overrides=_overrides(args),
    )


COMMAND = cmd.Command(
    name="matrix",
    help="every MoELayer impl on one layer: speed, determinism, drift",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=result_name,
)
