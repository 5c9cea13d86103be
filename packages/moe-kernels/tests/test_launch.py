"""The compiled-handle launcher's cache key: it must separate every case Triton specialises."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # launchers of compiled kernels: nothing to test without Triton
import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.launch import FastKernel, _arg_key


def test_tensor_key_separates_dtype_and_alignment():
    buf = torch.empty(64, dtype=torch.float32)
    aligned, shifted = buf[:8], buf[1:9]  # 4-byte offset: not 16-byte aligned
    assert aligned.data_ptr() % 16 == 0
    assert _arg_key(aligned) != _arg_key(shifted)
    assert _arg_key(aligned) == _arg_key(buf[4:12])  # 16-byte offset: same specialisation
    assert _arg_key(aligned) != _arg_key(aligned.view(torch.int32))


def test_int_key_separates_one_multiples_of_16_and_width():
    assert _arg_key(1) != _arg_key(3)
    assert _arg_key(16) != _arg_key(17)
    assert _arg_key(32) == _arg_key(48)
    assert _arg_key(5) == _arg_key(7)
    assert _arg_key(2**31) != _arg_key(2**31 - 16 * 3)  # 64-bit vs 32-bit
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) is None


@triton.jit
def _add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


def test_interpreter_launches_through_triton_and_caches_nothing():
    if not INTERPRET:
        pytest.skip("launches on CPU only under TRITON_INTERPRET=1")
    k = FastKernel(_add_one)
    x = torch.arange(10, dtype=torch.int32)
    for _ in range(2):
        out = torch.zeros_like(x)
        k.launch((1,), (x, out, 10), {"BLOCK": 16})
        assert torch.equal(out, x + 1)
    assert not FastKernel.enabled and k.handles == {}


def test_hook_detection_reads_hook_chains():
    """Triton >= 3.5 keeps launch hooks as always-present ``HookChain`` objects: an empty chain
    is no hook (the fast path stays on), a chain with a hook is one, and so is a bare callable."""
    from moe_kernels._triton.launch import _hooked

    class Chain:  # the shape of triton.knobs.HookChain
        def __init__(self, calls):
            self.calls = calls

    assert not _hooked(None)
    assert not _hooked(Chain([]))
    assert _hooked(Chain([print]))
    assert _hooked(print)
    try:
        from triton import knobs
    except ImportError:
        return
    if knobs.runtime.launch_enter_hook is not None:  # this Triton's default: no hook installed
        assert not _hooked(knobs.runtime.launch_enter_hook)
        assert not _hooked(knobs.runtime.launch_exit_hook)


def test_unkeyable_arguments_take_the_plain_path():
    from moe_kernels._triton.launch import _NO_KEY

    assert _arg_key(object()) is _NO_KEY
    assert _arg_key(0.5) == _arg_key(2.0) and _arg_key(0.5) is not _NO_KEY


class _Kernel:
    """A compiled kernel with a given launcher."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, run) -> None:
        self.run = run


def _launchers(scratch: int = 0):
    """Stand-ins for CudaLauncher: 3.5/3.6's call form (which passes its arguments on to the C
    function with the scratch it allocates, None for none) and 3.8's."""
    calls: list = []

    class CudaLauncher:  # triton 3.5 / 3.6
        launch_cooperative_grid, launch_pdl = True, False
        global_scratch_size = profile_scratch_size = scratch

        def __init__(self) -> None:
            self.launch = lambda *args: calls.append(args)  # the C function

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            glob = object() if self.global_scratch_size else None
            prof = object() if self.profile_scratch_size else None
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                        self.launch_pdl, glob, prof, *args)  # fmt: skip

    class NewLauncher(CudaLauncher):  # triton 3.8: named metadata and hook parameters
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, launch_enter_hook, launch_exit_hook, *args):  # fmt: skip
            calls.append(("3.8", gridX, kernel_metadata, *args))

    NewLauncher.__name__ = "CudaLauncher"
    return CudaLauncher(), NewLauncher(), calls


def test_direct_launch_passes_what_the_launcher_would(monkeypatch):
    import moe_kernels._triton.launch as L

    monkeypatch.setattr(L, "_TRITON_VERSION", "3.6.0")
    old, _, calls = _launchers()
    k = _Kernel(old)
    go, pre = L.launcher(k)
    assert go is not old  # the C function, not the launcher
    go(7, 1, 1, 99, *pre, "x", 3, "C")
    k.run(7, 1, 1, 99, k.function, k.packed_metadata, None, None, None, "x", 3, "C")
    assert len(calls) == 2 and calls[0] == calls[1]


@pytest.mark.parametrize("case", ["3.8 launcher", "scratch", "triton 3.8", "triton 3.4"])
def test_launcher_elsewhere_is_the_triton_launcher(monkeypatch, case):
    import moe_kernels._triton.launch as L

    version = {"triton 3.8": "3.8.0", "triton 3.4": "3.4.0"}.get(case, "3.6.0")
    monkeypatch.setattr(L, "_TRITON_VERSION", version)
    old, new, calls = _launchers(scratch=16 if case == "scratch" else 0)
    k = _Kernel(new if case == "3.8 launcher" else old)
    go, pre = L.launcher(k)
    assert go is k.run and pre == (k.function, k.packed_metadata, None, None, None)


def test_tma_descriptor_key_is_tritons_specialisation():
    """A host-built TMA descriptor is keyed by its base's dtype, block shape and padding mode:
    what Triton specialises a kernel on (its signature type ``tensordesc<bf16[64, 128]>``), never
    the base address, shape or strides, which its launcher reads at every launch."""
    tensor_descriptor = pytest.importorskip("triton.tools.tensor_descriptor")
    desc = tensor_descriptor.TensorDescriptor.from_tensor
    a = torch.empty(256, 128, dtype=torch.bfloat16)
    b = torch.empty(64, 512, dtype=torch.bfloat16)[:, 64:]  # another base, shape and stride
    assert _arg_key(desc(a, [64, 128])) == _arg_key(desc(b, [64, 128]))
    assert _arg_key(desc(a, [64, 128])) != _arg_key(desc(a, [128, 64]))
    assert _arg_key(desc(a, [64, 128])) != _arg_key(desc(a.view(torch.float16), [64, 128]))
    if hasattr(desc(a, [64, 128]), "padding"):  # triton >= 3.6
        assert _arg_key(desc(a, [64, 128])) != _arg_key(desc(a, [64, 128], padding="nan"))
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # older triton: its specialisation is not reachable this way
        return

    def spec(d):
        return native_specialize_impl(BaseBackend, d, False, True, True)

    assert spec(desc(a, [64, 128])) == spec(desc(b, [64, 128]))  # what Triton keys on
    assert spec(desc(a, [64, 128])) != spec(desc(a, [128, 64]))
