"""Hostile offsets, indices, counts and bounds (contract violations that live in device tensors
and so are never checked: no host sync) fed to the MXFP8 layout and cast ops, the grouped GEMM,
the row-wise FP8 quantisers, the padded scatter-add and the EP reshuffles.

Each case checks, on the path this session runs (the torch reference with TRITON_INTERPRET=0,
the Triton kernels in the interpreter with TRITON_INTERPRET=1, CUDA in the ``gpu`` tests):

* no crash, and every input (a ``moe_kernels.testing.guarded`` view) and every output the
  kernels allocate (``torch.empty`` in the kernel module made guarded) keeps its guard bytes: no
  store outside a tensor; a stray read would bring guard bytes into the results, which the next
  checks see;
* the documented clamping rule: the result equals the op's result on the sanitised inputs (the
  rule applied here in plain Python);
* where the kernels run: the result equals the reference path's (``use_triton`` patched off) on
  the same hostile inputs, bit for bit (within the GPU's documented differences on CUDA);
* under ``torch.compile(fullgraph=True)`` the clamps need no sync and give the eager results.

The findings of issue 45 in this file: ``to_blocked_per_group_2d`` with an end offset past R
(``[end_past_R]``: the interpreter's kernel wrote past its output and corrupted the heap, the
reference raised IndexError; ``test_to_blocked_per_group_2d_no_rows_or_columns`` crashed the
interpreter), ``silu_mul_quant`` with a negative ``scale_ub``
(``test_silu_mul_quant_negative_bound_is_floored``: negative scales, sign-flipped data),
negative sizes and int32 overflow from ``compute_per_group_blocked_scale_offsets``, and counts
whose int64 sums wrapped (padded scatter-add, reshuffles).
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels.gather_quant as gq_mod
import moe_kernels.mxfp8 as mx
import moe_kernels.padded_tokens as pt_mod
import moe_kernels.shuffling as sh_mod
import moe_kernels.swiglu as sw_mod
from moe_kernels.testing import GuardHarness

CPU = torch.device("cpu")
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
KERNEL_MODULES = ("mxfp8_layout", "mxfp8_quant", "swiglu", "gather_quant", "padded_tokens",
                  "shuffling")  # fmt: skip


# --------------------------------------------------------------------------------------------
# harness


def harness(monkeypatch, device: torch.device, guard_outputs: bool = True) -> GuardHarness:
    return GuardHarness(monkeypatch, device, KERNEL_MODULES, guard_outputs=guard_outputs)


@pytest.fixture
def cpu(monkeypatch):
    return harness(monkeypatch, CPU)


@pytest.fixture
def cuda(monkeypatch):
    return harness(monkeypatch, torch.device("cuda"))


def on_gpu(fn):
    """A ``gpu`` test: skipped without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(fn))


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    ai, bi = a.cpu().contiguous(), b.cpu().contiguous()
    if ai.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        ai, bi = ai.view(ints[ai.element_size()]), bi.view(ints[bi.element_size()])
    assert torch.equal(ai, bi), f"{(ai != bi).sum()} of {ai.numel()} elements differ"


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int, signed_zero: bool = True) -> None:
    """Float tensors within ``ulps`` units in the last place (same signs; NaN where NaN; with
    ``signed_zero=False`` -0 equals +0)."""
    ints = {2: torch.int16, 4: torch.int32}
    nan = a.cpu().isnan()
    assert torch.equal(nan, b.cpu().isnan())
    skip = nan if signed_zero else nan | ((a.cpu() == 0) & (b.cpu() == 0))
    ai = a.cpu().contiguous().view(ints[a.element_size()]).long()[~skip]
    bi = b.cpu().contiguous().view(ints[b.element_size()]).long()[~skip]
    assert (ai - bi).abs().max() <= ulps if ai.numel() else True


def e4m3_close(a: torch.Tensor, b: torch.Tensor, steps: int) -> None:
    """e4m3 bytes within ``steps`` codes (same sign bit)."""
    ai, bi = u8(a).cpu().long(), u8(b).cpu().long()
    assert torch.equal(ai >> 7, bi >> 7)
    assert ((ai & 0x7F) - (bi & 0x7F)).abs().max() <= steps if ai.numel() else True


def clamp_ends(ends: list[int], bound: int) -> list[int]:
    """The documented rule: each end into [previous clamped end, bound], 0 before the first."""
    out, prev = [], 0
    for e in ends:
        prev = min(max(e, prev), bound)
        out.append(prev)
    return out


def rand_u8(shape, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, shape, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)  # fmt: skip


def randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------------------------
# MXFP8 layouts: group offsets

HOSTILE_ENDS = {
    "end_past_R": ([32, 200], torch.int32),  # the finding
    "first_past_R": ([200, 64], torch.int32),
    "decreasing": ([50, 10, 40], torch.int32),
    "negative": ([-5, 30, -1, 64], torch.int32),
    "int32_max": ([I32_MAX, 5], torch.int32),
    "int32_min": ([I32_MIN, I32_MAX, I32_MIN], torch.int32),
    "int64_huge": ([2**40, 2**62, -(2**62)], torch.int64),
    "empty_groups": ([0, 0, 64, 64], torch.int64),
    "all_empty": ([0], torch.int32),
}


def check_per_group_2d(h: GuardHarness, case: str, R: int = 64, C: int = 5) -> None:
    ends, dtype = HOSTILE_ENDS[case]
    G = len(ends)
    scales = h.g(rand_u8((R, C), seed=R + G))
    offs = h.g(torch.tensor(ends, dtype=dtype))
    blocked, start_rows = mx.to_blocked_per_group_2d(scales, offs)
    h.intact()
    assert blocked.shape == (R + 128 * G, -(-C // 4) * 4)
    n = int(start_rows[-1])
    clean = torch.tensor(clamp_ends(ends, R), dtype=torch.int32, device=h.device)
    want_blocked, want_rows = mx.to_blocked_per_group_2d(scales, clean)
    same_bits(start_rows, want_rows)
    same_bits(blocked[:n], want_blocked[:n])  # rows past start_rows[G] are unspecified
    ref = h.reference_in((mx,), mx.to_blocked_per_group_2d, scales, offs)
    if ref is not None:
        same_bits(start_rows, ref[1])
        same_bits(blocked[:n], ref[0][:n])
    h.intact()


@pytest.mark.parametrize("case", list(HOSTILE_ENDS))
def test_to_blocked_per_group_2d_hostile_offsets(cpu, case):
    check_per_group_2d(cpu, case)


def test_to_blocked_per_group_2d_no_rows_or_columns(cpu):
    for R, C in ((0, 4), (64, 0)):
        check_per_group_2d(cpu, "end_past_R", R, C)


def check_group_offsets(h: GuardHarness, case: str) -> None:
    ends, dtype = HOSTILE_ENDS[case]
    G = len(ends)
    offs = h.g(torch.tensor(ends, dtype=dtype))
    sizes, start_rows = mx.compute_per_group_blocked_scale_offsets(offs)
    h.intact()
    clean = clamp_ends(ends, I32_MAX - 127 * G)
    want_sizes = [b - a for a, b in zip([0] + clean[:-1], clean, strict=True)]
    want_rows = [0]
    for s in want_sizes:
        want_rows.append(want_rows[-1] + -(-s // 128) * 128)
    assert sizes.tolist() == want_sizes and start_rows.tolist() == want_rows
    ref = h.reference_in((mx,), mx.compute_per_group_blocked_scale_offsets, offs)
    if ref is not None:
        same_bits(sizes, ref[0])
        same_bits(start_rows, ref[1])


@pytest.mark.parametrize("case", list(HOSTILE_ENDS))
def test_compute_per_group_blocked_scale_offsets_hostile(cpu, case):
    check_group_offsets(cpu, case)


def test_to_blocked_per_group_2d_host_checks(monkeypatch):
    def reached(*args):
        raise AssertionError("the op ran: its int32 row arithmetic would overflow")

    # a missing check must fail here, not allocate the (2**31 + 128, 4) output
    monkeypatch.setattr(mx.to_blocked_per_group_2d_op, "call", reached)
    s = torch.zeros(1, 1, dtype=torch.uint8).expand(2**31, 1)  # no memory behind the rows
    with pytest.raises(ValueError, match="scales' rows plus 128 per group"):
        mx.to_blocked_per_group_2d(s, torch.tensor([5]))
    with pytest.raises(ValueError, match="group_end_offsets must hold between 1"):
        mx.compute_per_group_blocked_scale_offsets(torch.zeros(0, dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# MXFP8 layouts without offsets (shapes only) and the casts: odd sizes, strided and empty inputs


LAYOUT_SHAPES = [(1, 1, 1), (2, 130, 5), (3, 0, 4), (0, 7, 3), (1, 129, 0)]


def check_layouts(h: GuardHarness) -> None:
    for shape in LAYOUT_SHAPES:
        s3 = h.g(rand_u8(shape, seed=sum(shape)))
        outs = [mx.to_blocked_per_group_3d(s3), mx.to_blocked(s3[0]) if shape[0] else None]
        strided = h.g(rand_u8((shape[2], shape[1]), seed=1)).t()  # (N, C), column-major
        outs.append(mx.to_blocked(strided))
        h.intact()
        refs = [
            h.reference_in((mx,), mx.to_blocked_per_group_3d, s3),
            h.reference_in((mx,), mx.to_blocked, s3[0]) if shape[0] else None,
            h.reference_in((mx,), mx.to_blocked, strided),
        ]
        for got, ref in zip(outs, refs, strict=True):
            if ref is not None and got is not None:
                same_bits(got, ref)


def test_blocked_layouts_odd_shapes(cpu):
    check_layouts(cpu)


SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3e38, 1e-40, 448.0, 480.0]


def hostile_floats(shape, seed: int) -> torch.Tensor:
    x = randn(shape, seed) * 100
    flat = x.view(-1)
    for i, v in enumerate(SPECIALS):
        flat[(i * 37) % flat.numel()] = v
    return x


def check_casts(h: GuardHarness) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for mode in mx.SCALING_MODES:
            x = h.g(hostile_floats((3, 96), seed=3).to(dtype))
            x_strided = h.g(hostile_floats((96, 64), seed=4).to(dtype))[:, 5:37:1]  # (96, 32)
            y = h.g(hostile_floats((64, 5), seed=5).to(dtype))
            calls = ((mx.to_mxfp8, x), (mx.to_mxfp8, x_strided), (mx.to_mxfp8_dim1, y))
            outs = [fn(arg, scaling_mode=mode) for fn, arg in calls]
            h.intact()
            for got, (fn, arg) in zip(outs, calls, strict=True):
                ref = h.reference_in((mx,), fn, arg, scaling_mode=mode)
                if ref is not None:
                    same_bits(u8(got[0]), u8(ref[0]))
                    same_bits(u8(got[1]), u8(ref[1]))
    # dequantisation of every byte pattern, scales 0, 127, 254 and 255 (NaN) included; bf16
    # without subnormal results (the interpreter's bf16 cast mangles those: not a kernel issue)
    data = h.g(torch.arange(256, dtype=torch.uint8).repeat(2).view(4, 128))
    scales = {torch.float32: [0, 127, 254, 255], torch.bfloat16: [100, 127, 200, 255]}
    for out_dtype, row in scales.items():
        scale = h.g(torch.tensor([row] * 4, dtype=torch.uint8))
        got = mx.from_mxfp8(data, scale, out_dtype)
        h.intact()
        ref = h.reference_in((mx,), mx.from_mxfp8, data, scale, out_dtype)
        if ref is not None:
            # the interpreter truncates the bf16 store where the GPU and torch round, and
            # Triton 3.5's drops the sign of -0
            cpu = h.device.type == "cpu"
            ulps = 1 if out_dtype == torch.bfloat16 and cpu else 0
            within_ulps(got, ref, ulps, signed_zero=not cpu)


def test_casts_special_values_and_strides(cpu):
    check_casts(cpu)


# --------------------------------------------------------------------------------------------
# mxfp8_grouped_mm: hostile offsets, forward and backward

HOSTILE_MM_OFFSETS = {
    "end_past_M": [10, 100, 30],
    "decreasing": [40, 20, 10],
    "negative": [-3, 20, 5],
    "int32_max": [I32_MAX] * 3,
    "int32_min": [I32_MIN, 7, I32_MIN],
    "empty": [0, 0, 0],
}


def check_grouped_mm(h: GuardHarness, case: str, backward: bool) -> None:
    M, K, E, N = 40, 64, 3, 16
    ends = HOSTILE_MM_OFFSETS[case]
    a = h.g(randn((M, K), 1, torch.bfloat16))
    b = h.g(randn((E, K, N), 2, torch.bfloat16))
    offs = h.g(torch.tensor(ends, dtype=torch.int32))
    clean = torch.tensor(clamp_ends(ends, M), dtype=torch.int32, device=h.device)

    def run(offsets, path=None):
        aa, bb = a.detach().requires_grad_(backward), b.detach().requires_grad_(backward)
        fn = lambda: mx.mxfp8_grouped_mm(aa, bb, offsets)  # noqa: E731
        out = fn() if path is None else h.reference_in((mx,), fn)
        if out is None:
            return None
        if not backward:
            return (out,)
        out.backward(randn((M, N), 3, torch.bfloat16).to(h.device))
        return out.detach(), aa.grad, bb.grad

    got = run(offs)
    h.intact()
    for x, y in zip(got, run(clean), strict=True):  # the documented clamp: same path, same bits
        same_bits(x, y)
    assert got[0][clean[-1] :].eq(0).all()  # rows past the clamped last offset are zero
    ref = run(offs, path="reference")
    if ref is not None:
        for x, y in zip(got, ref, strict=True):
            if h.device.type == "cpu":
                within_ulps(x, y, 1)
            else:  # cuBLAS / CUTLASS sum in another order than the reference's masked GEMMs
                torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)
    h.intact()


@pytest.mark.parametrize("case", list(HOSTILE_MM_OFFSETS))
def test_mxfp8_grouped_mm_hostile_offsets(cpu, case):
    check_grouped_mm(cpu, case, backward=False)


@pytest.mark.parametrize("case", ["end_past_M", "decreasing", "int32_min"])
def test_mxfp8_grouped_mm_backward_hostile_offsets(cpu, case):
    check_grouped_mm(cpu, case, backward=True)


def test_mxfp8_grouped_mm_no_experts(cpu):
    a = randn((8, 32), 1, torch.bfloat16).requires_grad_()
    b = randn((0, 32, 4), 2, torch.bfloat16).requires_grad_()
    out = mx.mxfp8_grouped_mm(a, b, torch.zeros(0, dtype=torch.int32))
    assert out.shape == (8, 4) and out.eq(0).all()
    out.sum().backward()
    assert a.grad.eq(0).all() and b.grad.shape == b.shape


def check_compiled(h: GuardHarness, case: str) -> None:
    """The clamps under ``torch.compile(fullgraph=True)`` (no sync, no graph break; on CUDA the
    layout kernels traced into Inductor's code, the backward's clamp compiled): the eager bits."""
    ends, dtype = HOSTILE_ENDS[case]
    scales = h.g(rand_u8((64, 5), seed=1))
    offs = h.g(torch.tensor(ends, dtype=dtype))
    M, K, E, N = 40, 64, 3, 16
    a = h.g(randn((M, K), 1, torch.bfloat16))
    b = h.g(randn((E, K, N), 2, torch.bfloat16))
    m_ends = HOSTILE_MM_OFFSETS.get(case, HOSTILE_MM_OFFSETS["int32_min"])
    m_offs = h.g(torch.tensor(m_ends, dtype=torch.int32))
    dy = randn((M, N), 3, torch.bfloat16).to(h.device)

    def f(scales, offs, a, b, m_offs):
        blocked, start_rows = mx.to_blocked_per_group_2d(scales, offs)
        sizes, rows2 = mx.compute_per_group_blocked_scale_offsets(offs)
        return blocked, start_rows, sizes, rows2, mx.mxfp8_grouped_mm(a, b, m_offs)

    def run(fn):
        aa, bb = a.detach().requires_grad_(), b.detach().requires_grad_()
        blocked, start_rows, sizes, rows2, out = fn(scales, offs, aa, bb, m_offs)
        out.backward(dy)
        n = int(start_rows[-1])
        return blocked[:n], start_rows, sizes, rows2, out.detach(), aa.grad, bb.grad

    torch._dynamo.reset()
    eager = run(f)
    compiled = run(torch.compile(f, fullgraph=True))
    h.intact()
    for x, y in zip(eager[:4], compiled[:4], strict=True):  # the layouts: integer data
        same_bits(x, y)
    for x, y in zip(eager[4:], compiled[4:], strict=True):  # the GEMM and its gradients
        if h.device.type == "cpu":
            same_bits(x, y)
        else:  # Inductor may fuse the backward's elementwise steps in another order
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["end_past_R", "decreasing", "int64_huge"])
def test_hostile_offsets_compiled(cpu, case):
    check_compiled(cpu, case)


# --------------------------------------------------------------------------------------------
# row-wise FP8: silu_mul, silu_mul_quant, gather_scale_quant_dense_tokens

INF, NAN = float("inf"), float("nan")
HOSTILE_UB = [-1.0, 0.0, -INF, NAN, INF, 1e-30, 1e-45, 1e-12, 0.5]
HOSTILE_VTC = [([-5], torch.int32), ([I32_MAX], torch.int32), ([I32_MIN], torch.int32),
               ([2**62], torch.int64), ([-(2**62)], torch.int64), ([0], torch.int64),
               ([3], torch.int32)]  # fmt: skip


def silu_inputs(h: GuardHarness, T: int = 5, D: int = 48):
    """x0 in {20, -100}: silu(x0) is exactly x0 or -0 on every path (sigmoid(20) rounds to 1)."""
    pick = torch.rand((T, D), generator=torch.Generator().manual_seed(7)) < 0.8
    x0 = torch.where(pick, 20.0, -100.0)
    return h.g(x0), h.g(randn((T, D), 8))


def ub_floor(ub: float) -> float:
    """The documented rule: a bound below 1e-12 acts as 1e-12 (NaN: no bound)."""
    e = float(torch.tensor(1e-12, dtype=torch.float32))
    return ub if ub != ub else max(ub, e)


def check_silu(h: GuardHarness) -> None:
    x0, x1 = silu_inputs(h)
    live_T = None
    for vtc, dtype in HOSTILE_VTC:
        v = h.g(torch.tensor(vtc, dtype=dtype))
        y = sw_mod.silu_mul(x0, x1, v)
        q, s = sw_mod.silu_mul_quant(x0, x1, None, v)
        h.intact()
        live_T = torch.arange(x0.shape[0], device=h.device) < min(max(vtc[0], 0), x0.shape[0])
        assert y[~live_T].eq(0).all() and q.view(torch.uint8)[~live_T].eq(0).all()
        assert s[~live_T].eq(0).all() and s[live_T].gt(0).all()
        ref_y = h.reference_in((sw_mod,), sw_mod.silu_mul, x0, x1, v)
        ref_q = h.reference_in((sw_mod,), sw_mod.silu_mul_quant, x0, x1, None, v)
        if ref_y is not None:
            same_bits(y, ref_y)
            check_quant(h, (q, s), ref_q)
    for ub in HOSTILE_UB:
        bound = h.g(torch.tensor([ub]))
        q, s = sw_mod.silu_mul_quant(x0, x1, bound)
        h.intact()
        assert s.gt(0).all() and s.isfinite().all(), f"scale_ub={ub}"  # never sign-flipped
        want = sw_mod.silu_mul_quant(x0, x1, torch.tensor([ub_floor(ub)], device=h.device))
        same_bits(u8(q), u8(want[0]))
        same_bits(s, want[1])
        check_quant(h, (q, s), h.reference_in((sw_mod,), sw_mod.silu_mul_quant, x0, x1, bound))


def check_quant(h: GuardHarness, got, ref) -> None:
    if ref is None:
        return
    if h.device.type == "cpu":  # IEEE division in the interpreter too: the same bits
        same_bits(u8(got[0]), u8(ref[0]))
        same_bits(got[1], ref[1])
    else:  # the GPU divides like FBGEMM (div.full.f32): scales within 2 ulp, data one step
        e4m3_close(got[0], ref[0], 1)
        within_ulps(got[1], ref[1], 2)


def test_silu_mul_and_quant_hostile_counts_and_bounds(cpu):
    check_silu(cpu)


def test_silu_mul_quant_negative_bound_is_floored(cpu):
    """The finding: scale_ub = -1 gave negative scales and sign-flipped data."""
    x0, x1 = silu_inputs(cpu)
    q, s = sw_mod.silu_mul_quant(x0, x1, torch.tensor([-1.0]))
    assert s.gt(0).all()
    v = x0 * torch.sigmoid(x0) * x1
    bits = q.view(torch.uint8)
    nonzero = bits & 0x7F != 0
    assert torch.equal((bits >> 7)[nonzero].bool(), v.signbit()[nonzero])


GATHER_TOKENS = [
    ([0, -1, 6, 100, I32_MIN, I32_MAX, 5, 3], torch.int32),
    ([2**40, -(2**40), 5, 0, 7, 2, 1, 1], torch.int64),
]
GATHER_EXPERTS = [
    ([0, 1, 2, 3, -1, I32_MAX, 1, I32_MIN], torch.int32),
    ([2**40, 0, 1, 2, -(2**62), 1, 0, 2], torch.int64),
]


def check_gather(h: GuardHarness) -> None:
    T, D, E = 6, 40, 3
    x = h.g(randn((T, D), 11) * 50)
    scores = h.g(randn((T, E), 12))
    for (tok, tdt), (exp, edt) in zip(GATHER_TOKENS, GATHER_EXPERTS, strict=True):
        t_idx, e_idx = h.g(torch.tensor(tok, dtype=tdt)), h.g(torch.tensor(exp, dtype=edt))
        for vtc, ub in ((None, None), (I32_MAX, -1.0), (-3, 0.5), (2**62, NAN)):
            v = None if vtc is None else h.g(torch.tensor([vtc]))
            bound = None if ub is None else h.g(torch.tensor([ub]))
            q, s = gq_mod.gather_scale_quant_dense_tokens(x, t_idx, e_idx, scores, bound, v)
            h.intact()
            dead = [not (0 <= a < T and 0 <= b < E) for a, b in zip(tok, exp, strict=True)]
            clean_t = torch.tensor(
                [-1 if d else a for a, d in zip(tok, dead, strict=True)], device=h.device
            )
            clean_e = torch.tensor(
                [-1 if d else b for b, d in zip(exp, dead, strict=True)], device=h.device
            )
            fb = None if ub is None else torch.tensor([ub_floor(ub)], device=h.device)
            want = gq_mod.gather_scale_quant_dense_tokens(x, clean_t, clean_e, scores, fb, v)
            same_bits(u8(q), u8(want[0]))
            same_bits(s, want[1])
            assert s.ge(0).all()
            ref = h.reference_in((gq_mod,), gq_mod.gather_scale_quant_dense_tokens, x, t_idx, e_idx,
                              scores, bound, v)  # fmt: skip
            check_quant(h, (q, s), ref)


def test_gather_scale_quant_hostile_indices(cpu):
    check_gather(cpu)


# --------------------------------------------------------------------------------------------
# scatter_add_padded_tokens: hostile counts and indices

PADDED_COUNTS = [
    ([5, 2**63 - 1, 2**63 - 1], torch.int64),  # int64 sums wrap: ranks past EP before the clamp
    ([-5, 3, I32_MAX], torch.int32),
    ([2, -1, 100], torch.int64),
    ([0, 0, 0], torch.int32),
    ([I32_MIN, I32_MIN, 4], torch.int32),
]
PADDED_INDICES = [
    ([0, 5, -1, 6, I32_MAX, I32_MIN, 3, 3], torch.int32),
    ([2**40, 0, 1, 2, 3, 4, 5, -(2**40)], torch.int64),
]


def check_padded(h: GuardHarness) -> None:
    EP, P, D, T = 3, 8, 16, 6
    in_t = h.g(randn((EP, P, D), 21))
    for counts, cdt in PADDED_COUNTS:
        for idx, idt in PADDED_INDICES:
            c_t, i_t = h.g(torch.tensor(counts, dtype=cdt)), h.g(torch.tensor(idx, dtype=idt))
            out = h.g(randn((T, D), 22))
            start = out.clone()
            pt_mod.scatter_add_padded_tokens(in_t, c_t, i_t, out)
            h.intact()
            clean_c = torch.tensor([min(max(c, 0), P) for c in counts], device=h.device)
            clean_i = torch.tensor([i if 0 <= i < T else -1 for i in idx], device=h.device)
            want = start.clone()
            pt_mod.scatter_add_padded_tokens(in_t, clean_c, clean_i, want)
            same_bits(out, want)
            if h.kernels:  # fp32 adds in ascending p on every path: the same bits
                ref = start.clone()
                h.reference_in((pt_mod,), pt_mod.scatter_add_padded_tokens, in_t, c_t, i_t, ref)
                same_bits(out, ref)


@pytest.mark.parametrize("plan", ["scan", "sorted"])
def test_scatter_add_padded_tokens_hostile(cpu, plan, monkeypatch):
    if plan == "sorted":
        if not cpu.kernels:
            pytest.skip("the Triton plans run under TRITON_INTERPRET=1")
        from moe_kernels._triton import padded_tokens as tri

        monkeypatch.setattr(tri, "_SCAN_WORK", -1)
    check_padded(cpu)


# --------------------------------------------------------------------------------------------
# combine_shuffling / split_shuffling: hostile counts

SHUFFLE_COUNTS = [
    ([[-5, 100, 3], [I32_MAX, 2, I32_MIN]], torch.int32),
    ([[2**62, 2**62, 2**62], [2**62, 5, 1]], torch.int64),  # sums wrap without the clamp
    ([[2**63 - 1, 3, 2], [1, 2**63 - 1, 2]], torch.int64),
    ([[0, 0, 0], [0, 0, 0]], torch.int32),
    ([[3, 4, 1], [2, 9, 7]], torch.int64),  # sums past T, past the padded blocks
]


def check_shuffling(h: GuardHarness) -> None:
    T, D = 12, 8
    tokens = h.g(randn((T, D), 31, torch.bfloat16))
    for counts, cdt in SHUFFLE_COUNTS:
        c_t = h.g(torch.tensor(counts, dtype=cdt))
        clean = torch.tensor([[min(max(c, 0), T) for c in row] for row in counts],
                             device=h.device)  # fmt: skip
        for start, end in ((0, 3), (1, 3), (2, 2)):
            for padded in (False, True):
                out, counts_out = sh_mod.combine_shuffling(tokens, c_t, start, end, padded)
                back = sh_mod.split_shuffling(tokens, c_t, start, end, padded)
                h.intact()
                same_bits(out, sh_mod.combine_shuffling(tokens, clean, start, end, padded)[0])
                same_bits(back, sh_mod.split_shuffling(tokens, clean, start, end, padded))
                ref = h.reference_in((sh_mod,), sh_mod.combine_shuffling, tokens, c_t, start, end,
                                  padded)  # fmt: skip
                if ref is not None:
                    same_bits(out, ref[0])
                    same_bits(counts_out, ref[1])
                    ref_back = h.reference_in((sh_mod,), sh_mod.split_shuffling, tokens, c_t, start,
                                           end, padded)  # fmt: skip
                    same_bits(back, ref_back)


def test_shuffling_hostile_counts(cpu):
    check_shuffling(cpu)


# --------------------------------------------------------------------------------------------
# the same hostile cases on CUDA (guards on the GPU's tensors)


@on_gpu
@pytest.mark.parametrize("case", list(HOSTILE_ENDS))
def test_gpu_to_blocked_per_group_2d(cuda, case):
    check_per_group_2d(cuda, case)
    check_group_offsets(cuda, case)


@on_gpu
def test_gpu_blocked_layouts_and_casts(cuda):
    check_layouts(cuda)
    check_casts(cuda)


@on_gpu
@pytest.mark.parametrize("case", list(HOSTILE_MM_OFFSETS))
def test_gpu_mxfp8_grouped_mm(cuda, case):
    check_grouped_mm(cuda, case, backward=True)


@on_gpu
@pytest.mark.parametrize("case", ["end_past_R", "decreasing", "int64_huge"])
def test_gpu_hostile_offsets_compiled(monkeypatch, case):
    # outputs unguarded: Inductor traces the launchers (and their allocations) on CUDA
    check_compiled(harness(monkeypatch, torch.device("cuda"), guard_outputs=False), case)


@on_gpu
def test_gpu_silu_mul_and_quant(cuda):
    check_silu(cuda)


@on_gpu
def test_gpu_gather_scale_quant(cuda):
    check_gather(cuda)


@on_gpu
def test_gpu_scatter_add_padded_tokens(cuda):
    check_padded(cuda)


@on_gpu
def test_gpu_shuffling(cuda):
    check_shuffling(cuda)
