"""One place that decides where an op runs, and registers ops with ``torch.library``.

* CUDA tensors run the Triton kernels.
* CPU tensors run the pure-torch reference, unless ``TRITON_INTERPRET=1`` is set (read once, at
  import, like Triton itself does), in which case they run the Triton kernels in the interpreter.
  That is how CI tests the kernels without a GPU.
* ``MOE_KERNELS_BACKEND=reference`` forces the reference everywhere (handy to bisect a GPU issue);
  ``MOE_KERNELS_BACKEND=triton`` forces the kernels (CPU then needs ``TRITON_INTERPRET=1``).

Triton is imported only where a kernel runs (``triton_kernels``), so ``import moe_kernels`` and
every op's CPU path work without it (macOS, or any platform without Triton wheels); a call that
would run a kernel then raises a ``RuntimeError`` naming the package to install.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

NAMESPACE = "moe_kernels"

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_BACKEND: str = os.environ.get("MOE_KERNELS_BACKEND", "auto").lower()
if _BACKEND not in ("auto", "reference", "triton"):
    raise ValueError(
        f"MOE_KERNELS_BACKEND must be 'auto', 'reference' or 'triton', got {_BACKEND!r}"
    )


def use_triton(device: torch.device) -> bool:
    """True when an op on ``device`` should run its Triton kernel, False for the reference."""
    if _BACKEND == "reference":
        return False
    if _BACKEND == "triton":
        return True
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET


TRITON_MISSING = (
    "moe_kernels needs Triton to run its kernels on {where}, and `import triton` failed ({why}). "
    "Install it (`pip install triton` on Linux, `pip install triton-windows` on Windows), or run "
    "on CPU tensors without TRITON_INTERPRET (the torch reference path needs no Triton)."
)


@functools.cache
def triton_kernels(module: str) -> ModuleType:
    """``moe_kernels._triton.<module>``, imported on first use (and then cached: no import
    machinery per call). RuntimeError naming what to install when Triton cannot be imported."""
    try:
        return importlib.import_module(f"moe_kernels._triton.{module}")
    except ImportError as exc:
        if not (exc.name or "").startswith("triton"):
            raise
        where = "CPU tensors under TRITON_INTERPRET=1" if INTERPRET else "CUDA tensors"
        raise RuntimeError(TRITON_MISSING.format(where=where, why=exc)) from exc


def op_name(name: str) -> str:
    """The qualified custom-op name, ``moe_kernels::<name>``."""
    return f"{NAMESPACE}::{name}"


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def plain_eager() -> bool:
    """No compilation, dispatch mode (fake tensors, export) or functorch transform active."""
    return not (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or _functorch_active()
    )


def eager_direct(*tensors: torch.Tensor | None) -> bool:
    """True when a public function may call an op's implementation directly instead of through
    the custom-op dispatcher, which costs tens of microseconds per call on the host (as much as
    the kernels themselves at small sizes): plain CUDA tensors that need no autograd, in eager
    mode, with no compilation, dispatch mode (fake tensors, export) or functorch transform active.
    Everything else goes through the registered op, which keeps compile and autograd honest."""
    return plain_eager() and all(
        t is None or (type(t) is torch.Tensor and t.is_cuda and not t.requires_grad)
        for t in tensors
    )
