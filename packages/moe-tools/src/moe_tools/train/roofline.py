"""The GEMM roofline of a training layer (``moe-bench train``): the routed experts' six grouped
GEMMs alone, timed in the same run as the layer, and the layer's forward + backward against them.

Shapes: ``P = T * top_k`` routed rows, ``d`` = d_model, ``n`` = hidden, ``n_up`` = ``2n`` for
SwiGLU experts (gate and up in one projection) else ``n``. The six GEMMs, each
``torch._grouped_mm`` over the layer's own expert groups (its routing of the benchmark's x):

* forward: ``h_PN = x_PD @ w_up_EDN``, ``y_PD = a_Pn @ w_down_EnD``;
* data gradients: ``da_Pn = dy_PD @ w_down_EnD^T``, ``dx_PD = dh_PN @ w_up_EDN^T``;
* weight gradients: ``dw_down_EnD = a^T @ dy`` and ``dw_up_EDN = x^T @ dh`` per group.

``expert_flops`` counts those six (``6 * P * d * (n_up + n)``, 2 per multiply-add); the router,
activation, dispatch and combine add bytes, not GEMM FLOPs, so TFLOP/s here is that count over
the layer's time, as SonicMoE and the issue's table count it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_tools.tables import Row, short_error
from moe_tools.timing import GIB, time_fn
from moe_tools.train.step import captured, copy_layer, peak_gib

MODES = ("eager", "compiled", "graph")
# per impl: forward + backward ms per mode, the best of them, its TFLOP/s and ratio to the six
# GEMMs, the eager pass's peak memory and that per token
COLUMNS = [
    "fb_eager_ms",
    "fb_compiled_ms",
    "fb_graph_ms",
    "fb_best_ms",
    "tflops",
    "vs_gemms",
    "fb_peak_gib",
    "bytes_per_token",
    "roofline_status",
]


def expert_flops(cfg: dict[str, Any]) -> float:
    """FLOPs of the routed experts' forward + backward (the six GEMMs) for ``cfg``."""
    rows = cfg["tokens"] * cfg["top_k"]
    n = cfg["hidden"]
    n_up = 2 * n if cfg.get("gated") else n
    return 6.0 * rows * cfg["d_model"] * (n_up + n)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def group_counts(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(E,) int64: the rows the layer routes to each expert for ``x`` (one forward, no grad)."""
    with torch.no_grad():
        layer(x)
    return layer.last_counts.to(torch.int64).clone()


@dataclass(frozen=True)
class SixGemms:
    """The six grouped GEMMs' inputs over groups ending at ``offs`` (int32, cumulative); ``run``
    computes (h_PN, y_PD, da_Pn, dx_PD, dw_down_EnD, dw_up_EDN)."""

    offs: torch.Tensor
    x_PD: torch.Tensor
    a_Pn: torch.Tensor
    dy_PD: torch.Tensor
    dh_PN: torch.Tensor
    w_up: torch.Tensor  # (E, d, n_up), a view of (E, n_up, d) storage, as the layer stores it
    w_down: torch.Tensor  # (E, n, d), a view of (E, d, n) storage

    def run(self) -> tuple[torch.Tensor, ...]:
        mm, offs = torch._grouped_mm, self.offs
        return (
            mm(self.x_PD, self.w_up, offs=offs),
            mm(self.a_Pn, self.w_down, offs=offs),
            mm(self.dy_PD, self.w_down.transpose(-2, -1), offs=offs),
            mm(self.dh_PN, self.w_up.transpose(-2, -1), offs=offs),
            mm(self.a_Pn.t(), self.dy_PD, offs=offs),
            mm(self.x_PD.t(), self.dh_PN, offs=offs),
        )


def six_gemms(
    counts_E: torch.Tensor, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> SixGemms:
    """The six grouped GEMMs over groups of ``counts_E`` rows, on seeded inputs."""
    E, d, n = cfg["n_experts"], cfg["d_model"], cfg["hidden"]
    n_up = 2 * n if cfg.get("gated") else n
    P = int(counts_E.sum())
    offs = counts_E.cumsum(0).to(device=device, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    w_up, w_down = rand(E, n_up, d).transpose(-2, -1), rand(E, d, n).transpose(-2, -1)
    return SixGemms(offs, rand(P, d), rand(P, n), rand(P, d), rand(P, n_up), w_up, w_down)


def time_six_gemms(
    counts_E: torch.Tensor,
    cfg: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    iters: int,
) -> float:
    """Median ms of the six grouped GEMMs (bf16 on CUDA: ``torch._grouped_mm``'s dtype there)."""
    gemms = six_gemms(counts_E, cfg, device, dtype)
    return time_fn(gemms.run, device, warmup=warmup, iters=iters).median_ms


def time_fwd_bwd(
    base: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    mode: str,
    backend: str,
    warmup: int,
    iters: int,
) -> tuple[float, float | None]:
    """The layer's forward + backward of ``dy`` (no optimizer) as ``mode`` runs it: eager, the
    layer compiled (``fullgraph=True``), or the eager pass captured in one CUDA graph. (median
    ms, peak GiB of one pass above what was allocated before it: None on CPU and for graph
    replays, whose memory is the graph's pool)."""
    if mode != "eager":
        torch._dynamo.reset()
    try:
        layer = copy_layer(base, impl)
        xs = x.detach().clone().requires_grad_(True)
        fn = torch.compile(layer, fullgraph=True, backend=backend) if mode == "compiled" else layer

        def clear() -> None:
            layer.zero_grad(set_to_none=True)
            xs.grad = None

        def step() -> None:
            clear()
            fn(xs).backward(dy)

        if mode == "graph":
            graph = captured(step, clear, lambda: layer(xs).backward(dy), x.device, warmup)
            return time_fn(graph.replay, x.device, warmup=1, iters=iters).median_ms, None
        ms = time_fn(step, x.device, warmup=warmup, iters=iters).median_ms
        return ms, peak_gib(step, clear, x.device)
    finally:
        if mode != "eager":
            torch._dynamo.reset()


def setup(
    cfg: dict[str, Any],
    base: torch.nn.Module,
    x: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    iters: int,
    compile: bool,
    graph: bool,
) -> dict[str, Any]:
    """The modes to time, the experts' FLOPs and the six grouped GEMMs' median ms (None, with
    the reason, where ``torch._grouped_mm`` refuses the shape or dtype)."""
    modes = ("eager",) + (("compiled",) if compile else ())
    modes += ("graph",) if graph and device.type == "cuda" else ()
    out: dict[str, Any] = dict(modes=modes, expert_flops=expert_flops(cfg))
    out["six_gemms_ms"] = None
    try:
        counts = group_counts(base, x)
        out["six_gemms_ms"] = time_six_gemms(counts, cfg, device, dtype, warmup, iters)
        out["six_gemms_tflops"] = tflops(out["expert_flops"], out["six_gemms_ms"])
    except Exception as exc:
        out["six_gemms_error"] = short_error(exc)
    return out


def measure(
    base: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    *,
    modes: tuple[str, ...],
    backend: str,
    warmup: int,
    iters: int,
    flops: float,
    gemms_ms: float | None,
) -> Row:
    """One impl's roofline columns (``COLUMNS``); a mode that fails is named in the status."""
    row: Row = dict.fromkeys(COLUMNS)
    failed = []
    for mode in modes:
        try:
            ms, peak = time_fwd_bwd(base, impl, x, dy, mode, backend, warmup, iters)
        except Exception as exc:
            failed.append(f"{mode}: {short_error(exc, limit=60)}")
            continue
        row[f"fb_{mode}_ms"] = ms
        if mode == "eager":
            row["fb_peak_gib"] = peak
            if peak is not None:
                row["bytes_per_token"] = peak * GIB / x.shape[0]
    times = [row[f"fb_{m}_ms"] for m in MODES if row[f"fb_{m}_ms"]]
    if times:
        row["fb_best_ms"] = min(times)
        row["tflops"] = tflops(flops, row["fb_best_ms"])
        if gemms_ms:
            row["vs_gemms"] = row["fb_best_ms"] / gemms_ms
    row["roofline_status"] = "ok" if not failed else "FAIL: " + "; ".join(failed)
    return row
