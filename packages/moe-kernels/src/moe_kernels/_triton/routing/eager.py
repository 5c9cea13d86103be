"""The eager fast lane of the routing ops: a call's launches, bound once, relaunched per call.

Eager calls at small T are bound by the host (a Triton launch costs several microseconds of host
time, an allocation and each view one or two, as much as the kernels' device time). So the first
one-buffer call of each kind (``launch.run``) binds its compiled handles with ``Rel`` address
slots (``BoundLaunches``) under the call's key (``eager_key``), and later calls with that key
take ``bound_call``: one allocation, the launches on the new addresses, one split into outputs.

The key holds everything the plan, Triton's specialisation and the public ops' argument checks
depend on: the scores' shape, strides, dtype, 16-byte alignment and device, top_k, the expert
range as passed, the valid count's shape, dtype, device and alignment, the op and its flags, the
constraints, and whether a CUDA graph is being captured (no cooperative launch then). So a public
call whose key is bound (``lane_key``) is one that passed those checks before and launches
exactly what the full path would: the public functions try it first. Tensor subclasses, CPU
tensors, compilation, dispatch modes, functorch transforms (the caller checks those), autograd,
launch hooks and argument types other than plain ints and bools take the full path.

The table holds at most ``_MAX_BOUND`` keys and starts over when full (one atomic ``clear``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..._routing_outputs import RoutingPlan, ShuffledIndices
from ..launch import BoundLaunches, current_stream, fast_path_open


class Eager(NamedTuple):
    """A bound call: the buffer's int32 size, its split (the op's outputs, then the rest), the
    launches, the barrier words' source for a cooperative launch, the device, the op, T, top_k."""

    n: int
    split: tuple[int, ...]
    launches: BoundLaunches
    barrier: Callable[[int, int], torch.Tensor] | None
    device: torch.device
    route: bool
    T: int
    top_k: int


_BOUND: dict[tuple, Eager] = {}
_MAX_BOUND = 256


def eager_key(x: torch.Tensor, top_k: int, vtc: torch.Tensor | None, start: object,
              end: object, *flags: object) -> tuple:  # fmt: skip
    """The key of a one-buffer call (see the module); the buffer's alignment is checked per
    call."""
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


def lane_key(x: torch.Tensor, vtc: object, top_k: object, start: object, end: object,
             renormalize: object, route: bool) -> tuple | None:  # fmt: skip
    """A public eager call's key, or None where the lane does not apply (see the module). ``x``
    must be a plain CUDA tensor in plain eager mode (``_dispatch.plain_eager``: the caller
    checks)."""
    if x.requires_grad or type(top_k) is not int or type(renormalize) is not bool:
        return None
    if not (start is None or type(start) is int) or not (end is None or type(end) is int):
        return None
    if vtc is not None and type(vtc) is not torch.Tensor:  # its device is in the key
        return None
    if not fast_path_open():
        return None
    return eager_key(x, top_k, vtc, start, end, renormalize, route, None)


def bound_call(
    key: tuple, x: torch.Tensor, vtc: torch.Tensor | None
) -> RoutingPlan | ShuffledIndices | None:
    """The outputs of ``key``'s bound launches on ``x`` and ``vtc``, or None where ``key`` is
    not bound (or, never with the caching allocator, the new buffer is not 16-byte aligned)."""
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
    parts = buf.split_with_sizes(e.split)
    if e.route:
        return RoutingPlan(parts[4], parts[5], parts[0], parts[1],
                           parts[2].view(torch.float32), parts[3].view(e.T, e.top_k))  # fmt: skip
    return ShuffledIndices(parts[2], parts[0], parts[1])


def bind(key: tuple, entry: Eager) -> None:
    if len(_BOUND) >= _MAX_BOUND:
        _BOUND.clear()  # start over
    _BOUND[key] = entry
