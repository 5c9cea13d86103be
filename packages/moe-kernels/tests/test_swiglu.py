"""silu_mul / silu_mul_quant against naive loop oracles, on the torch reference path
(TRITON_INTERPRET=0) and on the Triton kernels in the interpreter (TRITON_INTERPRET=1); the sm_90a
compiles of every GPU launch the launchers pick (no GPU needed; skipped in the interpreter).

The quantisation oracle (``oracle_quant_rows`` of moe_kernels.testing) is a per-row numpy
loop: NaN-free maximum, fp32 IEEE divisions, e4m3 rounding by nearest-value search over the code
table (``oracle_e4m3_bits``). Everything after the SiLU value is exact on every path, so quantised
results are compared bit for bit. The SiLU value itself uses exp, whose fp32 result differs
between torch (the reference) and numpy (the interpreter) by up to 2 ulp; through
``1 / (1 + e)`` and the two products (each rounded on both sides) that is at most
2 + 2 + 1 + 1 + 2 = 8 fp32 ulps (``FP32_ULPS``), and one ulp of a bf16/fp16 result (the
interpreter also truncates fp32 -> bf16). So in the interpreter silu_mul is compared within those
ulps, and silu_mul_quant exactly against the quantisation of the kernel's own fp32 SiLU values
(``silu_mul`` of fp32 inputs: the same expression) and within one e4m3 step of the reference.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_kernels import _dispatch
from moe_kernels import swiglu as sm
from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.reference import swiglu as ref
from moe_kernels.swiglu import Fp8Rows, silu_mul, silu_mul_quant
from moe_kernels.testing import (
    IEEE_DIV_PTX,
    assert_quant,
    assert_same_bits,
    assert_within_ulps,
    compile_launches,
    oracle_quant_rows,
    oracle_silu_mul,
    written_arguments,
)

CPU = torch.device("cpu")
KERNELS = use_triton(CPU)  # the Triton kernels, in the interpreter
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
FP32_ULPS = 8
needs_kernels = pytest.mark.skipif(not KERNELS, reason="runs the Triton launchers: needs INTERPRET")
INF, NAN = float("inf"), float("nan")


def live_list(n: int, vtc: int | None) -> list[bool] | None:
    return None if vtc is None else [i < vtc for i in range(n)]


# --------------------------------------------------------------------------------------------
# comparisons (bitwise ones: moe_kernels.testing)


def assert_silu(got: torch.Tensor, want32: torch.Tensor) -> None:
    """silu_mul's result against the fp32 oracle value: exact on the reference path, within the
    exp-induced ulps (module docstring) in the interpreter."""
    want = want32.to(got.dtype)
    assert got.is_contiguous()
    if not KERNELS:
        assert_same_bits(got, want)
    else:
        assert_within_ulps(got, want, FP32_ULPS if got.dtype == torch.float32 else 1)


def rand(shape, dtype, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def pair(num_tokens, dim, dtype, seed, layout="halves"):
    """(x0, x1): FBGEMM's column halves of one (T, 2D) tensor, contiguous, or strided columns."""
    if layout == "halves":
        x = rand((num_tokens, 2 * dim), dtype, seed)
        return x[:, :dim], x[:, dim:]
    if layout == "contiguous":
        return rand((num_tokens, dim), dtype, seed), rand((num_tokens, dim), dtype, seed + 1)
    x = rand((dim, 2 * num_tokens + 1), dtype, seed)  # column-major, every other row
    return x[:, :num_tokens].t(), x[:, num_tokens + 1 :].t()


def count(value, n, dtype=torch.int64):
    """valid_token_count: None, 0, "partial" (about 2/3 of n) or an int."""
    if value is None:
        return None, None
    k = 2 * n // 3 + 1 if value == "partial" else value
    return torch.tensor([k], dtype=dtype), k


# --------------------------------------------------------------------------------------------
# silu_mul


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("num_tokens", "dim", "layout"),
    [(1, 1, "halves"), (5, 7, "contiguous"), (33, 130, "strided"), (6, 1030, "halves"),
     (4, 64, "strided")],
)  # fmt: skip
@pytest.mark.parametrize("vtc", [None, 0, "partial"])
def test_silu_mul_matches_oracle(dtype, num_tokens, dim, layout, vtc):
    x0, x1 = pair(num_tokens, dim, dtype, num_tokens + dim, layout)
    t_vtc, k = count(vtc, num_tokens, torch.int32 if vtc == 0 else torch.int64)
    got = silu_mul(x0, x1, t_vtc)
    assert got.shape == (num_tokens, dim) and got.dtype == dtype
    assert_silu(got, oracle_silu_mul(x0, x1, k))


@pytest.mark.parametrize("dim", [5120, 7168])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_silu_mul_fbgemm_call_forms(dim, num_tokens):
    """FBGEMM's test forms: bf16 column halves of a (T, 2D) tensor, and contiguous halves."""
    x = rand((num_tokens, 2 * dim), torch.bfloat16, dim)
    for x0, x1 in ((x[:, :dim], x[:, dim:]), (x[:, :dim].contiguous(), x[:, dim:].contiguous())):
        assert_silu(silu_mul(x0, x1), oracle_silu_mul(x0, x1))


def test_silu_mul_special_values_and_dead_rows():
    """IEEE specials where the SiLU is exact on every path (exp(-20) vanishes next to 1, exp(100)
    overflows): +inf * x1, NaN from -inf and NaN, signed zeros from very negative x0. Rows past
    the count are +0 even when their inputs are NaN."""
    x0 = torch.tensor([[INF, INF, -INF, NAN, 0.0, -0.0, -100.0, -100.0, 20.0, 20.0]] * 3)
    x1 = torch.tensor([[2.0, 0.0, 1.0, 1.0, 3.0, 3.0, 3.0, -3.0, 1e38, -0.5]] * 3)
    x0[2], x1[2] = NAN, NAN
    got = silu_mul(x0, x1, torch.tensor([2]))
    row = [INF, NAN, NAN, NAN, 0.0, -0.0, -0.0, 0.0, 2e39, -10.0]  # 20 * 1e38 overflows: inf
    want = torch.tensor([row, row, [0.0] * 10])
    assert_same_bits(got, want)
    assert_same_bits(silu_mul(x0.bfloat16(), x1.bfloat16(), torch.tensor([2])), want.bfloat16())


def test_silu_mul_empty():
    for shape in ((0, 16), (4, 0), (0, 0)):
        x = torch.empty(shape, dtype=torch.bfloat16)
        assert silu_mul(x, x).shape == shape
        q, s = silu_mul_quant(x, x, None, torch.tensor([1]))
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn and s.shape == shape[:1]
    q, s = silu_mul_quant(torch.empty(3, 0), torch.empty(3, 0), None, torch.tensor([2]))
    floor = np.float32(1) / (np.float32(448) / np.float32(1e-12))  # no elements: m = 1e-12
    assert_same_bits(s, torch.tensor([floor, floor, 0.0], dtype=torch.float32))


def test_silu_mul_is_deterministic_and_leaves_inputs():
    x0, x1 = pair(40, 300, torch.bfloat16, 3)
    before = (x0.clone(), x1.clone())
    a, b = silu_mul(x0, x1), silu_mul(x0, x1)
    assert_same_bits(a, b)
    qa, qb = silu_mul_quant(x0, x1), silu_mul_quant(x0, x1)
    assert_same_bits(qa.data, qb.data)
    assert_same_bits(qa.scale, qb.scale)
    assert torch.equal(x0, before[0]) and torch.equal(x1, before[1])


# --------------------------------------------------------------------------------------------
# silu_mul_quant


def check_silu_quant(x0, x1, ub, vtc_t, k):
    got = silu_mul_quant(x0, x1, ub, vtc_t)
    assert isinstance(got, Fp8Rows)
    live = live_list(x0.shape[0], k)
    ub_f = None if ub is None else float(ub)
    if not KERNELS:
        assert_quant(got, *oracle_quant_rows(oracle_silu_mul(x0, x1), live, ub_f))
        return
    # exact against the kernel's own fp32 SiLU values, within a step of the reference
    v = silu_mul(x0.float(), x1.float())
    assert_quant(got, *oracle_quant_rows(v, live, ub_f))
    want_q, want_s = ref.silu_mul_quant(x0, x1, ub, vtc_t)
    assert_within_ulps(got.data, want_q, 1)
    assert_within_ulps(got.scale, want_s, FP32_ULPS + 2)  # m's ulps, then 448 / m and 1 / s


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 1), (7, 33), (20, 300), (3, 2500)])
@pytest.mark.parametrize(
    ("ub", "vtc"), [(None, None), (1200.0, "partial"), (0.75, 0), (0.75, None)]
)
def test_silu_mul_quant_matches_oracle(dtype, num_tokens, dim, ub, vtc):
    x0, x1 = pair(num_tokens, dim, dtype, 7 * num_tokens + dim, "halves")
    t_vtc, k = count(vtc, num_tokens, torch.int64 if vtc == 0 else torch.int32)
    ub_t = None if ub is None else torch.tensor([ub])
    check_silu_quant(x0, x1, ub_t, t_vtc, k)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_silu_mul_quant_layouts(layout):
    x0, x1 = pair(9, 70, torch.float32, 5, layout)
    check_silu_quant(x0, x1, torch.tensor(2.5), torch.tensor([7]), 7)  # a 0-d bound


@pytest.mark.parametrize("dim", [5120, 7168])
def test_silu_mul_quant_fbgemm_call_forms(dim):
    x = rand((2, 2 * dim), torch.bfloat16, dim + 1)
    for ub in (torch.tensor([1200.0]), None):
        check_silu_quant(x[:, :dim], x[:, dim:], ub, None, None)


def special_rows():
    """(x0, x1) rows whose SiLU is exact on every path: x0 = 20 gives 20 * x1, x0 = -100 a signed
    zero, x0 = +-inf / NaN the IEEE specials. One special per row, a few finite neighbours."""
    fin = [20.0, 20.0, 20.0, -100.0]
    rows = [
        ([0.0] * 5, [1.0] * 5),  # all zero: m = 1e-12
        (fin + [20.0], [0.5, -1.25, 3.0, 2.0, NAN]),  # a NaN element
        (fin + [INF], [0.5, -1.25, 3.0, 2.0, 2.0]),  # +inf: s = 0 without a bound
        (fin + [-INF], [0.5, -1.25, 3.0, 2.0, 2.0]),  # -inf * 0: NaN
        ([NAN] * 5, [1.0] * 5),  # all NaN: m = 1e-12
        (fin + [20.0], [1e37, -2e36, 1e30, 1.0, 5e36]),  # huge
        (fin + [20.0], [1e-30, -3e-31, 2e-32, 1.0, 7e-38]),  # tiny
        (fin + [20.0], [22.4, -11.2, 0.7, 1.0, 22.39]),  # m near 448
    ]
    x0 = torch.tensor([r[0] for r in rows])
    x1 = torch.tensor([r[1] for r in rows])
    return x0, x1


@pytest.mark.parametrize("ub", [None, 100.0, 0.0, -1.0, NAN, INF])
def test_silu_mul_quant_special_values(ub):
    x0, x1 = special_rows()
    ub_t = None if ub is None else torch.tensor([ub])
    got = silu_mul_quant(x0, x1, ub_t)
    v = oracle_silu_mul(x0, x1)
    assert_same_bits(silu_mul(x0, x1), v)  # exact SiLU on every path
    assert_quant(got, *oracle_quant_rows(v, None, ub))
    ref_q, ref_s = ref.silu_mul_quant(x0, x1, ub_t)
    assert_quant(got, ref_q.view(torch.uint8), ref_s)
    q = got.data.view(torch.uint8)
    if ub is None:
        assert q[1, 4] == 0x7F and got.scale[2] == INF and q[2, 4] == 0x7F  # NaN; inf * 0
        assert q[2, 0] == 0x00 and q[2, 1] == 0x80  # +-0
    if ub == 100.0:
        assert q[2, 4] == 0x7E and q[3, 4] == 0x7F  # inf saturates, -inf * 0 is NaN
    if ub is not None and ub <= 0:  # floored at 1e-12: positive scales, signs kept
        assert got.scale.gt(0).all() and q[2, 4] == 0x7E and q[2, 1] == 0xFE


def test_silu_mul_quant_dead_rows_are_zero():
    x0, x1 = special_rows()
    for vtc in (0, 3, 8):
        q, s = silu_mul_quant(x0, x1, None, torch.tensor([vtc], dtype=torch.int32))
        assert q[vtc:].view(torch.uint8).eq(0).all() and s[vtc:].eq(0).all()
        assert not s.signbit().any()
        if vtc:
            assert s[:vtc].ne(0).all()


@needs_kernels
@pytest.mark.parametrize("config", [None, (1, 32, 1), (4, 16, 1), (4, 64, 2), (8, 128, 4)])
def test_silu_kernels_launch_configs(config):
    """Every tiling: rows and columns masked, the whole row held (block_d >= D) or walked twice
    in chunks, several rows a program."""
    from moe_kernels._triton import swiglu as tri
    from moe_kernels._triton.fp8_rowwise import RowConfig

    cfg = None if config is None else RowConfig(*config)
    x0, x1 = pair(7, 100, torch.bfloat16, 9, "strided")
    x0[3, 5] = NAN
    vtc = torch.tensor([5])
    y = tri.silu_mul(x0, x1, vtc, config=cfg)
    assert_silu(y, oracle_silu_mul(x0, x1, 5))
    q, s = tri.silu_mul_quant(x0, x1, torch.tensor([3.0]), vtc, config=cfg)
    assert_quant((q, s), *oracle_quant_rows(silu_mul(x0.float(), x1.float()), live_list(7, 5), 3.0))
    q2, s2 = tri.silu_mul_quant(x0, x1, None, None, config=cfg, ieee_div=True)
    assert_quant((q2, s2), *oracle_quant_rows(silu_mul(x0.float(), x1.float()), None, None))


def test_row_config_override_is_checked():
    pytest.importorskip("triton")
    from moe_kernels._triton.fp8_rowwise import RowConfig, check_config, pick_config

    assert isinstance(pick_config("quant", 100, 7168), RowConfig)
    with pytest.raises(TypeError, match="RowConfig"):
        check_config((1, 16, 4))
    with pytest.raises(ValueError, match="block_d"):
        check_config(RowConfig(1, 24, 4))
    with pytest.raises(ValueError, match="num_warps"):
        check_config(RowConfig(1, 16, 3))
    with pytest.raises(ValueError, match="block_t"):
        check_config(RowConfig(0, 16, 4))


# --------------------------------------------------------------------------------------------
# custom ops: opcheck, torch.compile, eager fast path, autograd


def test_opcheck():
    x0, x1 = pair(6, 40, torch.bfloat16, 11)
    ops = torch.ops.moe_kernels
    for vtc in (None, torch.tensor([4])):
        torch.library.opcheck(ops.silu_mul.default, (x0, x1, vtc),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip
        for ub in (None, torch.tensor([2.0])):
            torch.library.opcheck(ops.silu_mul_quant.default, (x0, x1, ub, vtc),
                                  test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    x = rand((8, 2 * 48), torch.bfloat16, 12)
    ub, vtc = torch.tensor([1.5]), torch.tensor([6])

    def step(x, ub, vtc):  # FBGEMM's column halves; the ops alone: no Inductor C++ kernel
        d = x.shape[1] // 2
        y = silu_mul(x[:, :d], x[:, d:], vtc)
        q, s = silu_mul_quant(x[:, :d], x[:, d:], ub)
        q2, s2 = silu_mul_quant(x[:, :d], x[:, d:], None, vtc)
        return y, q.view(torch.uint8), s, q2.view(torch.uint8), s2

    eager = step(x, ub, vtc)
    compiled = torch.compile(step, fullgraph=True)(x, ub, vtc)
    for e, c in zip(eager, compiled, strict=True):
        assert_same_bits(c, e)


def test_direct_eager_path_matches_custom_op(monkeypatch):
    """The public functions call the op bodies directly for plain eager CUDA tensors; force that
    branch on CPU."""
    x0, x1 = pair(7, 24, torch.float16, 13)
    ub, vtc = torch.tensor([2.0]), torch.tensor([5])
    want = silu_mul(x0, x1, vtc), silu_mul_quant(x0, x1, ub, vtc)
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    monkeypatch.setattr(sm.silu_mul_op, "op", None)  # not reached
    monkeypatch.setattr(sm.silu_mul_quant_op, "op", None)
    y, (q, s) = silu_mul(x0, x1, vtc), silu_mul_quant(x0, x1, ub, vtc)
    assert_same_bits(y, want[0])
    assert_same_bits(q, want[1].data)
    assert_same_bits(s, want[1].scale)


def test_not_differentiable():
    x0 = rand((3, 8), torch.float32, 14).requires_grad_()
    y = silu_mul(x0, rand((3, 8), torch.float32, 15))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.sum().backward()


# --------------------------------------------------------------------------------------------
# bad input: raised before any launch, naming the argument


def _bad_cases():
    x0, x1 = torch.rand(4, 8), torch.rand(4, 8)
    vtc, ub = torch.tensor([2]), torch.tensor([1.0])
    both = (silu_mul, lambda a, b, v=None: silu_mul_quant(a, b, None, v))
    cases = []
    for f in both:
        cases += [
            ("x0", TypeError, lambda f=f: f(x0.numpy(), x1)),
            ("x0", TypeError, lambda f=f: f(x0.int(), x1)),
            ("x0", ValueError, lambda f=f: f(x0[0], x1[0])),
            ("x1", TypeError, lambda f=f: f(x0, x1.double())),
            ("x1", TypeError, lambda f=f: f(x0, x1.half())),
            ("x1", ValueError, lambda f=f: f(x0, x1[:, :7])),
            ("x1", ValueError, lambda f=f: f(x0, x1[:3])),
            ("x1", ValueError, lambda f=f: f(x0, x1.to("meta"))),
            ("valid_token_count", TypeError, lambda f=f: f(x0, x1, 2)),
            ("valid_token_count", TypeError, lambda f=f: f(x0, x1, torch.tensor([2.0]))),
            ("valid_token_count", ValueError, lambda f=f: f(x0, x1, torch.tensor([2, 3]))),
            ("valid_token_count", ValueError, lambda f=f: f(x0, x1, vtc.to("meta"))),
        ]
    q = silu_mul_quant
    cases += [
        ("scale_ub", TypeError, lambda: q(x0, x1, 1.0)),
        ("scale_ub", TypeError, lambda: q(x0, x1, ub.double())),
        ("scale_ub", TypeError, lambda: q(x0, x1, ub.bfloat16())),
        ("scale_ub", ValueError, lambda: q(x0, x1, torch.tensor([1.0, 2.0]))),
        ("scale_ub", ValueError, lambda: q(x0, x1, torch.empty(0))),
        ("scale_ub", ValueError, lambda: q(x0, x1, ub.to("meta"))),
    ]
    return cases


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_argument_before_any_launch(case, monkeypatch):
    def never(*args):
        raise AssertionError("launched")

    for op in (sm.silu_mul_op, sm.silu_mul_quant_op):
        monkeypatch.setattr(op, "call", never)
    name, exc, fn = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        fn()


# --------------------------------------------------------------------------------------------
# sm_90a: every GPU launch the launchers pick compiles, with the instructions it must have


def meta_pair(num_tokens, dim, dtype, layout):
    x = torch.empty(num_tokens, 2 * dim, dtype=dtype, device="meta")
    if layout == "halves":
        return x[:, :dim], x[:, dim:]
    if layout == "strided":
        return x[:, ::2], x[:, 1::2]
    return x[:, :dim].contiguous(), x[:, dim:].contiguous()


SHAPES = [(1, 7168), (128, 5120), (4096, 7168), (65536, 2048), (300, 130), (64, 16384)]
needs_gpu_plans = pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without INTERPRET")


@needs_gpu_plans
def test_silu_mul_launches_compile_for_sm90(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import swiglu as tri

    meta_vtc = torch.empty(1, dtype=torch.int32, device="meta")
    calls = []
    for (t, d), layout in zip(SHAPES, ["halves", "contiguous", "halves", "halves", "strided",
                                       "halves"], strict=True):  # fmt: skip
        x0, x1 = meta_pair(t, d, torch.bfloat16, layout)
        calls.append(lambda x0=x0, x1=x1: tri.silu_mul(x0, x1, meta_vtc))
    for dtype in (torch.float32, torch.float16):
        x0, x1 = meta_pair(256, 2048, dtype, "halves")
        calls.append(lambda x0=x0, x1=x1: tri.silu_mul(x0, x1, None))
    x0, x1 = meta_pair(64, 1024, torch.bfloat16, "contiguous")  # two rows a program
    calls.append(lambda x0=x0, x1=x1: tri.silu_mul(x0, x1, None))
    compiled = compile_launches([tri._silu_mul], calls, monkeypatch)
    assert any("stride_0d" not in cx for cx, _, _ in compiled)  # the strided launch
    assert len({(cx["BLOCK_T"], cx["BLOCK_D"]) for cx, _, _ in compiled}) >= 3
    for cx, _, ptx in compiled:
        assert "ex2.approx.f32" in ptx and "div.full.f32" in ptx  # FBGEMM's tl.sigmoid
        if cx.get("stride_0d") == 1:  # 16-byte vectors where the columns are contiguous
            assert re.search(r"ld\.global[\w.:]*\.v4\.b32", ptx), cx


@needs_gpu_plans
def test_silu_mul_quant_launches_compile_for_sm90(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import swiglu as tri

    # meta tensors stand for an sm90 device's: its launcher picks the hardware e4m3 cast
    monkeypatch.setattr(tri, "e4m3_native", lambda device: True)

    vtc, ub = (torch.empty(1, dtype=d, device="meta") for d in (torch.int64, torch.float32))
    calls = []
    for (t, d), layout in zip(SHAPES, ["halves", "contiguous", "halves", "halves", "strided",
                                       "halves"], strict=True):  # fmt: skip
        x0, x1 = meta_pair(t, d, torch.bfloat16, layout)
        calls.append(lambda x0=x0, x1=x1: tri.silu_mul_quant(x0, x1, ub, vtc))
    x0, x1 = meta_pair(2048, 7168, torch.bfloat16, "halves")
    calls.append(lambda: tri.silu_mul_quant(x0, x1, None, None))
    calls.append(lambda: tri.silu_mul_quant(x0, x1, ub, None, ieee_div=True))
    compiled = compile_launches([tri._silu_mul_quant], calls, monkeypatch)
    assert any(cx["NUM_CHUNKS"] > 1 for cx, _, _ in compiled)
    for cx, _, ptx in compiled:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert bool(IEEE_DIV_PTX.search(ptx)) == cx["IEEE_DIV"], cx


@needs_gpu_plans
def test_kernels_write_only_their_outputs(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import swiglu as tri

    x0, x1 = pair(64, 256, torch.bfloat16, 1)
    y, q = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.uint8)
    s = torch.empty(64)
    vtc, ub = torch.tensor([3]), torch.tensor([1.0])
    consts = dict(HAS_VTC=True, BLOCK_T=4, BLOCK_D=256, COL64=False)
    args = (y, x0, x1, vtc, 64, 256, *x0.stride(), *x1.stride())
    assert written_arguments(tri._silu_mul_kernel, args, consts, monkeypatch) == ["y_ptr"]
    consts = dict(HAS_UB=True, HAS_VTC=True, IEEE_DIV=True, NATIVE_CAST=True, BLOCK_T=4,
                  BLOCK_D=256, NUM_CHUNKS=1, COL64=False)  # fmt: skip
    args = (q, s, x0, x1, ub, vtc, 64, 256, *x0.stride(), *x1.stride())
    written = written_arguments(tri._silu_mul_quant_kernel, args, consts, monkeypatch)
    assert written == ["q_ptr", "scale_ptr"]
