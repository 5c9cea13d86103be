"""``moe-bench train``: every ``moe_model.MoELayer`` implementation as a training layer.

Per implementation, on one set of weights and inputs (each measurement on its own copy of the
layer, so every implementation starts from the same parameters):

* the time of one training step: ``zero_grad``, forward, backward with a fixed upstream gradient
  ``dy`` (the layer's output gradient, also the gradient of x is computed) and one
  ``torch.optim.AdamW`` step; eager (``eager_ms``), with the layer compiled by
  ``torch.compile(fullgraph=True)`` (``compiled_ms``: the backward runs AOTAutograd's compiled
  graph, the optimizer stays eager) and, on CUDA, the eager step (AdamW ``capturable=True``)
  captured whole in one CUDA graph with static inputs and replayed (``graph_ms``). Medians of
  :func:`moe_tools.timing.time_fn` after a warm-up.
* the peak memory of one eager (and one compiled) step: ``max_memory_allocated`` during the step
  minus what was allocated before it (weights, optimizer state and inputs excluded; gradients,
  activations and temporaries included). ``None`` on CPU.
* the gradient error against the fp32 ``baseline`` (the layer copied, ``impl="baseline"``,
  ``.float()``, fed the same x and dy in fp32): relative error ``max |g - g_ref| / max |g_ref|``
  of the gradients of x, ``router.weight``, ``in_proj`` and ``out_proj`` (and ``y_err``, the
  same measure on the forward output).
* bitwise repeatability: two identical forward + backward passes, all gradients ``torch.equal``.
* a convergence run: a student layer (the benchmark's weights) fitting a random teacher layer (the
  same configuration, another seed, impl ``"torch"``) by MSE on fresh random inputs, ``steps``
  AdamW steps; the same inputs, targets and starting weights for every implementation. The curves
  are ``extra["loss_curves"][impl]``; :mod:`moe_tools.train.report` plots and renders them.

An implementation whose forward or backward raises gets a row saying so (``status``), the others
are still measured.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moe_tools import command as cmd
from moe_tools import tables
from moe_tools.matrix import BASELINE_COMPILE_REASON
from moe_tools.results import Result
from moe_tools.tables import Row, short_error
from moe_tools.timing import default_device
from moe_tools.train import report as train_report
from moe_tools.train import roofline as train_roofline
from moe_tools.train import step as train_step
from moe_tools.train.step import REFERENCE, build_layer, check_training_fits, copy_layer

TEACHER_IMPL = "torch"  # the convergence run's teacher: deterministic on every device

# Layer shapes: tokens per step and MoELayer's sizes.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(tokens=64, d_model=64, n_experts=8, top_k=2, hidden=32),
    "seed-moe": dict(tokens=2048, d_model=2048, n_experts=16, top_k=8, hidden=1024),
    "training": dict(tokens=16384, d_model=2048, n_experts=128, top_k=8, hidden=768),
}
SIZE_KEYS = ("tokens", "d_model", "n_experts", "top_k", "hidden")
GRADS = ("x", "router.weight", "in_proj", "out_proj")  # the gradients compared and checked
ERR_COLUMNS = {
    "x": "grad_x_err",
    "router.weight": "grad_router_err",
    "in_proj": "grad_in_proj_err",
    "out_proj": "grad_out_proj_err",
}
ERROR_MEASURE = "max |g - g_ref| / max |g_ref|"

COLUMNS = [
    "impl",
    "eager_ms",
    "compiled_ms",
    "graph_ms",
    "speedup",
    "peak_mem_gib",
    "compiled_peak_mem_gib",
    "y_err",
    *ERR_COLUMNS.values(),
    "bitwise",
    "loss_first",
    "loss_last",
    "compile_s",
    *train_roofline.COLUMNS,
    "status",
    "compile_status",
    "graph_status",
]

CPU_GRAPH_STATUS = "skipped: CUDA graphs need a CUDA device"


def layer_config(
    preset: str,
    *,
    gated: bool = False,
    renormalize: bool = False,
    **sizes: int | None,
) -> dict[str, Any]:
    """The preset's tokens and layer sizes with ``sizes`` overrides (None = the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown train preset {preset!r}; presets: {', '.join(PRESETS)}")
    unknown = set(sizes) - set(SIZE_KEYS)
    if unknown:
        raise TypeError(f"unknown sizes {sorted(unknown)}")
    cfg: dict[str, Any] = dict(PRESETS[preset])
    cfg.update({k: v for k, v in sizes.items() if v is not None})
    cfg.update(gated=gated, renormalize=renormalize)
    return cfg


def default_lr(d_model: int) -> float:
    """AdamW's default learning rate: ``0.08 / sqrt(d_model)``, a step of ~1/3 of the weights'
    init std (``1 / sqrt(d_model)``) at most per element: 0.01 at d_model 64, 1.8e-3 at 2048."""
    return 0.08 / d_model**0.5


def rel_err(value: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """``max |value - ref| / max |ref|`` in fp32 (the max abs difference if ref is all zero);
    inf for a missing gradient, a shape mismatch or non-finite values; None without a ref."""
    if ref is None:
        return None
    if value is None or value.shape != ref.shape:
        return float("inf")
    d = (value.float() - ref.float()).abs()
    if not bool(torch.isfinite(d).all()):
        return float("inf")
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    diff = float(d.max()) if d.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _forward(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x leaf): one forward of a fresh leaf copy of x that requires grad."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    return layer(x), x


def _backward(
    layer: torch.nn.Module, y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """Backward of ``y`` with upstream ``dy``: the output and every gradient of :data:`GRADS`."""
    y.backward(dy)
    params = dict(layer.named_parameters())
    out: dict[str, torch.Tensor | None] = {"y": y.detach(), "x": x.grad}
    for name in GRADS[1:]:
        g = params[name].grad
        out[name] = None if g is None else g.detach().clone()
    return out


def reference_grads(
    base: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """The fp32 baseline's output and gradients on ``base``'s weights, x and dy in fp32."""
    ref = copy_layer(base, REFERENCE).float()
    y, xr = _forward(ref, x.float())
    return _backward(ref, y, xr, dy.float())


def convergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    impl: str,
    *,
    steps: int,
    tokens: int,
    lr: float,
    seed: int,
) -> list[float]:
    """MSE loss (fp32) of each of ``steps`` AdamW steps of a copy of ``student`` (impl ``impl``)
    fitting ``teacher`` on fresh random inputs (the same sequence for every call)."""
    layer = copy_layer(student, impl)
    p = next(iter(layer.parameters()))
    device, dtype = p.device, layer.in_proj.dtype
    opt = torch.optim.AdamW(layer.parameters(), lr=lr)
    gen = torch.Generator(device=device).manual_seed(cmd.derived_seed(seed))  # --seed + 2
    losses = []
    for _ in range(steps):
        x = torch.randn(tokens, layer.d_model, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            target = teacher(x).float()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(layer(x).float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).cpu()] if losses else []


def _empty_row(impl: str, status: str) -> Row:
    row: Row = {c: None for c in COLUMNS}
    row.update(impl=impl, status=status)
    return row


def run(
    *,
    device: torch.device | str | None = None,
    preset: str | None = None,
    tokens: int | None = None,
    d_model: int | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
    hidden: int | None = None,
    gated: bool = False,
    renormalize: bool = False,
    impls: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    warmup: int | None = None,
    iters: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    progress: bool = True,
    compile: bool = True,
    compile_backend: str | None = None,
    graph: bool = True,
    roofline: bool | None = None,
    plot: str | None = None,
) -> Result:
    """Measure every implementation; one row each, in ``impls`` order (default: ``MOE_IMPLS``).

    Defaults: CUDA runs the seed-moe shape in bf16, 50 convergence steps, Inductor; CPU the tiny
    shape in fp32, 20 steps, ``aot_eager`` (Dynamo's fullgraph capture and AOTAutograd's joint
    forward/backward graph without Inductor's C++ compilation, which takes ~20 s per impl on a
    small CPU). ``lr`` (AdamW, timing and convergence): :func:`default_lr` of d_model.
    ``graph=False`` skips the CUDA-graph column; ``plot`` is only recorded in ``extra`` (the CLI
    draws it) so that ``moe-bench report`` can link the figure. ``roofline`` (default: on CUDA)
    adds each impl's forward + backward per mode beside the six grouped GEMMs timed in the same
    run (:mod:`moe_tools.train.roofline`).
    """
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    preset = preset or ("seed-moe" if cuda else "tiny")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    warmup = warmup or (3 if cuda else 2)
    iters = iters or (10 if cuda else 5)
    steps = steps if steps is not None else (50 if cuda else 20)
    backend = compile_backend or ("inductor" if cuda else "aot_eager")
    cfg = layer_config(
        preset,
        gated=gated,
        renormalize=renormalize,
        tokens=tokens,
        d_model=d_model,
        n_experts=n_experts,
        top_k=top_k,
        hidden=hidden,
    )
    lr = lr if lr is not None else default_lr(cfg["d_model"])
    extra: dict[str, Any] = {
        "preset": preset,
        "tokens": cfg["tokens"],
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": warmup,
        "iters": iters,
        "steps": steps,
        "lr": lr,
        "compile_backend": backend if compile else None,
        "reference": f"{REFERENCE} (fp32)",
        "error_measure": ERROR_MEASURE,
        "layer": {k: v for k, v in cfg.items() if k != "tokens"},
    }
    if plot:
        extra["plot"] = str(plot)
    try:
        from moe_model import MOE_IMPLS
    except Exception as exc:  # moe_model missing or broken: one row says so
        reason = f"unavailable: moe_model: {short_error(exc)}"
        return Result("train", [_empty_row(i, reason) for i in (impls or [REFERENCE])], COLUMNS)
    impls = list(impls or MOE_IMPLS)

    check_training_fits(cfg, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    T, D = cfg["tokens"], cfg["d_model"]
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    base = build_layer(cfg, device, dtype, seed)
    teacher = build_layer(cfg, device, dtype, seed + 1, impl=TEACHER_IMPL).requires_grad_(False)

    roof: dict[str, Any] | None = None
    if roofline if roofline is not None else cuda:
        roof = train_roofline.setup(cfg, base, x, device, dtype, warmup, iters, compile, graph)
        extra["roofline"] = {k: v for k, v in roof.items() if k != "modes"}

    ref: dict[str, torch.Tensor | None] | None = None
    try:
        ref = reference_grads(base, x, dy)
    except Exception as exc:  # the reference itself failed: the error columns stay empty
        extra["reference_error"] = short_error(exc)
    _free(device)

    rows: list[Row] = []
    curves: dict[str, list[float]] = {}
    for impl in tables.progress(impls, enabled=progress, desc="train", unit="impl"):
        row, curve = _measure(
            base,
            teacher,
            impl,
            x,
            dy,
            ref,
            device,
            warmup=warmup,
            iters=iters,
            steps=steps,
            lr=lr,
            seed=seed,
            backend=backend if compile else None,
            graph=graph,
        )
        if roof is not None and impl != REFERENCE:
            row.update(train_roofline.measure(
                base, impl, x, dy, modes=roof["modes"], backend=backend, warmup=warmup,
                iters=iters, flops=roof["expert_flops"], gemms_ms=roof["six_gemms_ms"],
            ))  # fmt: skip
        rows.append(row)
        if curve:
            curves[impl] = curve
        _free(device)
    extra["loss_curves"] = curves
    extra["notes"] = train_report.notes(extra, curves, ERROR_MEASURE, TEACHER_IMPL)
    return Result("train", rows, COLUMNS, extra, text=train_report.format_rows(rows, COLUMNS))


def _measure(
    base: torch.nn.Module,
    teacher: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    ref: dict[str, torch.Tensor | None] | None,
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    steps: int,
    lr: float,
    seed: int,
    backend: str | None,
    graph: bool,
) -> tuple[Row, list[float]]:
    row = _empty_row(impl, "ok")
    try:
        layer = copy_layer(base, impl)
        y, xs = _forward(layer, x)
    except Exception as exc:
        row["status"] = f"unavailable: {short_error(exc)}"
        return row, []
    try:
        first = _backward(layer, y, xs, dy)
    except Exception as exc:
        row["status"] = f"no backward: {short_error(exc, limit=160)}"
        return row, []
    try:
        y2, xs2 = _forward(layer, x)
        second = _backward(layer, y2, xs2, dy)
        row["bitwise"] = all(
            a is not None and b is not None and torch.equal(a, b)
            for a, b in ((first[k], second[k]) for k in ("y", *GRADS))
        )
    except Exception as exc:  # worked once, not twice
        row["status"] = f"FAIL: second pass: {short_error(exc)}"
        return row, []
    if ref is not None:
        row["y_err"] = rel_err(first["y"], ref["y"])
        for name, col in ERR_COLUMNS.items():
            row[col] = rel_err(first[name], ref[name])
    del layer, y, xs, y2, xs2, first, second

    failures = []
    try:
        row["eager_ms"], row["peak_mem_gib"] = train_step.time_eager(
            base, impl, x, dy, device, warmup, iters, lr
        )
    except Exception as exc:
        failures.append(f"eager step: {short_error(exc, limit=80)}")
    _free(device)

    if backend is None:
        row["compile_status"] = "skipped: --no-compile"
    else:
        try:
            row["compiled_ms"], row["compiled_peak_mem_gib"], row["compile_s"] = (
                train_step.time_compiled(base, impl, x, dy, device, warmup, iters, lr, backend)
            )
            row["compile_status"] = "ok"
        except Exception as exc:
            reason = short_error(exc, limit=80)
            if impl == REFERENCE:
                row["compile_status"] = f"expected: {BASELINE_COMPILE_REASON} ({reason})"
            else:
                row["compile_status"] = f"compile failed: {reason}"
        _free(device)
    if row["eager_ms"] and row["compiled_ms"]:
        row["speedup"] = row["eager_ms"] / row["compiled_ms"]

    if device.type != "cuda":
        row["graph_status"] = CPU_GRAPH_STATUS
    elif not graph:
        row["graph_status"] = "skipped: --no-graph"
    elif impl == REFERENCE:
        row["graph_status"] = f"expected: {BASELINE_COMPILE_REASON} (no capture)"
    else:
        try:
            row["graph_ms"] = train_step.time_graph(base, impl, x, dy, device, warmup, iters, lr)
            row["graph_status"] = "ok"
        except Exception as exc:
            row["graph_status"] = f"capture failed: {short_error(exc, limit=80)}"
        _free(device)

    curve: list[float] = []
    if steps:
        try:
            curve = convergence(
                base, teacher, impl, steps=steps, tokens=x.shape[0], lr=lr, seed=seed + 2
            )
            row["loss_first"], row["loss_last"] = curve[0], curve[-1]
        except Exception as exc:
            failures.append(f"convergence: {short_error(exc, limit=80)}")
    if failures:
        row["status"] = "FAIL: " + "; ".join(failures)
    return row, curve
