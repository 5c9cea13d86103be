"""Helpers for checks on a CUDA device: the GPU tests (``pytest -m gpu``) and the timing scripts in
``benchmarks/gpu/`` share them.

* :func:`forbid_host_sync`: inside, an op that synchronises with the host raises;
* :func:`poison`: fill the caching allocator so that fresh outputs start as garbage, not zeros;
* :func:`bits_equal`: bitwise equality with NaN equal to NaN, over nested tuples of tensors
  (``same_bits`` is the stricter form: same dtype, device and bytes, NaN payloads included);
* :func:`capture` and :func:`replay_mismatches`: a call captured in a CUDA graph, and the graph
  replayed after its inputs change in place, against eager calls on the new values;
* :func:`compile_fresh`, :func:`inductor_code`, :func:`launched_by_inductor`: ``torch.compile``
  from a reset Dynamo, the code Inductor writes for a call, and whether that code launches our
  kernels itself (no opaque ``torch.ops.moe_kernels`` call left);
* :func:`full_run`: whether the large GPU cases run (``MOE_GPU_FULL=1``);
* :func:`gpu_test_device`: the device the GPU tests run on: CUDA, or with ``MOE_GPU_SMOKE=1``
  and no GPU the CPU (the reference path, or the interpreter under ``TRITON_INTERPRET=1``, whose
  truncating fp32 -> bf16 casts put some bf16 outputs an ulp off the bitwise checks): a check of
  the tests' own code at reduced sizes, not of the kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator

import torch

from moe_kernels.testing.cold import same_bits, tensors_of

__all__ = [
    "bits_equal",
    "capture",
    "cloned",
    "compile_fresh",
    "forbid_host_sync",
    "full_run",
    "gpu_test_device",
    "inductor_code",
    "launched_by_inductor",
    "poison",
    "replay_mismatches",
]

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def full_run() -> bool:
    """Whether ``MOE_GPU_FULL`` is set (not "" or "0"): the GPU tests' large cases (whole grids,
    shapes of a GiB) run only then."""
    return os.environ.get("MOE_GPU_FULL", "") not in ("", "0")


def gpu_test_device() -> torch.device | None:
    """``cuda`` where a CUDA device is; else ``cpu`` where ``MOE_GPU_SMOKE`` is set (not "" or
    "0"); else None (the GPU tests skip)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("MOE_GPU_SMOKE", "") not in ("", "0"):
        return torch.device("cpu")
    return None


@contextlib.contextmanager
def forbid_host_sync(active: bool = True) -> Iterator[None]:
    """Inside: ``torch.cuda.set_sync_debug_mode("error")`` (an op that syncs with the host
    raises); the default mode again on the way out. ``active=False`` (CPU dry runs): nothing."""
    if not active:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def poison(nbytes: int, *, byte: int = 0xFF, device: torch.device | str = "cuda",
           blocks: int = 3) -> None:  # fmt: skip
    """Leave ``blocks`` freed blocks of ``nbytes`` (+ 4 KiB) filled with ``byte`` in the caching
    allocator, so the outputs allocated next start as garbage, not zeros. 0xFF is NaN in every
    float dtype (fp32, bf16, fp16, e4m3) and -1 in the integer ones; take another byte (0x7F,
    0x5A) where -1 or NaN is a value the op writes."""
    bufs = [
        torch.full((nbytes + 4096,), byte, dtype=torch.uint8, device=device) for _ in range(blocks)
    ]
    del bufs


def bits_equal(a, b) -> bool:
    """a and b hold the same bits, b brought to a's device. Floats of 2 bytes or more: NaN equals
    NaN (payloads and signs may differ), every other element bit for bit (-0.0 is not 0.0).
    1-byte types (e4m3 data, e8m0 scales, uint8) compare byte for byte, their dtypes may differ
    (a float8 output against a uint8 view of it); otherwise the dtypes must be equal. Tuples and
    lists (a RoutingPlan, a (data, scale) pair) compare element-wise; None equals None."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(bits_equal(x, y) for x, y in zip(a, b, strict=True)))  # fmt: skip
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    b = b.to(a.device)
    if a.element_size() == 1:
        return same_bits(a.view(torch.uint8), b.view(torch.uint8))
    if a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    ints = _INT_OF_SIZE[a.element_size()]
    return torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


def cloned(obj):
    """``obj`` with every tensor in it cloned (nested tuples / lists / NamedTuples kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cloned(o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(cloned(o) for o in obj)
    return obj


def capture(fn: Callable[[], object], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn called ``warmup`` times on a side stream (compiles, allocator), then captured in a CUDA
    graph: (the graph, what fn returned while captured, i.e. the graph's static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def replay_mismatches(fn: Callable[[], object], refills: Iterable[Callable[[], None]],
                      expected: Callable[[], object] | None = None,
                      warmup: int = 1) -> list[int]:  # fmt: skip
    """fn (which reads its inputs from tensors it closes over and returns fresh outputs) captured
    once; then per refill: the refill writes new values into those inputs in place, the graph is
    replayed, and its outputs compared (:func:`bits_equal`) with ``expected()`` on the new values
    (default: an eager call of fn). Returns the indices of the refills whose replay differs
    (empty: every replay right)."""
    graph, static = capture(fn, warmup)
    bad = []
    for i, refill in enumerate(refills):
        refill()
        graph.replay()
        got = cloned(static)
        want = (expected or fn)()
        if not bits_equal(tensors_of(got), tensors_of(want)):
            bad.append(i)
    torch.cuda.synchronize()
    return bad


def compile_fresh(fn: Callable, **options) -> Callable:
    """``torch.compile(fn, fullgraph=True, **options)`` after ``torch._dynamo.reset()``: nothing
    compiled before (another test's frames, a recompile limit reached) affects it."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, **options)


def inductor_code(fn: Callable, *args) -> tuple[object, str]:
    """(``fn(*args)``, the code Inductor wrote for it) for a compiled fn, one string."""
    from torch._inductor.utils import run_and_get_code

    out, codes = run_and_get_code(fn, *args)
    return out, "\n".join(codes)


def launched_by_inductor(code: str) -> bool:
    """Whether Inductor's code launches our kernels itself: no ``torch.ops.moe_kernels`` call (an
    opaque custom op) is left in it."""
    return "torch.ops.moe_kernels" not in code
