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
