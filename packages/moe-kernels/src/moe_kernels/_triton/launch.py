"""Low-overhead launches of JIT kernels on the GPU.

``kernel[grid](*args, **constexprs)`` costs 15-40 us of host time per call on the H200's host
(argument binding, specialisation, cache key, launch metadata, then the C launcher), as much as a
small routing problem's GPU time. ``FastKernel`` does the first launch of every specialisation
through Triton (which compiles and caches it) and later ones straight through the compiled
kernel's launcher (on Triton 3.5 and 3.6, its C launch function: ``launcher``).

The specialisation key mirrors Triton's: per tensor its dtype and whether its address is 16-byte
aligned; per int whether it is 1, whether it is a multiple of 16 and whether it needs 64 bits;
every constexpr and launch option by value. So a cached handle is only reused where Triton would
have picked the same compiled kernel. Under the interpreter, with a launch hook installed (a
non-empty ``HookChain`` on Triton >= 3.5, whose empty chains are not None), or on any Triton
without the compiled-kernel attributes used here, every call takes the plain path. Host-built
TMA descriptors (``TensorDescriptor``, a new object per call) are keyed as Triton specialises
them: the base's dtype and the block shape (and the padding mode); the compiled kernel's
launcher turns each into its ``CUtensorMap`` at every launch, as it does on Triton's own path.
Other arguments without a stable key never hit the cache.

While a dispatch mode traces (``torch.compile``'s AOT trace of an op registered by
``_dispatch.register_op``, make_fx), every launch goes through ``torch.library.wrap_triton``
instead, which records it in the graph for Inductor to emit (``launch``); only ``num_warps`` and
``num_stages`` are launch options there.

A caller that can key a whole group of launches itself (the routing launcher: one key per call
signature: sizes, strides, dtype, pointer alignments) keeps the ``Handle`` that ``launch``
returns and relaunches it with ``run``, or a whole sequence of them with new base addresses
through ``BoundLaunches``, skipping the per-argument key as well.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import triton
from torch.library import wrap_triton
from triton.runtime import driver

from .._dispatch import INTERPRET, tracing

try:
    from triton import knobs as _knobs

    _HOOKS = _knobs.runtime
except Exception:  # pragma: no cover - older triton: no knobs, no fast path
    _HOOKS = None

_TRITON_VERSION: str = getattr(triton, "__version__", "")

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _Descriptor
except ImportError:  # pragma: no cover - older triton
    _Descriptor = None


def _hooked(hook: object) -> bool:
    """Whether a launch hook is installed in a slot. Triton >= 3.5 keeps each slot as a
    ``HookChain`` that is never None (empty: ``.calls == []``); older versions use None."""
    return hook is not None and bool(getattr(hook, "calls", True))


_NO_KEY = object()  # an argument the cache cannot key (e.g. a TMA descriptor): plain path


def _arg_key(a: object) -> object:
    ptr = getattr(a, "data_ptr", None)
    if ptr is not None:
        return (a.dtype, ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, not -(2**31) <= a < 2**31)
    if isinstance(a, float):
        return float
    if _Descriptor is not None and type(a) is _Descriptor:  # Triton: "tensordesc<bf16[64, 128]>"
        return (_Descriptor, a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None))
    return _NO_KEY


class Handle(NamedTuple):
    """A compiled kernel, the constexpr values that follow the runtime arguments, and how to
    launch it: ``go(grid0, grid1, grid2, stream, *pre, *args, *tail)`` (``launcher``)."""

    kernel: Any
    tail: tuple
    go: Callable[..., None]
    pre: tuple


# Triton versions whose CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function,
# *args) does nothing but pass (function, cooperative, pdl, global scratch, profile scratch,
# *args) to its C launch function, scratch None where the kernel needs none (read in 3.5.1's
# and 3.6.0's sources). Elsewhere the launcher itself is called.
_DIRECT_VERSIONS = ("3.5.", "3.6.")


def launcher(k: Any) -> tuple[Callable[..., None], tuple]:
    """(go, pre) for compiled kernel ``k``: ``go(grid0, grid1, grid2, stream, *pre, *args)``
    launches it with its runtime arguments and constexprs ``args``. Where this Triton's launcher
    is known to hand its arguments straight to its C launch function and ``k`` needs no scratch,
    that function (skipping the launcher's Python frame saved 0.8-1.2 us of host time a launch
    on the H200's host, interleaved A/B); else the launcher, with no launch metadata or
    hooks."""
    run = k.run
    meta = (k.packed_metadata, None, None, None)  # metadata, launch metadata, enter/exit hooks
    direct = getattr(run, "launch", None)
    if (
        _TRITON_VERSION.startswith(_DIRECT_VERSIONS)
        and type(run).__name__ == "CudaLauncher"
        and callable(direct)
        and _plain_call(type(run).__call__)
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
    ):
        flags = (bool(run.launch_cooperative_grid), bool(run.launch_pdl))
        return direct, (k.function, *flags, None, None, *meta)
    return run, (k.function, *meta)


def _plain_call(call: Any) -> bool:
    """Whether ``call``'s parameters are (self, gridX, gridY, gridZ, stream, function, *args)."""
    try:
        params = list(inspect.signature(call).parameters.values())
    except (TypeError, ValueError):
        return False
    names = [p.name for p in params]
    return (
        names == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
        and params[-1].kind is inspect.Parameter.VAR_POSITIONAL
    )


class FastKernel:
    """Wraps a ``@triton.jit`` function; ``launch(grid, args, constexprs, **options)``.

    ``args`` are the runtime arguments in signature order, ``constexprs`` a dict of the
    compile-time ones, which follow them in the signature (the way every kernel here is
    written)."""

    enabled = not INTERPRET and _HOOKS is not None

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.handles: dict[tuple, Handle] = {}

    def __getattr__(self, name: str) -> Any:  # ``.fn`` attributes, for introspection
        return getattr(self.fn, name)

    def launch(
        self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options: Any
    ) -> Handle | None:
        """Launch; returns the compiled handle that ran (None where the plain path ran and no
        handle could be cached), which ``run`` can launch again with new arguments."""
        if not fast_path_open() or tracing():
            launch(self.fn, grid, args, constexprs, **options)
            return None
        arg_keys = tuple(map(_arg_key, args))
        if _NO_KEY in arg_keys:
            self.fn[grid](*args, **constexprs, **options)
            return None
        dev = args[0].get_device()
        key = (
            dev,
            arg_keys,
            tuple(constexprs.items()),
            tuple(options.items()),
        )
        h = self.handles.get(key)
        if h is None:
            k = self.fn[grid](*args, **constexprs, **options)
            if all(hasattr(k, a) for a in ("run", "function", "packed_metadata")):
                tail = tuple(constexprs[n] for n in self.fn.arg_names[len(args) :])
                h = self.handles[key] = Handle(k, tail, *launcher(k))
            return h
        run(h, grid, dev, args)
        return h


TRACED_OPTIONS = ("num_warps", "num_stages")  # the launch options wrap_triton records


def launch(fn: Any, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any],
           **options: Any) -> None:  # fmt: skip
    """``fn[grid](*args, **constexprs, **options)``, through ``wrap_triton`` while tracing
    (``TRACED_OPTIONS`` only: a launcher must not ask for others there)."""
    if tracing():
        extra = set(options) - set(TRACED_OPTIONS)
        if extra:
            raise AssertionError(f"launch options {sorted(extra)} cannot be traced")
        wrap_triton(fn)[grid](*args, **constexprs, **options)
    else:
        fn[grid](*args, **constexprs, **options)


def aligned(t: Any, n: int) -> bool:
    """Whether tensor ``t``'s address is a multiple of ``n`` bytes. While tracing there is no
    address: its offset into storage decides (allocations are 16-byte aligned, which Inductor
    also assumes of its inputs)."""
    if tracing():
        return t.storage_offset() * t.element_size() % n == 0
    return t.data_ptr() % n == 0


def fast_path_open() -> bool:
    """Whether compiled handles may be launched directly: the GPU (no interpreter), a Triton
    with launch hooks we can see, and none installed now."""
    if not FastKernel.enabled:
        return False
    return not (_hooked(_HOOKS.launch_enter_hook) or _hooked(_HOOKS.launch_exit_hook))


def current_stream(dev: int) -> int:
    """The raw handle of device ``dev``'s current stream."""
    return driver.active.get_current_stream(dev)


def run(h: Handle, grid: tuple[int, ...], dev: int, args: tuple) -> None:
    """Launch handle ``h`` on device ``dev``'s current stream. ``args`` must give Triton the same
    specialisation as the launch that returned ``h`` (dtypes, 16-byte alignment of every pointer,
    the properties of every int: the caller's key has to pin them); pointers may be passed as
    int addresses, which Triton's launcher accepts like tensors."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = driver.active.get_current_stream(dev)
    h.go(grid[0], g1, g2, stream, *h.pre, *args, *h.tail)


def fast(fn: Any) -> FastKernel:
    """Decorator form: ``@fast`` above ``@triton.jit``."""
    return FastKernel(fn)


class Rel(NamedTuple):
    """A pointer argument of a bound launch: ``offset`` bytes into one of the call's bases
    (``BoundLaunches.__call__``'s ``bases``, by index)."""

    base: int
    offset: int


class BoundLaunches:
    """A fixed sequence of compiled kernels, relaunched with new base addresses.

    ``launches``: (handle, 1-D grid, runtime arguments) per kernel, the arguments holding a
    ``Rel`` where a pointer goes and plain values elsewhere. A call passes the bases (ints) and
    the stream; each kernel then gets its fixed arguments with the ``Rel`` slots filled in, then
    its handle's constexprs, through the handle's ``launcher``. Where a kernel's
    pointers all come first, they are computed in one pass and the rest is passed as is. The
    caller's key must pin everything Triton specialised the handles on (see ``run``)."""

    __slots__ = ("_launches",)

    def __init__(self, launches: list[tuple[Handle, int, tuple]]) -> None:
        bound = []
        for h, g0, args in launches:
            rel = tuple((i, a.base, a.offset) for i, a in enumerate(args) if isinstance(a, Rel))
            n = len(rel)
            if all(i < n for i, _, _ in rel):  # pointers first: (base, offset) pairs, then values
                head = tuple((b, off) for _, b, off in rel)
                bound.append((h.go, g0, h.pre, head, (*args[n:], *h.tail), None))
            else:
                fixed = [0 if isinstance(a, Rel) else a for a in args] + list(h.tail)
                bound.append((h.go, g0, h.pre, None, fixed, rel))
        self._launches = tuple(bound)

    def __call__(self, bases: tuple[int, ...], stream: int) -> None:
        for go, g0, pre, head, fixed, rel in self._launches:
            if head is not None:
                go(g0, 1, 1, stream, *pre, *[bases[b] + off for b, off in head], *fixed)
                continue
            args = fixed.copy()
            for i, b, off in rel:
                args[i] = bases[b] + off
            go(g0, 1, 1, stream, *pre, *args)
