"""One place that decides where an op runs, and registers ops with ``torch.library``.

* CUDA tensors run the Triton kernels.
* CPU tensors run the pure-torch reference, unless ``TRITON_INTERPRET=1`` is set (read once, at
  import, like Triton itself does), in which case they run the Triton kernels in the interpreter.
  That is how CI tests the kernels without a GPU.
* ``MOE_KERNELS_BACKEND=reference`` forces the reference everywhere (handy to bisect a GPU issue);
  ``MOE_KERNELS_BACKEND=triton`` forces the kernels (CPU then needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

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
