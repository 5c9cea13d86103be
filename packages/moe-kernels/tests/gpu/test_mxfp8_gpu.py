"""The MXFP8 ops on the GPU, bit for bit against the reference run on the CPU
(``moe_kernels.reference.mxfp8``), outputs poisoned first:

* the casts (``to_mxfp8``, ``to_mxfp8_dim1``; floor and rceil; fp32 / bf16 / fp16 inputs with
  zero, NaN, inf, subnormal and saturating blocks, magnitudes over 2**+-60) and ``from_mxfp8``
  (every data byte with every scale byte, to fp32 / bf16 / fp16);
* the special-value blocks of ``tests/test_mxfp8_quant.py``'s table (whose bytes the CPU test
  checks on the reference): every cast, dim0 and dim1, masked (the cases once) and unmasked
  (repeated to 64 rows) tiles; dequantised NaN exactly on the blocks with scale byte 255;
* the blocked scale layouts (2d per group, 3d, ``to_blocked``, the group offsets) over odd
  widths (1, 3, 7, 15, 37 columns), G up to 128 with empty groups, and the benchmark shapes;
* ``mxfp8_grouped_mm`` against the dequantised fp32 loop, rows past the last group zero;
* every op with no host sync, replayed from a CUDA graph and compiled (``fullgraph=True``).
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import mxfp8 as ref
from moe_kernels.testing import (
    bits_equal,
    capture,
    compile_fresh,
    forbid_host_sync,
    full_run,
    gpu_test_device,
    poison,
    special_table,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
FULL = pytest.mark.skipif(not full_run(), reason="more shapes: MOE_GPU_FULL=1")
POISON = 0x5A  # what fresh outputs start as (not 0xFF: the scale byte of inf / NaN blocks)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# the interpreter truncates fp32 -> bf16 (bf16 subnormal results differ): fp32 / fp16 there
OUT_DTYPES = (F32, BF16, F16) if ON_GPU else (F32, F16)


def make_x(M: int, K: int, dtype: torch.dtype, seed: int, spread: int = 60) -> torch.Tensor:
    """Random rows at magnitudes 2**+-spread (+-10 for fp16), with a zero block, NaN, -inf,
    a block of powers of two, a saturating block, 448's successor and (fp32) subnormals."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-10, 10) if dtype == F16 else (-spread, spread)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(lo, hi, (M, 1), generator=g))
    if M >= 8 and K >= 64:
        x[0, :32] = 0.0
        x[1, 5] = float("nan")
        x[2, 40] = float("-inf")
        x[3, :32] = torch.exp2(torch.arange(32.0) - 16)
        x[4, :32] = 448.0 * 2.0**-3
        x[5, 0] = torch.tensor(448.0).nextafter(torch.tensor(1e9)).item()
        if dtype == F32:
            x[6, :32] = 1e-40
    return x.to(dtype)


CAST_CASES = [  # the last two shapes with MOE_GPU_FULL=1
    pytest.param(M, K, dtype, id=f"{M}x{K}-{str(dtype)[6:]}", marks=() if i < 2 else FULL)
    for i, (M, K) in enumerate(((520, 2048), (1024, 96), (64, 4096), (4096, 1024)))
    for dtype in (F32, BF16, F16)
]


@pytest.mark.parametrize("M,K,dtype", CAST_CASES)
def test_casts_and_dequant_match_the_reference(M, K, dtype):
    x = make_x(M, K, dtype, seed=M + K)
    xd = x.to(DEV)
    rows = M // 32 * 32
    for mode in ("floor", "rceil"):
        poison(M * K * 4, byte=POISON, device=DEV)
        d, s = mk.to_mxfp8(xd, scaling_mode=mode)
        assert bits_equal((d, s), ref.to_mxfp8(x, mode)), mode
        poison(M * K * 4, byte=POISON, device=DEV)
        got = mk.to_mxfp8_dim1(xd[:rows], scaling_mode=mode)
        assert bits_equal(got, ref.to_mxfp8_dim1(x[:rows], mode)), mode
        for out_dtype in OUT_DTYPES:
            poison(M * K * 4, byte=POISON, device=DEV)
            back = mk.from_mxfp8(d, s, out_dtype)
            assert bits_equal(back, ref.from_mxfp8(d.cpu(), s.cpu(), out_dtype)), out_dtype


def test_dequant_of_every_byte_with_every_scale():
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # (256, 256)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    for out_dtype in OUT_DTYPES:
        got = mk.from_mxfp8(data.to(DEV), scale.to(DEV), out_dtype)
        assert bits_equal(got, ref.from_mxfp8(data, scale, out_dtype)), out_dtype


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("width", [0, 64], ids=["masked", "unmasked"])
def test_special_value_blocks(dtype, width):
    """The special-value table (``moe_kernels.testing.SPECIAL_CASES``: bytes worked out by hand),
    one block of 32 a row (dim1: down a column), against the table's bytes and the reference;
    ``width`` > 0 repeats the cases cyclically to that many rows (unmasked tiles)."""
    pytest.importorskip("numpy")
    for mode in ("floor", "rceil"):
        names, x, want_s, want_d = special_table(dtype, mode)
        idx = [i % len(names) for i in range(width or len(names))]
        x, want_s, want_d = x[idx], torch.from_numpy(want_s[idx]), torch.from_numpy(want_d[idx])
        xt = x.t().contiguous()
        d, s = mk.to_mxfp8(x.to(DEV), scaling_mode=mode)
        assert torch.equal(s.view(torch.uint8).cpu()[:, 0], want_s), (mode, "scales")
        assert torch.equal(d.view(torch.uint8).cpu(), want_d), (mode, "data")
        assert bits_equal((d, s), ref.to_mxfp8(x, mode)), mode
        got = mk.to_mxfp8_dim1(xt.to(DEV), scaling_mode=mode)
        assert bits_equal(got, ref.to_mxfp8_dim1(xt, mode)), mode
        assert bits_equal(got, (d, s)), (mode, "dim1 of the transpose != dim0")
        nan = torch.isnan(mk.from_mxfp8(d, s, torch.float32)).cpu()
        assert torch.equal(nan, (want_s == 255)[:, None].expand(-1, 32)), (mode, "NaN blocks")


def random_ends(R: int, G: int, seed: int) -> torch.Tensor:
    """(G,) int32 non-decreasing end offsets, last = R, some groups empty."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, R + 1, (G - 1,), generator=g).sort().values
    return torch.cat([cuts, torch.tensor([R])]).to(torch.int32)


def ends_multiple_of_32(R: int, G: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cut = torch.randperm(R // 32 - 1, generator=g)[: G - 1] + 1
    return torch.cat([torch.sort(cut).values * 32, torch.tensor([R])]).to(torch.int32)


LAYOUT_2D = [  # (R, C, ends): explicit, random (empty groups), or multiples of 32
    ((300, 7), torch.tensor([0, 1, 129, 129, 300])),
    ((2048, 1), random_ends(2048, 128, 1)),
    ((20000, 37), random_ends(20000, 40, 2)),
    ((2048, 3), random_ends(2048, 8, 3)),
    ((131072, 15), random_ends(131072, 128, 4)),
    ((5000, 64), ends_multiple_of_32(5000, 40, 5)),
    ((16640, 160), ends_multiple_of_32(16640, 16, 6)),
    ((131072, 224), ends_multiple_of_32(131072, 8, 7)),
    ((524288, 256), ends_multiple_of_32(524288, 8, 8)),
]


@pytest.mark.parametrize("shape,ends", LAYOUT_2D, ids=[str(c[0]) for c in LAYOUT_2D])
def test_blocked_layout_2d_and_group_offsets(shape, ends):
    R, C = shape
    if not ON_GPU and R > 300:  # CPU smoke: a small R
        R, ends = 300, random_ends(300, 5, 9)
    s = torch.randint(0, 256, (R, C), generator=torch.Generator().manual_seed(R + C),
                      dtype=torch.uint8)  # fmt: skip
    want, want_rows = ref.to_blocked_per_group_2d(s, ends)
    n = int(want_rows[-1])
    poison(s.numel() * 2 + 128 * len(ends) * C, byte=POISON, device=DEV)
    got, rows = mk.to_blocked_per_group_2d(s.to(DEV), ends.to(DEV))
    assert torch.equal(rows.cpu(), want_rows) and bits_equal(got[:n], want[:n])
    sizes, starts = mk.compute_per_group_blocked_scale_offsets(ends.to(DEV))
    want_sizes, want_starts = ref.compute_per_group_blocked_scale_offsets(ends)
    assert torch.equal(sizes.cpu(), want_sizes) and torch.equal(starts.cpu(), want_starts)


@pytest.mark.parametrize("E,N,C", [(3, 130, 5), (1, 100, 3), (8, 2048, 224), (8, 7168, 64),
                                   (16, 4096, 64), (64, 7168, 37)])  # fmt: skip
def test_blocked_layout_3d_and_to_blocked(E, N, C):
    s = torch.randint(0, 256, (E, N, C), generator=torch.Generator().manual_seed(E * N + C),
                      dtype=torch.uint8)  # fmt: skip
    poison(s.numel() * 2, byte=POISON, device=DEV)
    assert bits_equal(mk.to_blocked_per_group_3d(s.to(DEV)), ref.to_blocked_per_group_3d(s))
    assert bits_equal(mk.to_blocked(s[0].to(DEV)), ref.to_blocked(s[0]))


def grouped_problem(M, K, N, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g))
    b = torch.randn(len(sizes), K, N, generator=g) * 0.1
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return a.bfloat16(), b.bfloat16(), ends


def test_grouped_mm_matches_the_dequantised_loop():
    sizes = [100, 0, 333, 1, 590, 0, 7, 1000]
    M = sum(sizes) + 16
    a, b, ends = grouped_problem(M, 256, 64, sizes, seed=1)
    poison(M * 1024 * 4, byte=POISON, device=DEV)
    got = mk.mxfp8_grouped_mm(a.to(DEV), b.to(DEV), ends.to(DEV)).cpu()
    b_deq = [ref.from_mxfp8(*ref.to_mxfp8_dim1(b[e], "rceil")).t() for e in range(len(sizes))]
    want = ref.grouped_mm_dequantized(ref.from_mxfp8(*ref.to_mxfp8(a, "rceil")),
                                      torch.stack(b_deq), ends, torch.float32)  # fmt: skip
    rel = ((got.float() - want).abs() / (want.abs() + 1e-3)).max().item()
    assert rel <= 2.0**-7, f"max relative error {rel:.3g}: more than one bf16 rounding"
    assert bool((got[sum(sizes) :] == 0).all()), "rows past the last group must be zero"


def all_ops(x, s2, ends, s3, a, b, ga_ends):
    d, sc = mk.to_mxfp8(x)
    d1, s1 = mk.to_mxfp8_dim1(x)
    back = mk.from_mxfp8(d, sc)
    blk2, rows = mk.to_blocked_per_group_2d(s2, ends)
    live = torch.arange(blk2.shape[0], device=blk2.device)[:, None] < rows[-1]
    blk2 = torch.where(live, blk2, 0)  # rows past the last group's are unspecified
    blk3 = mk.to_blocked_per_group_3d(s3)
    blk = mk.to_blocked(s2)
    sizes, rows2 = mk.compute_per_group_blocked_scale_offsets(ends)
    out = mk.mxfp8_grouped_mm(a, b, ga_ends)
    return d, sc, d1, s1, back, blk2, rows, blk3, blk, sizes, rows2, out


def test_no_host_sync_graph_replay_and_compile():
    x = make_x(256, 512, BF16, seed=3, spread=4).to(DEV)
    s2 = torch.randint(0, 256, (1000, 36), dtype=torch.uint8, device=DEV)
    ends = torch.tensor([100, 100, 513, 1000], dtype=torch.int32, device=DEV)
    s3 = torch.randint(0, 256, (4, 200, 8), dtype=torch.uint8, device=DEV)
    a, b, ga_ends = (t.to(DEV) for t in grouped_problem(300, 128, 64, [40, 0, 200, 44], seed=4))
    args = (x, s2, ends, s3, a, b, ga_ends)
    eager = all_ops(*args)
    if ON_GPU:
        torch.cuda.synchronize()
        with forbid_host_sync():  # the ops only: the comparison itself reads the device
            again = all_ops(*args)
        assert bits_equal(again, eager)
        graph, static = capture(lambda: all_ops(*args))
        graph.replay()
        torch.cuda.synchronize()
        assert bits_equal(static, eager)
    assert bits_equal(compile_fresh(all_ops)(*args), eager)
