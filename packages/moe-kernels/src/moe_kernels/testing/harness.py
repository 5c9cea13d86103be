"""``GuardHarness``: a hostile-input test's inputs and kernel outputs inside guard regions
(``guards.py``), and the same call on the reference path to compare with."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from moe_kernels._dispatch import use_triton
from moe_kernels.testing.guards import Guarded, guarded

__all__ = ["GuardHarness"]


class _GuardedAllocs:
    """Stands in for ``torch`` in a kernel module: every ``torch.empty`` there (the kernels'
    outputs) is a guarded view; everything else is torch's."""

    def __init__(self) -> None:
        self.made: list[Guarded] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, *size, **kwargs) -> torch.Tensor:
        g = guarded(torch.empty(*size, **kwargs))
        self.made.append(g)
        return g.tensor


class GuardHarness:
    """Guarded inputs (``g``) and, where the kernels run (``kernels``), guarded kernel outputs:
    every ``torch.empty`` of ``moe_kernels._triton.<name>`` for ``kernel_modules`` (unless
    ``guard_outputs`` is False). ``reference`` runs a call with ``use_triton`` of the public
    modules ``moe_kernels.<name>`` (``public_modules``) patched off. ``monkeypatch`` is pytest's
    fixture; everything is undone with it."""

    def __init__(
        self,
        monkeypatch,
        device: torch.device,
        kernel_modules: Sequence[str] = (),
        public_modules: Sequence[str] = (),
        guard_outputs: bool = True,
    ) -> None:
        self.mp, self.device = monkeypatch, device
        self.kernels = use_triton(device)
        self.public = [importlib.import_module(f"moe_kernels.{n}") for n in public_modules]
        self.inputs: list[Guarded] = []
        self.allocs = _GuardedAllocs()
        if self.kernels and guard_outputs:
            for name in kernel_modules:
                module = importlib.import_module(f"moe_kernels._triton.{name}")
                monkeypatch.setattr(module, "torch", self.allocs)

    def g(self, t: torch.Tensor) -> torch.Tensor:
        """A guarded copy of ``t`` on the device."""
        gt = guarded(t.to(self.device))
        self.inputs.append(gt)
        return gt.tensor

    def intact(self) -> None:
        """AssertionError where a kernel wrote outside an input or output."""
        assert all(g.intact() for g in self.inputs), "a guard of an input was overwritten"
        assert all(g.intact() for g in self.allocs.made), "a guard of an output was overwritten"

    def reference(self, fn: Callable, *args, **kwargs):
        """``fn(*args)`` on the reference path of ``public_modules`` (None where that is the
        path that ran)."""
        return self.reference_in(self.public, fn, *args, **kwargs)

    def reference_in(self, modules: Sequence[ModuleType], fn: Callable, *args, **kwargs):
        """``fn(*args)`` with ``use_triton`` of ``modules`` patched off (None where the
        reference is the path that ran)."""
        if not self.kernels:
            return None
        with self.mp.context() as m:
            for module in modules:
                m.setattr(module, "use_triton", lambda device: False)
            return fn(*args, **kwargs)
