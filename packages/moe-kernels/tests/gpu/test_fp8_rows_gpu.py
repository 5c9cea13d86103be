"""``silu_mul``, ``silu_mul_quant`` and ``gather_scale_quant_dense_tokens`` on the GPU against the
reference run on the CPU (``moe_kernels.reference``), beyond FBGEMM's forms
(``test_fbgemm_contract.py``): fp16 / fp32 inputs, strided and contiguous halves, int64 counts,
a binding ``scale_ub``, dead rows (-1 indices), column-major and fp16 / fp32 scores, odd widths,
and the special-value rows (NaN, +-inf, zero rows, huge, tiny, every kind of bound).

The GPU's exp is ``ex2.approx`` and its division ``div.full`` (FBGEMM's arithmetic), the
reference's IEEE: silu_mul within one ulp (bf16 / fp16) or 64 ulp (fp32) of the reference, the
quantised data within one e4m3 step and the scales within a few ulp; rows past the valid count
exactly zero. Then determinism, a CUDA graph replayed after x, ``scale_ub`` and the valid count
changed in place, and ``torch.compile(fullgraph=True)`` == eager, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import gather_quant as ref_g
from moe_kernels.reference import swiglu as ref_s
from moe_kernels.testing import (
    assert_within_ulps,
    bits_equal,
    compile_fresh,
    forbid_host_sync,
    full_run,
    gpu_test_device,
    int_bits,
    poison,
    replay_mismatches,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
FULL = pytest.mark.skipif(not full_run(), reason="the whole grid: MOE_GPU_FULL=1")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN, INF = float("nan"), float("inf")
SILU_ULPS = {BF16: 1, FP16: 1, FP32: 64}
QUANT_SCALE_ULPS = 64  # silu_mul_quant: the scale of an fp32 SiLU value (approximate exp) and div
GATHER_SCALE_ULPS = 8  # gather: exact products, only the two divisions differ


def rand(shape, dtype, seed, scale=2.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def count(kind, n, dtype=torch.int32):
    """(valid_token_count, its value): None, "part" (2n/3 + 1), "zero" or "all"."""
    if kind is None:
        return None, n
    k = {"part": 2 * n // 3 + 1, "zero": 0, "all": n}[kind]
    return torch.tensor([k], dtype=dtype, device=DEV), k


def pair(t, d, dtype, seed, layout):
    if layout == "halves":  # FBGEMM's form: the column halves of one (T, 2D) tensor
        x = rand((t, 2 * d), dtype, seed)
        return x[:, :d], x[:, d:]
    if layout == "contiguous":
        return rand((t, d), dtype, seed), rand((t, d), dtype, seed + 1)
    x = rand((t, 2 * d), dtype, seed)  # every other column
    return x[:, ::2], x[:, 1::2]


def cpu(*ts):
    return [None if t is None else t.cpu() for t in ts]


def assert_quant_close(got, want, scale_ulps: int) -> None:
    """Data within one e4m3 step, scales within ``scale_ulps`` ulp (NaN == NaN, no sign, NaN or
    inf mismatch)."""
    assert_within_ulps(got[0].cpu(), want[0], 1)
    assert_within_ulps(got[1].cpu(), want[1], scale_ulps)


SHAPES = [(1, 7168), (128, 5120), (4096, 2048), (300, 130), (17, 1), (64, 16384)]
SILU_CASES = [  # by default each shape in one dtype, (4096, 2048) in all three
    pytest.param(i, t, d, dtype, id=f"T{t}-D{d}-{str(dtype)[6:]}",
                 marks=() if j == i % 3 or t == 4096 else FULL)
    for i, (t, d) in enumerate(SHAPES)
    for j, dtype in enumerate((BF16, FP16, FP32))
]  # fmt: skip


@pytest.mark.parametrize("i,t,d,dtype", SILU_CASES)
def test_silu_mul_and_quant_match_the_reference(i, t, d, dtype):
    layout = ("halves", "contiguous", "strided")[(i + dtype.itemsize) % 3]
    vtc_kind = (None, "part", "zero", "all")[i % 4]
    ub = 1.0 if dtype == FP16 else 1200.0  # 1.0 binds: rows' maxima exceed it
    x0, x1 = pair(t, d, dtype, t + d, layout)
    vtc, k = count(vtc_kind, t, (torch.int32, torch.int64)[i % 2])
    ub_t = torch.tensor([ub], device=DEV)
    poison(4 * t * d + 4096, device=DEV)
    with forbid_host_sync(ON_GPU):
        y = mk.silu_mul(x0, x1, vtc)
        q, s = mk.silu_mul_quant(x0, x1, ub_t, vtc)
    assert_within_ulps(y.cpu(), ref_s.silu_mul(*cpu(x0, x1, vtc)), SILU_ULPS[dtype])
    assert y.is_contiguous()
    assert bool(int_bits(y[k:]).eq(0).all()), "rows past the count must be +0"
    assert_quant_close((q, s), ref_s.silu_mul_quant(*cpu(x0, x1, ub_t, vtc)), QUANT_SCALE_ULPS)
    assert bits_equal(y, mk.silu_mul(x0, x1, vtc)), "silu_mul not deterministic"
    assert bits_equal((q, s), mk.silu_mul_quant(x0, x1, ub_t, vtc)), "not deterministic"


def test_silu_mul_quant_without_a_bound():
    x0, x1 = pair(300, 512, BF16, 5, "halves")
    vtc, _ = count("part", 300, torch.int64)
    got = mk.silu_mul_quant(x0, x1, None, vtc)
    assert_quant_close(got, ref_s.silu_mul_quant(*cpu(x0, x1, None, vtc)), QUANT_SCALE_ULPS)


def gather_problem(t, d, n, e, dtype, seed, index_dtype=torch.int32, dead=True):
    x = rand((t, d), dtype, seed)
    scores = torch.rand(t, e, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    lo = -1 if dead else 0
    tok = torch.randint(lo, t, (n,), device=DEV, generator=g).to(index_dtype)
    exp = torch.randint(lo, e, (n,), device=DEV, generator=g).to(index_dtype)
    return x, tok, exp, scores


GATHER_FORMS = [  # (x dtype, scores dtype, column-major scores, strided x, index dtype, count, ub)
    (BF16, BF16, True, False, torch.int32, None, 1200.0),
    (BF16, FP32, False, True, torch.int64, "part", None),
    (FP32, FP16, True, False, torch.int64, "zero", 0.5),
    (FP16, BF16, False, False, torch.int32, "all", None),
]
GATHER_CASES = [  # by default every form at the first shape, one form at each other
    pytest.param(shape, form, id=f"{shape}-{j}", marks=() if i in (0, j) else FULL)
    for i, shape in enumerate([(4096, 2048, 32768, 128), (300, 130, 2000, 5), (64, 16384, 256, 4)])
    for j, form in enumerate(GATHER_FORMS)
] + [
    pytest.param(shape, GATHER_FORMS[0], id=f"{shape}-0")
    for shape in [(2048, 5120, 2048, 8), (128, 7168, 128, 2)]
]


@pytest.mark.parametrize("shape,form", GATHER_CASES)
def test_gather_scale_quant_matches_the_reference(shape, form):
    t, d, n, e = shape
    dtype, sdtype, colmajor, strided, index_dtype, vtc_kind, ub = form
    x, tok, exp, scores = gather_problem(t, d, n, e, dtype, t + d + n, index_dtype)
    if strided:
        x = torch.cat([x, x], dim=1)[:, ::2]
    scores = scores.to(sdtype)
    if colmajor:
        scores = scores.t().contiguous().t()
    vtc, _ = count(vtc_kind, n, torch.int64 if vtc_kind == "zero" else torch.int32)
    ub_t = None if ub is None else torch.tensor([ub], device=DEV)
    poison(5 * n * d + 4096, device=DEV)
    with forbid_host_sync(ON_GPU):
        got = mk.gather_scale_quant_dense_tokens(x, tok, exp, scores, ub_t, vtc)
    want = ref_g.gather_scale_quant_dense_tokens(*cpu(x, tok, exp, scores, ub_t, vtc))
    assert_quant_close(got, want, GATHER_SCALE_ULPS)


@pytest.mark.parametrize("ub", [None, 100.0, 0.0, -2.0, NAN, INF])
def test_special_values(ub):
    """The special-value rows of the CPU tests: NaN and +-inf elements, zero rows, huge and tiny
    values, every kind of bound (none, binding, zero, negative, NaN, inf)."""
    rows = [[0.0] * 6, [1.0, -2.0, NAN, 3.0, 0.5, -0.0], [1.0, -2.0, INF, 3.0, 0.5, -0.0],
            [1.0, -2.0, -INF, 3.0, 0.5, -0.0], [NAN] * 6, [3e38, -1e38, 2.0, 1e-30, 0.0, 5e37],
            [1e-38, -3e-39, 1e-44, 0.0, 2e-40, 7e-39]]  # fmt: skip
    x = torch.tensor(rows, device=DEV)
    scores = torch.tensor([[1.0, 2.0]] * len(rows), device=DEV)
    n = 2 * len(rows)
    tok = torch.arange(n, device=DEV, dtype=torch.int32) % len(rows)
    exp = (torch.arange(n, device=DEV) >= len(rows)).int()
    # SiLU rows where the SiLU is exact on every backend (x0 = 20: sigmoid rounds to 1)
    x0 = torch.tensor([[20.0] * 5, [20.0, 20, 20, -100, 20], [INF, 20, -INF, NAN, 0.0]], device=DEV)
    x1 = torch.tensor([[1e37, -2e36, NAN, 1.0, 1e-30], [0.5, -1.25, 3.0, 2.0, 7e-38],
                       [2.0, 1.0, 1.0, 1.0, 3.0]], device=DEV)  # fmt: skip
    ub_t = None if ub is None else torch.tensor([ub], device=DEV)
    got = mk.gather_scale_quant_dense_tokens(x, tok, exp, scores, ub_t)
    want = ref_g.gather_scale_quant_dense_tokens(*cpu(x, tok, exp, scores, ub_t))
    assert_quant_close(got, want, GATHER_SCALE_ULPS)
    got = mk.silu_mul_quant(x0, x1, ub_t)
    assert_quant_close(got, ref_s.silu_mul_quant(*cpu(x0, x1, ub_t)), GATHER_SCALE_ULPS)
    assert bits_equal(mk.silu_mul(x0, x1), ref_s.silu_mul(*cpu(x0, x1)))


def test_graph_replay_and_compile():
    t, d, n, e = (2048, 2048, 16384, 16) if ON_GPU else (16, 64, 40, 4)
    x0, x1 = pair(t, d, BF16, 1, "halves")
    x, tok, exp, scores = gather_problem(t, d, n, e, BF16, 2)
    ub = torch.tensor([1200.0], device=DEV)
    vtc = torch.tensor([n // 2], device=DEV, dtype=torch.int32)
    vtc_t = torch.tensor([t // 2], device=DEV, dtype=torch.int64)

    def step():
        return (mk.silu_mul(x0, x1, vtc_t), mk.silu_mul_quant(x0, x1, ub, vtc_t),
                mk.gather_scale_quant_dense_tokens(x, tok, exp, scores, ub, vtc))  # fmt: skip

    if ON_GPU:

        def refill():
            x0.copy_(rand(x0.shape, BF16, 3))
            x.copy_(rand(x.shape, BF16, 4))
            ub.fill_(0.75)
            vtc.fill_(n - 3)
            vtc_t.fill_(t - 1)

        assert not replay_mismatches(step, [refill])
    assert bits_equal(compile_fresh(lambda: step())(), step())
