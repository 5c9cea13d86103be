"""One place that decides where an op runs, and registers ops with ``torch.library``.

* CUDA tensors run the Triton kernels.
* CPU tensors run the pure-torch reference, unless ``TRITON_INTERPRET=1`` is set (read once, at
  import, like Triton itself does), in which case they run the Triton kernels in the interpreter.
  That is how CI tests the kernels without a GPU.
* ``MOE_KERNELS_BACKEND=reference`` forces the reference everywhere (handy to bisect a GPU issue);
  ``MOE_KERNELS_BACKEND=triton`` forces the kernels (CPU then needs ``TRITON_INTERPRET=1``);
  ``MOE_KERNELS_BACKEND=portable`` runs the kernels as on a GPU without TMA or CUTLASS grouped
  GEMMs (an RTX 4090 / 5090's plan: pointer loads, MMAs through ``tl.dot``, no
  ``torch._grouped_mm``), on any GPU: how the portable variants are tested and timed on a Hopper.

Ops are registered by ``register_op``: a ``torch.library`` custom op with a fake kernel that, under
``torch.compile``, is traced into the graph where its kernels run on CUDA (what
``torch.library.triton_op`` does), so Inductor emits the Triton launches in its own code.

Triton is imported only where a kernel runs (``triton_kernels``), so ``import moe_kernels`` and
every op's CPU path work without it (macOS, or any platform without Triton wheels); a call that
would run a kernel then raises a ``RuntimeError`` naming the package to install.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

NAMESPACE = "moe_kernels"

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BACKENDS = ("auto", "reference", "triton", "portable")
_BACKEND: str = os.environ.get("MOE_KERNELS_BACKEND", "auto").lower()
if _BACKEND not in BACKENDS:
    raise ValueError(f"MOE_KERNELS_BACKEND must be one of {BACKENDS}, got {_BACKEND!r}")
PORTABLE: bool = _BACKEND == "portable"


def use_triton(device: torch.device) -> bool:
    """True when an op on ``device`` should run its Triton kernel, False for the reference."""
    if _BACKEND == "reference":
        return False
    if _BACKEND == "triton":
        return True
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET


def execution_path(device: torch.device) -> str:
    """Where the public ops run on ``device``: "triton" (CUDA), "interpreter" (CPU tensors under
    ``TRITON_INTERPRET=1``) or "reference" (the torch reference: a CPU, or
    ``MOE_KERNELS_BACKEND=reference``)."""
    if not use_triton(device):
        return "reference"
    return "triton" if device.type == "cuda" else "interpreter"


TRITON_MISSING = (
    "moe_kernels needs Triton to run its kernels on {where}, and `import triton` failed ({why}). "
    "Install it (`pip install triton` on Linux, `pip install triton-windows` on Windows), or run "
    "on CPU tensors without TRITON_INTERPRET (the torch reference path needs no Triton)."
)

NUMPY_MISSING = (
    "TRITON_INTERPRET=1 runs moe_kernels' Triton kernels in Triton's interpreter, which needs "
    "numpy, and `import numpy` failed ({why}). Install it (`pip install numpy`), or unset "
    "TRITON_INTERPRET to run the torch reference path on CPU tensors."
)


@functools.cache
def triton_kernels(module: str) -> ModuleType:
    """``moe_kernels._triton.<module>``, imported on first use (and then cached: no import
    machinery per call). RuntimeError naming what to install when Triton cannot be imported."""
    try:
        return importlib.import_module(f"moe_kernels._triton.{module}")
    except ImportError as exc:
        if INTERPRET and exc.name == "numpy":  # Triton's interpreter runs on numpy
            raise RuntimeError(NUMPY_MISSING.format(why=exc)) from exc
        if not (exc.name or "").startswith("triton"):
            raise
        where = "CPU tensors under TRITON_INTERPRET=1" if INTERPRET else "CUDA tensors"
        raise RuntimeError(TRITON_MISSING.format(where=where, why=exc)) from exc


_SM: dict[int, int] = {}


@torch.compiler.assume_constant_result
def sm_version(index: int) -> int:
    """The compute capability of CUDA device ``index`` as 10 * major + minor (89: sm_89), cached
    in a plain dict (the property query costs microseconds of host time a call; Dynamo warns on
    every ``functools.lru_cache`` it meets). Under ``torch.compile`` Dynamo calls it once while
    tracing and keeps the result as a constant (``assume_constant_result``): it never traces the
    dict, whose first fill inside a traced frame failed its guards (a cold process crashed)."""
    sm = _SM.get(index)
    if sm is None:
        props = torch.cuda.get_device_properties(index)
        sm = _SM[index] = 10 * props.major + props.minor
    return sm


def sm_major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index`` (``sm_version``)."""
    return sm_version(index) // 10


def has_tma(index: int) -> bool:
    """Whether kernels on CUDA device ``index`` may read through TMA descriptors: sm90 and
    later, unless ``MOE_KERNELS_BACKEND=portable``."""
    return not PORTABLE and sm_major(index) >= 9


def e4m3_native(device: torch.device) -> bool:
    """Whether Triton kernels on ``device`` may use the e4m3 (float8e4nv) type: CUDA sm_89 and
    later (Ada, Hopper, Blackwell). Earlier GPUs (A100, RTX 30xx) and the interpreter take the
    integer paths: e4m3 rounding in integer arithmetic, e4m3 bytes decoded to bf16."""
    return device.type == "cuda" and not INTERPRET and sm_version(device.index or 0) >= 89


def op_name(name: str) -> str:
    """The qualified custom-op name, ``moe_kernels::<name>``."""
    return f"{NAMESPACE}::{name}"


def _traced_kernels(args: Sequence[object]) -> bool:
    """Whether an op call with these arguments runs Triton kernels that ``wrap_triton`` can trace:
    on CUDA tensors (the device of the first tensor argument), not in the interpreter (whose
    kernels are plain Python functions) and not forced onto the reference."""
    if INTERPRET or _BACKEND == "reference":
        return False
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == "cuda"


_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(args: Sequence[object]) -> bool:
    """Whether an argument is symbolic under dynamic shapes: a tensor with a symbolic size or
    stride, or a symbolic int, float or bool (alone or in a list), such as a ``top_k`` that
    dynamo made dynamic after a recompile."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not all(isinstance(s, int) for s in (*a.shape, *a.stride())):
                return True
        elif isinstance(a, _SYMBOLS) or (
            isinstance(a, (list, tuple)) and any(isinstance(v, _SYMBOLS) for v in a)
        ):
            return True
    return False


def _decompose(impl: Callable, traceable: Callable[..., bool] | None) -> Callable:
    """The FunctionalTensorMode rule of an op: run ``impl`` under the mode (its launches become
    ``wrap_triton`` nodes Inductor lowers) where ``_traced_kernels`` and ``traceable(*args)``
    (when given), else keep the op opaque.
    Tensor subclasses other than fake and functional ones, symbolic sizes (``dynamic=True``, or
    the automatic dynamic shapes of a recompile: the launchers choose plans and grids from
    concrete sizes), symbolic ints (a ``top_k`` or an expert range made dynamic: plans are
    cached by their values) and ``torch.export`` (which keeps custom ops whole, as it does for
    triton ops) keep it too."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    def known(t: type) -> bool:
        return t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor)

    def rule(mode, func, types, args, kwargs):  # noqa: ANN001, ANN202
        decompose = getattr(torch._functorch.config, "decompose_custom_triton_ops", True)
        traced = decompose and _traced_kernels(args) and not _symbolic(args)
        traced = traced and all(map(known, types))
        if traced and traceable is not None:
            with mode:
                traced = traceable(*args, **kwargs)
        if not traced:
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return impl(*args, **kwargs)

    return rule


def _custom_op(
    name: str,
    impl: Callable,
    fake: Callable,
    mutates_args: tuple[str, ...],
    traced: bool | Callable[..., bool],
) -> torch.library.CustomOpDef:
    """The custom op ``moe_kernels::<name>`` (see ``KernelOp``)."""
    op = torch.library.custom_op(op_name(name), mutates_args=mutates_args)(impl)
    op.register_fake(fake)
    if not traced:
        return op
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    traceable = traced if callable(traced) else None
    op.register_torch_dispatch(FunctionalTensorMode, _decompose(impl, traceable))
    return op


def tracing() -> bool:
    """Whether a dispatch mode is active (Inductor's trace, fake tensors, make_fx): launchers
    then go through ``wrap_triton`` and must not read device addresses."""
    return _get_current_dispatch_mode() is not None


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def plain_eager() -> bool:
    """No compilation, dispatch mode (fake tensors, export) or functorch transform active."""
    return not (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or _functorch_active()
    )


# The devices whose plain-eager calls run an op's implementation directly (``KernelOp.route``).
# CPU calls go through the op (they cost no kernel time a dispatcher round trip would double);
# tests add "cpu" to check the direct path gives the op's results.
DIRECT_DEVICES: tuple[str, ...] = ("cuda",)

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no subclass with its own dispatch (fake, DTensor)


class KernelOp:
    """One kernel op: the ``torch.library`` custom op ``moe_kernels::<name>`` (``op``), its
    implementation (``impl``: the Triton launch or the reference, by device), its fake, and,
    once ``register_autograd`` ran, its eager autograd path. Every caller, the public function
    and the composite ops alike, calls it through ``call``, which picks the route (``route``).

    ``mutates_args``: the inputs ``impl`` writes in place. ``traced=False`` keeps the op opaque
    under ``torch.compile`` on every device: for torch math (backward formulas) whose result
    must not change when Inductor would refuse or reorder it, so compiled gradients equal eager
    ones bit for bit. Under ``torch.compile`` (AOT autograd's FunctionalTensorMode) a call on
    CUDA tensors is traced into the graph rather than kept opaque, as ``torch.library.
    triton_op`` does: the launchers (``_triton/launch.py``) launch through ``wrap_triton``
    while tracing, so Inductor emits the kernels in its own code (its launchers and planned
    allocations, no dispatcher round trip a call). CPU calls stay opaque: the reference must
    not be recompiled by Inductor (its fp32 sums would change order), and the interpreter's
    kernels cannot be traced. ``traced`` may be a predicate of the op's arguments: False keeps
    that call opaque (a kernel Inductor cannot analyse in reasonable time). Eager calls, fake
    tensors and ``torch.export`` see a plain custom op.
    """

    def __init__(
        self,
        name: str,
        impl: Callable,
        fake: Callable,
        mutates_args: tuple[str, ...] = (),
        *,
        traced: bool | Callable[..., bool] = True,
    ) -> None:
        self.name = name
        self.impl = impl
        self.op = _custom_op(name, impl, fake, mutates_args, traced)
        self.eager_autograd: Callable | None = None
        params = list(inspect.signature(impl).parameters)
        self._mutated = tuple(params.index(a) for a in mutates_args)

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """``backward`` / ``setup_context`` as the op's autograd formula, and the same formula
        as an ``autograd.Function`` around ``impl`` (``eager_autograd``): what a plain-eager
        call that records gradients runs instead of the op, whose dispatcher round trip and
        Python autograd wrapper cost about 100 us of host time per call. Same kernels, same
        saved tensors, same backward: the same bits."""
        self.op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        class EagerAutograd(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):  # noqa: ANN001, ANN205
                ctx.set_materialize_grads(False)  # as the op's formula sees them: None
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            @staticmethod
            def backward(ctx, *grads):  # noqa: ANN001, ANN205
                return backward(ctx, *grads)

        EagerAutograd.__name__ = EagerAutograd.__qualname__ = f"{self.name}_eager"
        self.eager_autograd = EagerAutograd.apply

    def route(self, *args: object) -> str:
        """Which path a call with these arguments takes (its tensor arguments decide):

        * "impl": the implementation directly, no dispatcher round trip (tens of microseconds
          of host time a call, as much as the kernels at small sizes): plain eager mode (no
          compilation, dispatch mode or functorch transform), plain tensors on a
          ``DIRECT_DEVICES`` device, no gradient to record;
        * "eager_autograd": the same with a gradient to record, where ``register_autograd``
          gave the op one;
        * "op": the registered custom op, everything else (what compile, export, fake tensors
          and tensor subclasses see; autograd through the op's formula).
        """
        if not plain_eager():
            return "op"
        grad = torch.is_grad_enabled()
        records = False
        for a in args:  # (one pass, no lists: this runs on every eager call)
            if isinstance(a, torch.Tensor):
                if type(a) not in _PLAIN or not (a.is_cuda or a.device.type in DIRECT_DEVICES):
                    return "op"
                records = records or (grad and a.requires_grad)
        if records:
            return "op" if self.eager_autograd is None else "eager_autograd"
        return "impl"

    def call(self, *args: object) -> Any:
        """The op on ``args`` (``impl``'s positional arguments), by ``route``. A direct call of
        an op that writes in place bumps the written tensors' versions, as the op does."""
        route = self.route(*args)
        if route == "op":
            return self.op(*args)
        if route == "eager_autograd":
            return self.eager_autograd(*args)
        out = self.impl(*args)
        for i in self._mutated:
            if isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return out


def register_op(
    name: str,
    impl: Callable,
    fake: Callable,
    mutates_args: tuple[str, ...] = (),
    *,
    traced: bool | Callable[..., bool] = True,
) -> KernelOp:
    """``KernelOp(name, impl, fake, mutates_args, traced=traced)``: the one way ops are made."""
    return KernelOp(name, impl, fake, mutates_args, traced=traced)
