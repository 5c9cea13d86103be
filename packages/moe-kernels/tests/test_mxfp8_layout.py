"""Blocked MX scale layouts (whole, per row group, per expert) bit-exact against a naive oracle that
places every byte with the cuBLAS formula (python loops over tiles), on the reference path and on
the Triton kernels (TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_kernels import mxfp8 as mx
from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import oracle_blocked, oracle_blocked_start_rows


def naive_blocked(s: np.ndarray) -> np.ndarray:
    """(R, C) uint8 -> (Rp, Cp): the cuBLAS tiles by their definition (``oracle_blocked``)."""
    return oracle_blocked(torch.from_numpy(s)).numpy()


def rand_scales(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.uint8
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(1, 256, shape, generator=g, dtype=torch.uint8)  # no zeros: padding shows
    return s.view(dtype)


def u8(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (129, 5), (300, 7), (256, 64), (40, 36)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_to_blocked(shape: tuple[int, int], dtype: torch.dtype) -> None:
    s = rand_scales(shape, seed=shape[0] * 7 + shape[1], dtype=dtype)
    out = mx.to_blocked(s)
    assert out.dtype == dtype
    np.testing.assert_array_equal(u8(out), naive_blocked(u8(s)))


GROUP_SIZES = {
    "one_empty": [0],
    "one_row": [1],
    "127": [127],
    "128": [128],
    "129": [129],
    "mixed": [0, 5, 0, 200, 33, 0],
    "edges": [127, 1, 128, 129, 31],
    "g40": [0, 3, 17, 0, 64, 130, 1, 90, 0, 33] * 4,
}


@pytest.mark.parametrize("name", list(GROUP_SIZES))
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_to_blocked_per_group_2d(name: str, offs_dtype: torch.dtype) -> None:
    sizes = GROUP_SIZES[name]
    G, R, C = len(sizes), sum(sizes), 7 if offs_dtype == torch.int32 else 12
    s = rand_scales((R, C), seed=G + R)
    ends = torch.tensor(np.cumsum(sizes), dtype=offs_dtype)
    blocked, start_rows = mx.to_blocked_per_group_2d(s, ends)
    Cp = -(-C // 4) * 4
    assert blocked.shape == (R + 128 * G, Cp) and blocked.dtype == s.dtype
    assert start_rows.dtype == torch.int32
    assert start_rows.tolist() == oracle_blocked_start_rows(sizes)
    got, s_np, row = u8(blocked), u8(s), 0
    for g, n in enumerate(sizes):
        lo, hi = start_rows[g].item(), start_rows[g + 1].item()
        want = naive_blocked(s_np[row : row + n]) if n else np.zeros((0, Cp), np.uint8)
        np.testing.assert_array_equal(got[lo:hi], want, err_msg=f"group {g}")
        row += n


def test_to_blocked_per_group_2d_e8m0_and_noncontiguous() -> None:
    base = rand_scales((200, 9), seed=3, dtype=torch.float8_e8m0fnu)
    s = base[:, 2:7]  # (200, 5), row stride 9
    ends = torch.tensor([60, 60, 200], dtype=torch.int32)
    blocked, start_rows = mx.to_blocked_per_group_2d(s, ends)
    assert blocked.dtype == torch.float8_e8m0fnu
    s_np = u8(s.contiguous())
    np.testing.assert_array_equal(u8(blocked)[0:128], naive_blocked(s_np[:60]))
    np.testing.assert_array_equal(u8(blocked)[128:384], naive_blocked(s_np[60:]))


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_compute_per_group_blocked_scale_offsets(offs_dtype: torch.dtype) -> None:
    sizes = GROUP_SIZES["g40"] + [255, 256, 257]
    ends = torch.tensor(np.cumsum(sizes), dtype=offs_dtype)
    got_sizes, start_rows = mx.compute_per_group_blocked_scale_offsets(ends)
    assert got_sizes.tolist() == sizes
    assert start_rows.tolist() == oracle_blocked_start_rows(sizes)


@pytest.mark.parametrize("shape", [(3, 130, 5), (2, 128, 8), (1, 1, 1), (4, 64, 36)])
def test_to_blocked_per_group_3d(shape: tuple[int, int, int]) -> None:
    s = rand_scales(shape, seed=sum(shape), dtype=torch.float8_e8m0fnu)
    out = mx.to_blocked_per_group_3d(s)
    E, N, C = shape
    assert out.shape == (E, -(-N // 128) * 128 * (-(-C // 4) * 4)) and out.dtype == s.dtype
    for e in range(E):
        np.testing.assert_array_equal(u8(out)[e], naive_blocked(u8(s)[e]).reshape(-1))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: mx.to_blocked(torch.zeros(2, 3, 4, dtype=torch.uint8)), ValueError, "scale must"),
        (lambda: mx.to_blocked(torch.zeros(4, 4)), TypeError, "scale must have dtype"),
        (
            lambda: mx.to_blocked_per_group_3d(torch.zeros(4, 4, dtype=torch.uint8)),
            ValueError,
            "3-D",
        ),
        (
            lambda: mx.to_blocked_per_group_2d(
                torch.zeros(4, 4, dtype=torch.uint8), torch.tensor([4.0])
            ),
            TypeError,
            "group_end_offsets",
        ),
        (
            lambda: mx.to_blocked_per_group_2d(
                torch.zeros(4, 4, dtype=torch.uint8), torch.tensor([[4]], dtype=torch.int32)
            ),
            ValueError,
            "group_end_offsets must be 1-D",
        ),
        (
            lambda: mx.to_blocked_per_group_2d(
                torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(0, dtype=torch.int32)
            ),
            ValueError,
            "group_end_offsets must hold between 1 and",
        ),
        (
            lambda: mx.compute_per_group_blocked_scale_offsets(torch.tensor([1.0, 2.0])),
            TypeError,
            "group_end_offsets",
        ),
    ],
)
def test_bad_input(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_opcheck() -> None:
    ops = torch.ops.moe_kernels
    s = rand_scales((200, 6), seed=9)
    ends = torch.tensor([10, 10, 150, 200], dtype=torch.int32)
    torch.library.opcheck(ops.to_blocked, (s,))
    torch.library.opcheck(ops.to_blocked_per_group_3d, (s.view(2, 100, 6),))
    torch.library.opcheck(ops.compute_per_group_blocked_scale_offsets, (ends,))
    # Rows past start_rows[G] are unspecified (never written), so the checks that compare two
    # runs' outputs are left to test_compile_fullgraph, which compares the specified rows.
    torch.library.opcheck(
        ops.to_blocked_per_group_2d,
        (s, ends),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_compile_fullgraph() -> None:
    s = rand_scales((200, 6), seed=10, dtype=torch.float8_e8m0fnu)
    ends = torch.tensor([10, 10, 150, 200], dtype=torch.int64)

    def f(s: torch.Tensor, ends: torch.Tensor):
        blocked, start_rows = mx.to_blocked_per_group_2d(s, ends)
        sizes, rows2 = mx.compute_per_group_blocked_scale_offsets(ends)
        return (
            blocked,
            start_rows,
            rows2,
            mx.to_blocked(s),
            mx.to_blocked_per_group_3d(s.view(2, 100, 6)),
        )

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(s, ends)
    want = f(s, ends)
    n = want[1][-1].item()
    np.testing.assert_array_equal(u8(got[0])[:n], u8(want[0])[:n])
    for a, b in zip(got[1:], want[1:], strict=True):
        assert np.array_equal(a.view(torch.uint8).numpy(), b.view(torch.uint8).numpy())


@pytest.mark.skipif(not INTERPRET, reason="launches the Triton kernels: needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_c", [4, 8, 32])
def test_layout_column_chunks(block_c: int) -> None:
    """Column chunks narrower than the row, and a partly masked last chunk."""
    from moe_kernels._triton import mxfp8_layout as tlay

    s = rand_scales((200, 18), seed=11)  # Cp = 20: 5, 3 or 1 chunks
    ends = torch.tensor([0, 77, 200], dtype=torch.int32)
    blocked, rows = tlay.to_blocked_per_group_2d(s, ends, block_c=block_c)
    np.testing.assert_array_equal(u8(blocked)[:128], naive_blocked(u8(s)[:77]))
    np.testing.assert_array_equal(u8(blocked)[128:256], naive_blocked(u8(s)[77:]))
    out3 = tlay.to_blocked_per_group_3d(s.view(2, 100, 18), block_c=block_c)
    for e in range(2):
        np.testing.assert_array_equal(
            u8(out3)[e], naive_blocked(u8(s)[100 * e : 100 * (e + 1)]).reshape(-1)
        )


class _Compiled:
    """Stands in for a compiled kernel: records each ``run`` (grid, then arguments)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def run(self, g0, g1, g2, stream, function, metadata, launch_meta, enter, exit_, *args):
        self.calls.append(("run", (g0, g1), args))


class _Jit:
    """Stands in for a ``@triton.jit`` function: ``fn[grid](*args, **constexprs)`` records the
    call, constexprs appended in signature order, and returns a ``_Compiled``."""

    def __init__(self, real, calls: list) -> None:
        self.arg_names, self.calls = real.arg_names, calls

    def __getitem__(self, grid):
        def go(*args, num_warps=None, **constexprs):
            tail = tuple(constexprs[n] for n in self.arg_names[len(args) :])
            self.calls.append(("jit", tuple(grid), args + tail))
            return _Compiled(self.calls)

        return go


class _Stream:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.active
        @staticmethod
        def get_current_stream(dev):
            return 0


@pytest.mark.skipif(INTERPRET, reason="the bound relaunch is closed under the interpreter")
def test_bound_relaunch_passes_what_the_first_launch_passed(monkeypatch) -> None:
    """An eager call of a signature seen before launches the bound handle: the same grid, the new
    tensors' addresses, the same ints and constexprs. Recording stand-ins on the CPU."""
    pytest.importorskip("triton")
    from moe_kernels._triton import launch
    from moe_kernels._triton import mxfp8_layout as tlay

    calls: list = []
    monkeypatch.setattr(launch.FastKernel, "enabled", True)
    monkeypatch.setattr(tlay, "fast_path_open", lambda: True)
    monkeypatch.setattr(tlay, "current_stream", lambda dev: 0)
    monkeypatch.setattr(launch, "driver", _Stream)
    monkeypatch.setattr(tlay, "_BOUND", {})
    for name in ("_blocked_2d_groups", "_blocked_3d"):
        real = getattr(tlay, name).fn
        monkeypatch.setattr(tlay, name, launch.FastKernel(_Jit(real, calls)))

    def expect_rebound(call, tensors_of):
        first = call()
        (kind, grid, args) = calls[-1]
        assert kind == "jit"
        second = call()
        assert calls[-1][0] == "run" and calls[-1][1] == grid
        n = len(tensors_of(first))
        got = calls[-1][2]
        assert list(got[:n]) == [t.data_ptr() for t in tensors_of(second)]
        assert got[n:] == args[n:]  # ints and constexprs

    s, ends = rand_scales((300, 37), seed=3).view(torch.uint8), torch.tensor([100, 300])
    expect_rebound(
        lambda: (tlay.to_blocked_per_group_2d(s, ends), s, ends),
        lambda r: (r[1], r[2], r[0][0], r[0][1]),
    )
    s3 = rand_scales((2, 130, 5), seed=4).view(torch.uint8)
    expect_rebound(lambda: (tlay.to_blocked_per_group_3d(s3), s3), lambda r: (r[1], r[0]))
    tlay.to_blocked_per_group_2d(s[:, :36], ends)  # another signature: bound anew
    # R (the bound of the group ends), C, Cp, G, stride
    assert len(tlay._BOUND) == 3 and calls[-1][2][4:9] == (300, 36, 36, 2, 37)
