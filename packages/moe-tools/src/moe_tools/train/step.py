"""The training layer of ``moe-bench train`` (built, sized against the device's memory, copied
per impl) and one training step of it: zero_grad, forward, backward with a fixed upstream
gradient, one AdamW step; timed eager, compiled and captured in a CUDA graph, with its peak
memory."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from moe_tools.memory import check_fits, check_top_k, meta_bytes
from moe_tools.timing import GIB, synchronize, time_fn

REFERENCE = "baseline"  # the gradient reference (run in fp32) and the layer built by default


def build_layer(
    cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int, impl: str = REFERENCE
) -> torch.nn.Module:
    """A trainable ``MoELayer`` of ``cfg`` (see ``measure.layer_config``): ``matrix.build_layer``'s
    seeded layer (expert weights in ``dtype``, the router in fp32), in train mode, every parameter
    requiring grad."""
    from moe_tools.matrix import build_layer as build_eval_layer

    sizes = {"score_fn": "softmax", **{k: v for k, v in cfg.items() if k != "tokens"}}
    return build_eval_layer(sizes, device, dtype, seed, impl).train().requires_grad_(True)


def check_training_fits(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
    """UsageError with the run's size when it would not fit in ``device``'s free memory: about
    six copies of the layer's weights (the benchmark's, the teacher, the fp32 reference, the
    measured copy, its gradients and AdamW's two states) and the fp32 activations of a step."""
    hint = "Shrink it: --tokens, --experts, --hidden, --d-model."
    check_top_k(cfg)
    weights = meta_bytes(
        lambda: build_layer(cfg, torch.device("meta"), dtype, seed=0),
        f"the layer (E={cfg['n_experts']}, d_model {cfg['d_model']}, hidden {cfg['hidden']})",
        hint,
    )
    T, k, d = cfg["tokens"], cfg["top_k"], cfg["d_model"]
    hidden = cfg["hidden"] * (3 if cfg.get("gated") else 2)
    activations = 3 * 4 * (T * k * (2 * d + hidden) + 6 * T * d)
    check_fits(
        f"training the layer (T={T}, E={cfg['n_experts']}, d_model {d}, hidden {cfg['hidden']})",
        6 * weights + activations,
        torch.device(device),
        f"6 x {weights / GIB:.2f} GiB of weights and optimizer state, about "
        f"{activations / GIB:.1f} GiB of activations",
        hint,
    )


def copy_layer(base: torch.nn.Module, impl: str) -> torch.nn.Module:
    """A deep copy of ``base`` switched to ``impl`` (every measurement starts from the same
    weights)."""
    layer = copy.deepcopy(base)
    layer.impl = impl
    return layer


def make_step(
    fn: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    dy: torch.Tensor,
) -> Callable[[], None]:
    """One training step on static tensors: zero_grad, fn(x).backward(dy), AdamW step."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        x.grad = None
        fn(x).backward(dy)
        opt.step()

    return step


def peak_gib(
    run: Callable[[], None], clear: Callable[[], None], device: torch.device
) -> float | None:
    """Peak allocated GiB of one ``run()`` above what was allocated before it, after ``clear()``
    (dropping the gradients of the runs before); None on CPU."""
    if device.type != "cuda":
        return None
    clear()
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / GIB


def captured(
    step: Callable[[], None],
    clear: Callable[[], None],
    body: Callable[[], None],
    device: torch.device,
    warmup: int,
) -> torch.cuda.CUDAGraph:
    """``body`` captured in one CUDA graph after ``warmup`` (at least 2) runs of ``step`` on a side
    stream (building any state outside the graph) and ``clear()`` (the gradients are then
    allocated in the graph's pool)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 2)):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def _clear_grads(opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    def clear() -> None:
        opt.zero_grad(set_to_none=True)
        x.grad = None

    return clear


def time_eager(
    base: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    device: torch.device,
    warmup: int,
    iters: int,
    lr: float,
) -> tuple[float, float | None]:
    layer = copy_layer(base, impl)
    xs = x.detach().clone().requires_grad_(True)
    opt = torch.optim.AdamW(layer.parameters(), lr=lr)
    step = make_step(layer, opt, xs, dy)
    ms = time_fn(step, device, warmup=warmup, iters=iters).median_ms
    return ms, peak_gib(step, _clear_grads(opt, xs), device)


def time_compiled(
    base: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    device: torch.device,
    warmup: int,
    iters: int,
    lr: float,
    backend: str,
) -> tuple[float, float | None, float]:
    """(median ms, peak GiB, compile seconds: the first step, which compiles fwd and bwd)."""
    torch._dynamo.reset()
    try:
        layer = copy_layer(base, impl)
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        xs = x.detach().clone().requires_grad_(True)
        opt = torch.optim.AdamW(layer.parameters(), lr=lr)
        step = make_step(compiled, opt, xs, dy)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        compile_s = time.perf_counter() - t0
        ms = time_fn(step, device, warmup=warmup, iters=iters).median_ms
        return ms, peak_gib(step, _clear_grads(opt, xs), device), compile_s
    finally:
        torch._dynamo.reset()


def time_graph(
    base: torch.nn.Module,
    impl: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    device: torch.device,
    warmup: int,
    iters: int,
    lr: float,
) -> float:
    """The eager step (forward, backward, AdamW with ``capturable=True``) captured in one CUDA
    graph on static x / dy, warmed up on a side stream first; median ms of the replays."""
    layer = copy_layer(base, impl)
    xs = x.detach().clone().requires_grad_(True)
    opt = torch.optim.AdamW(layer.parameters(), lr=lr, capturable=True)
    step = make_step(layer, opt, xs, dy)

    def body() -> None:
        layer(xs).backward(dy)
        opt.step()

    graph = captured(step, _clear_grads(opt, xs), body, device, warmup)
    return time_fn(graph.replay, device, warmup=1, iters=iters).median_ms
