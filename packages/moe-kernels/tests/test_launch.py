"""The compiled-handle launcher's cache key: it must separate every case Triton specialises."""

from __future__ import annotations

import pytest
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

    assert not _hooked(None, None)
    assert not _hooked(Chain([]), Chain([]))
    assert _hooked(Chain([print]), Chain([]))
    assert _hooked(None, print)
    try:
        from triton import knobs
    except ImportError:
        return
    if knobs.runtime.launch_enter_hook is not None:  # this Triton's default: no hook installed
        assert not _hooked(knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)


def test_unkeyable_arguments_take_the_plain_path():
    from moe_kernels._triton.launch import _NO_KEY

    assert _arg_key(object()) is _NO_KEY  # e.g. a TMA descriptor, a new object per call
    assert _arg_key(0.5) == _arg_key(2.0) and _arg_key(0.5) is not _NO_KEY
