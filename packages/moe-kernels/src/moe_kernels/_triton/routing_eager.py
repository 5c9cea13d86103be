"""The eager fast lane of the routing ops: a call's launches, bound once, relaunched per call.

Eager calls at small T are bound by the host: at T=4096 the kernels take 5-11 us, while on the
H200's host a Triton launch costs ~7 us, an allocation 2.5, a view 0.7 and the Python around
a call as much again. So the first one-buffer call of each kind (``routing_triton``) binds its
compiled handles with ``Rel`` address slots (``BoundLaunches``) under the call's key
(``eager_key``), and later calls with the same key take ``bound_call``: one allocation, the
launches on the new addresses, one split into the outputs.

The key holds everything the launch plan, Triton's specialisation and the public ops' argument
checks depend on: the scores' shape, strides, dtype, 16-byte alignment and device, top_k, the
expert range as passed, the valid count's shape, dtype, device and alignment, the flags, and
whether a CUDA graph is being captured (no fused launch then). So a public call whose key is
bound (``lane_key``) is one that passed those checks before and launches exactly what the full
path would: the public functions try it before anything else. The call takes the full path
wherever the lane does not apply: tensor subclasses, CPU tensors, compilation, dispatch modes,
functorch transforms (the caller checks those), autograd, launch hooks, argument types other
than plain ints and bools (``lane_key`` is None then).

The table holds at most ``_MAX_BOUND`` keys and starts over when full (one atomic ``clear``:
safe beside other threads, which at worst bind a key again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .launch import BoundLaunches, current_stream, fast_path_open


class Eager(NamedTuple):
    """A bound eager call: the one buffer's int32 size, its split into the outputs (then the
    rest), which split piece each of routing_triton's outputs is (-1: none), the launches, the
    barrier words' source where they need one (``grid_sync.barrier_words``), the device and
    the outputs' T and top_k."""

    n: int
    split: tuple[int, ...]
    pieces: tuple[int, ...]
    launches: BoundLaunches
    barrier: Callable[[int, int], torch.Tensor] | None
    device: torch.device
    T: int
    top_k: int


_BOUND: dict[tuple, Eager] = {}
_MAX_BOUND = 256


def eager_key(
    x: torch.Tensor, top_k: int, vtc: torch.Tensor | None, start: object, end: object,
    *flags: object,
) -> tuple:  # fmt: skip
    """The key of a one-buffer call (see the module): everything its plan, the compiled
    kernels' specialisation and the argument checks depend on, but the buffer's alignment
    (checked per call)."""
    return (
        x.shape,
        x.stride(),
        x.dtype,
        x.data_ptr() & 15,
        x.get_device(),
        top_k,
        start,
        end,
        None if vtc is None else (vtc.shape, vtc.dtype, vtc.get_device(), vtc.data_ptr() & 15),
        x.is_cuda and torch.cuda.is_current_stream_capturing(),
        *flags,
    )


def lane_key(
    x: torch.Tensor, vtc: object, top_k: object, start: object, end: object, *flags: object
) -> tuple | None:
    """A public eager call's key, or None where the fast lane does not apply (see the module).
    ``x`` must be a plain CUDA tensor in plain eager mode (``_dispatch.plain_eager``: the
    caller checks); ``flags`` are plain bools."""
    if x.requires_grad or type(top_k) is not int:
        return None
    if not (start is None or type(start) is int) or not (end is None or type(end) is int):
        return None
    if vtc is not None and type(vtc) is not torch.Tensor:  # its device is in the key
        return None
    if not fast_path_open():
        return None
    return eager_key(x, top_k, vtc, start, end, *flags, None)


def bound_call(key: tuple, x: torch.Tensor, vtc: torch.Tensor | None) -> tuple | None:
    """routing_triton's outputs from ``key``'s bound launches on ``x`` and ``vtc``, or None
    where ``key`` is not bound (or, never with the caching allocator, the new buffer is not
    16-byte aligned as the bound one was)."""
    e = _BOUND.get(key)
    if e is None:
        return None
    buf = torch.empty(e.n, dtype=torch.int32, device=e.device)
    base = buf.data_ptr()
    if base & 15:
        return None
    dev = e.device.index
    stream = current_stream(dev)
    bar = 0 if e.barrier is None else e.barrier(dev, stream).data_ptr()
    e.launches((base, x.data_ptr(), base if vtc is None else vtc.data_ptr(), bar), stream)
    return assemble(buf.split_with_sizes(e.split), e.pieces, e.T, e.top_k)


def bind(key: tuple, entry: Eager) -> None:
    if len(_BOUND) >= _MAX_BOUND:
        _BOUND.clear()  # start over
    _BOUND[key] = entry


def assemble(parts: Sequence, pieces: tuple[int, ...], T: int, top_k: int) -> tuple:
    """routing_triton's outputs (``counts, offsets, expert, token, weights, inverse, tcpe``)
    from ``parts``, int32 tensors, by index (``pieces``, -1 for None): weights viewed as fp32,
    inverse as (T, top_k)."""
    c, o, e, t, w, i, tc = pieces
    return (
        parts[c] if c >= 0 else None,
        parts[o] if o >= 0 else None,
        parts[e],
        parts[t],
        parts[w].view(torch.float32) if w >= 0 else None,
        parts[i].view(T, top_k) if i >= 0 else None,
        parts[tc] if tc >= 0 else None,
    )
