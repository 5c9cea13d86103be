"""One training step of an MoE layer (``moe-bench train``): zero_grad, forward, backward with a
fixed upstream gradient, one AdamW step; timed eager, compiled and captured in a CUDA graph, with
its peak memory."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from moe_tools.timing import GIB, synchronize, time_fn


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


def peak_step_gib(
    step: Callable[[], None], opt: torch.optim.Optimizer, x: torch.Tensor, device: torch.device
) -> float | None:
    """Peak allocated GiB of one step above what was allocated before it (None on CPU)."""
    if device.type != "cuda":
        return None
    opt.zero_grad(set_to_none=True)
    x.grad = None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / GIB


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
    return ms, peak_step_gib(step, opt, xs, device)


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
        return ms, peak_step_gib(step, opt, xs, device), compile_s
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
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 2)):  # builds the optimizer state outside the graph
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    opt.zero_grad(set_to_none=True)  # the gradients are allocated in the graph's pool
    xs.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(xs).backward(dy)
        opt.step()
    return time_fn(graph.replay, device, warmup=1, iters=iters).median_ms
