"""gather_scale_quant_dense_tokens against a naive loop oracle, on the torch reference path
(TRITON_INTERPRET=0) and on the Triton kernel in the interpreter (TRITON_INTERPRET=1): exact on
both (fp32 products, IEEE divisions, the kernel's integer e4m3 rounding in the interpreter); the
sm_90a compiles of every GPU launch the launcher picks (no GPU needed; skipped in the interpreter).
The oracles and comparisons are moe_kernels.testing's (test_swiglu.py's too).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels import _dispatch
from moe_kernels import gather_quant as gq
from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens
from moe_kernels.reference import gather_quant as ref
from moe_kernels.swiglu import Fp8Rows
from moe_kernels.testing import (
    IEEE_DIV_PTX,
    assert_quant,
    assert_same_bits,
    compile_launches,
    oracle_gather_quant,
    written_arguments,
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INF, NAN = float("inf"), float("nan")
needs_kernels = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="runs the Triton launchers: needs INTERPRET"
)


def rand(shape, dtype, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def check(x, tok, exp, scores, ub=None, vtc=None, vtc_dtype=torch.int64):
    ub_t = None if ub is None else torch.tensor([ub])
    vtc_t = None if vtc is None else torch.tensor([vtc], dtype=vtc_dtype)
    got = gather_scale_quant_dense_tokens(x, tok, exp, scores, ub_t, vtc_t)
    assert isinstance(got, Fp8Rows) and got.data.shape == (tok.shape[0], x.shape[1])
    assert_quant(got, *oracle_gather_quant(x, tok, exp, scores, ub, vtc))
    return got


def routing(num_tokens, num_experts, n, seed, index_dtype=torch.int32, dead=True):
    """(tok, exp): n random pairs, some -1 (dead) when ``dead``."""
    g = torch.Generator().manual_seed(seed)
    lo = -1 if dead else 0
    tok = torch.randint(lo, num_tokens, (n,), generator=g).to(index_dtype)
    exp = torch.randint(lo, num_experts, (n,), generator=g).to(index_dtype)
    return tok, exp


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("num_tokens", "dim", "num_experts", "n"),
    [(1, 1, 1, 1), (5, 7, 3, 9), (23, 130, 4, 40), (4, 2500, 2, 6)],
)
@pytest.mark.parametrize(("ub", "vtc"), [(None, None), (1200.0, "partial"), (0.3, 0), (0.3, None)])
def test_matches_oracle(dtype, num_tokens, dim, num_experts, n, ub, vtc):
    x = rand((num_tokens, dim), dtype, num_tokens + dim)
    scores = rand((num_tokens, num_experts), torch.float32, 3).softmax(-1)
    tok, exp = routing(num_tokens, num_experts, n, dim)
    k = None if vtc is None else (0 if vtc == 0 else 2 * n // 3 + 1)
    check(x, tok, exp, scores, ub, k, torch.int32 if vtc == 0 else torch.int64)


@pytest.mark.parametrize("num_experts", [2, 4, 8])
@pytest.mark.parametrize("colmajor", [False, True])
@pytest.mark.parametrize("ub", [1200.0, None])
def test_fbgemm_call_form(num_experts, colmajor, ub):
    """FBGEMM's test form: bf16 x, token_indices an int32 permutation, expert_indices int64,
    bf16 scores row- or column-major, scale_ub [1200.0] or None, passed positionally."""
    num_tokens, dim = 16, 256
    g = torch.Generator().manual_seed(num_experts)
    x = rand((num_tokens, dim), torch.bfloat16, num_experts)
    tok = torch.randperm(num_tokens, generator=g).int()
    exp = torch.randint(0, num_experts, (num_tokens,), generator=g)
    scores = rand((num_tokens, num_experts), torch.float32, 5).softmax(-1).bfloat16()
    if colmajor:
        scores = scores.t().contiguous().t()
    ub_t = None if ub is None else torch.tensor([ub])
    got = gather_scale_quant_dense_tokens(x, tok, exp, scores, ub_t)
    q, s = got  # a plain tuple's unpacking
    assert_quant((q, s), *oracle_gather_quant(x, tok, exp, scores, ub))
    assert s.gt(0).all()


def test_strided_x_and_scores_int64_and_out_of_range_indices():
    x = rand((9, 141), torch.float32, 6)[:, ::2]  # (9, 71), column stride 2
    scores = rand((5, 9), torch.bfloat16, 7).t()  # (9, 5), column-major
    tok = torch.tensor([3, 3, -1, 0, 8, 2, 9, -7, 4, 1], dtype=torch.int64)
    exp = torch.tensor([0, 4, 1, 2, -1, 3, 0, 1, 5, 2], dtype=torch.int64)  # 5 >= E: dead
    got = check(x, tok, exp, scores, None, 9)
    dead = [2, 4, 6, 7, 8, 9]  # -1, -1 expert, 9 >= T, -7, expert 5 >= E, i >= count
    assert got.data.view(torch.uint8)[dead].eq(0).all() and got.scale[dead].eq(0).all()
    assert got.scale[[0, 1, 3, 5]].gt(0).all()
    check(x.contiguous(), tok.int(), exp.int(), scores.contiguous(), 5.0)


def test_duplicate_rows_and_shared_tokens_agree():
    """The same (token, expert) pair twice gives the same bytes; the same token under two experts
    gives the same row up to the score."""
    x = rand((4, 40), torch.bfloat16, 8)
    scores = torch.tensor([[0.5, 0.25]] * 4)
    tok = torch.tensor([2, 2, 2], dtype=torch.int32)
    exp = torch.tensor([1, 1, 0], dtype=torch.int32)
    q, s = check(x, tok, exp, scores)
    assert torch.equal(q[0].view(torch.uint8), q[1].view(torch.uint8))
    assert torch.equal(q[0].view(torch.uint8), q[2].view(torch.uint8))  # power-of-two scores
    assert s[2] == 2 * s[0]


def test_rounding_ties_subnormals_and_saturation():
    """m = 448 makes s = 1: the e4m3 rounding of exact values, ties to even (1.0625 -> 1.0,
    1.1875 -> 1.25, 15.5 -> 16), subnormals (half the smallest -> 0, 1.5x -> 2x), saturation."""
    tiny = 2.0**-9
    row = [448.0, 1.0625, 1.1875, 15.5, -15.5, 0.5 * tiny, 1.5 * tiny, -0.5 * tiny, 3.0, -0.0]
    x = torch.tensor([row, [v * 4 for v in row]])  # row 2 through a score of 0.25
    scores = torch.tensor([[1.0], [0.25]])
    tok, exp = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    q, s = check(x, tok, exp, scores)
    want = [0x7E, 0x38, 0x3A, 0x58, 0xD8, 0x00, 0x02, 0x80, 0x44, 0x80]
    assert q.view(torch.uint8).tolist() == [want, want] and s.tolist() == [1.0, 1.0]
    q, s = check(x, tok, exp, scores, ub=224.0)  # s = 2: 448 saturates, 3.0 -> 6.0
    assert q.view(torch.uint8)[0, 0] == 0x7E and q.view(torch.uint8)[0, 8] == 0x4C


@pytest.mark.parametrize("ub", [None, 100.0, 0.0, -2.0, NAN, INF])
def test_special_values(ub):
    """NaN elements, +-inf, all-zero, all-NaN, huge and tiny rows; every kind of bound."""
    rows = [
        [0.0] * 6,
        [1.0, -2.0, NAN, 3.0, 0.5, -0.0],
        [1.0, -2.0, INF, 3.0, 0.5, -0.0],
        [1.0, -2.0, -INF, 3.0, 0.5, -0.0],
        [NAN] * 6,
        [3e38, -1e38, 2.0, 1e-30, 0.0, 5e37],
        [1e-38, -3e-39, 1e-44, 0.0, 2e-40, 7e-39],  # subnormal inputs
    ]
    x = torch.tensor(rows)
    scores = torch.tensor([[1.0, 2.0]] * len(rows))  # score 2: 3e38 * 2 overflows to inf
    n = 2 * len(rows)
    tok = torch.arange(n, dtype=torch.int32) % len(rows)
    exp = (torch.arange(n, dtype=torch.int32) >= len(rows)).int()
    q, s = check(x, tok, exp, scores, ub)
    qb = q.view(torch.uint8)
    if ub is None:
        assert qb[1, 2] == 0x7F and s[1] == 3.0 / 448  # NaN left out of m: m = 3
        assert s[2] == INF and qb[2, 2] == 0x7F and qb[2, 1] == 0x80  # inf * 0 = NaN, -0
        assert qb[3, 2] == 0x7F and qb[4].eq(0x7F).all()
    if ub == 100.0:
        assert qb[2, 2] == 0x7E and qb[3, 2] == 0xFE  # +-inf saturate


def test_dead_rows_ignore_garbage_and_empty():
    x = torch.full((3, 8), NAN)
    scores = torch.full((3, 2), NAN)
    tok = torch.tensor([-1, 1, 2, 0], dtype=torch.int32)
    exp = torch.tensor([0, -1, 1, 1], dtype=torch.int32)
    q, s = check(x, tok, exp, scores, None, 2)  # every row dead, inputs all NaN
    assert q.view(torch.uint8).eq(0).all() and s.eq(0).all() and not s.signbit().any()
    idx = torch.empty(0, dtype=torch.int64)
    q, s = gather_scale_quant_dense_tokens(x, idx, idx, scores)
    assert q.shape == (0, 8) and s.shape == (0,)
    tail = torch.full((3,), -1, dtype=torch.int32)
    q, s = check(torch.empty(0, 8), tail, tail, torch.empty(0, 4))  # T = 0: all dead
    assert q.shape == (3, 8) and s.eq(0).all()
    check(torch.ones(3, 8), tok, exp, torch.empty(3, 0))  # E = 0: all dead
    q, s = check(torch.empty(3, 0), tok, exp, torch.ones(3, 2), None, 4)  # D = 0
    assert q.shape == (4, 0) and s[2] > 0


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    num_tokens=st.integers(0, 9),
    dim=st.integers(0, 70),
    n=st.integers(0, 20),
    num_experts=st.integers(1, 5),
    vtc=st.one_of(st.none(), st.integers(0, 24)),
    ub=st.sampled_from([None, 0.5, 1200.0]),
    dtypes=st.sampled_from([(a, b) for a in FLOATS for b in FLOATS]),
    seed=st.integers(0, 2**16),
)
def test_property(num_tokens, dim, n, num_experts, vtc, ub, dtypes, seed):
    x = rand((num_tokens, dim), dtypes[0], seed)
    scores = torch.rand(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    tok, exp = routing(max(num_tokens, 1), num_experts, n, seed, torch.int64)
    check(x, tok, exp, scores.to(dtypes[1]), ub, vtc)


def test_deterministic_and_inputs_untouched():
    x = rand((30, 200), torch.bfloat16, 9)
    scores = torch.rand(30, 4)
    tok, exp = routing(30, 4, 90, 10)
    before = [t.clone() for t in (x, scores, tok, exp)]
    a = gather_scale_quant_dense_tokens(x, tok, exp, scores, torch.tensor([3.0]))
    b = gather_scale_quant_dense_tokens(x, tok, exp, scores, torch.tensor([3.0]))
    assert_same_bits(a.data, b.data)
    assert_same_bits(a.scale, b.scale)
    for t, t0 in zip((x, scores, tok, exp), before, strict=True):
        assert torch.equal(t, t0)


@needs_kernels
@pytest.mark.parametrize("config", [None, (1, 32, 1), (4, 16, 1), (4, 64, 2), (16, 128, 4)])
def test_kernel_launch_configs(config):
    """Every tiling: rows and columns masked, the whole row held or walked twice in chunks,
    several rows a program, FBGEMM's division, the native cast's code path (numpy's float8
    cast in the interpreter: one step of tolerance is not needed here, the values are exact
    in e4m3 after scaling by 1)."""
    from moe_kernels._triton import gather_quant as tri
    from moe_kernels._triton.fp8_rowwise import RowConfig

    cfg = None if config is None else RowConfig(*config)
    x = rand((7, 201), torch.bfloat16, 11)[:, ::2]
    scores = rand((3, 7), torch.float16, 12).t()
    tok, exp = routing(7, 3, 13, 13, torch.int64)
    vtc = torch.tensor([11], dtype=torch.int32)
    want = oracle_gather_quant(x, tok, exp, scores, 2.0, 11)
    for ieee in (True, False):
        got = tri.gather_scale_quant(x, tok, exp, scores, torch.tensor([2.0]), vtc, config=cfg,
                                     ieee_div=ieee)  # fmt: skip
        assert_quant(got, *want)
    # native float8 cast on values e4m3 represents exactly (interpreter's cast is exact there)
    xe = torch.tensor([[448.0, 1.0, -2.0, 0.5, 96.0, -0.0]] * 3)
    ones = torch.ones(3, 1)
    t3, e3 = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    got = tri.gather_scale_quant(xe, t3, e3, ones, None, None, config=cfg, native_cast=True)
    assert_quant(got, *oracle_gather_quant(xe, t3, e3, ones))


# --------------------------------------------------------------------------------------------
# custom op: opcheck, torch.compile, eager fast path, autograd


def test_opcheck():
    x = rand((6, 40), torch.bfloat16, 14)
    tok, exp = routing(6, 3, 10, 15)
    scores = torch.rand(6, 3)
    for ub in (None, torch.tensor([2.0])):
        for vtc in (None, torch.tensor([7])):
            torch.library.opcheck(
                torch.ops.moe_kernels.gather_scale_quant_dense_tokens.default,
                (x, tok, exp, scores, ub, vtc),
                test_utils=("test_schema", "test_faketensor"),
            )


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    x = rand((8, 48), torch.bfloat16, 16)
    scores = rand((3, 8), torch.bfloat16, 17).t()
    tok, exp = routing(8, 3, 16, 18)
    ub, vtc = torch.tensor([1.5]), torch.tensor([12])

    def step(x, tok, exp, scores, ub, vtc):  # the ops alone: no Inductor C++ kernel to build
        q, s = gather_scale_quant_dense_tokens(x, tok, exp, scores, ub, vtc)
        q2, s2 = gather_scale_quant_dense_tokens(x[1:], tok, exp, scores[1:])
        return q.view(torch.uint8), s, q2.view(torch.uint8), s2

    eager = step(x, tok, exp, scores, ub, vtc)
    compiled = torch.compile(step, fullgraph=True)(x, tok, exp, scores, ub, vtc)
    for e, c in zip(eager, compiled, strict=True):
        assert_same_bits(c, e)


def test_direct_eager_path_matches_custom_op(monkeypatch):
    x = rand((7, 24), torch.float16, 19)
    scores = torch.rand(7, 2)
    tok, exp = routing(7, 2, 12, 20)
    want = gather_scale_quant_dense_tokens(x, tok, exp, scores, torch.tensor([2.0]))
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    monkeypatch.setattr(gq.gather_scale_quant_dense_tokens_op, "op", None)  # not reached
    got = gather_scale_quant_dense_tokens(x, tok, exp, scores, torch.tensor([2.0]))
    assert_same_bits(got.data, want.data)
    assert_same_bits(got.scale, want.scale)
    q, s = ref.gather_scale_quant_dense_tokens(x, tok, exp, scores, torch.tensor([2.0]))
    assert_same_bits(q, got.data)
    assert_same_bits(s, got.scale)


def test_not_differentiable():
    x = rand((3, 8), torch.float32, 21).requires_grad_()
    tok = torch.tensor([0, 2], dtype=torch.int32)
    q, s = gather_scale_quant_dense_tokens(x, tok, tok, torch.rand(3, 3))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        s.sum().backward()


# --------------------------------------------------------------------------------------------
# bad input: raised before any launch, naming the argument


def _bad_cases():
    x, scores = torch.rand(4, 8), torch.rand(4, 3)
    tok, exp = torch.tensor([0, 3, -1], dtype=torch.int32), torch.tensor([1, 2, 0])
    ub, vtc = torch.tensor([1.0]), torch.tensor([2])
    f = gather_scale_quant_dense_tokens
    return [
        ("x", TypeError, lambda: f([[1.0]], tok, exp, scores)),
        ("x", TypeError, lambda: f(x.int(), tok, exp, scores)),
        ("x", TypeError, lambda: f(x.double(), tok, exp, scores)),
        ("x", ValueError, lambda: f(x[0], tok, exp, scores)),
        ("token_indices", TypeError, lambda: f(x, tok.float(), exp, scores)),
        ("token_indices", TypeError, lambda: f(x, tok.short(), exp, scores)),
        ("token_indices", ValueError, lambda: f(x, tok[None], exp, scores)),
        ("token_indices", ValueError, lambda: f(x, tok.to("meta"), exp, scores)),
        ("expert_indices", TypeError, lambda: f(x, tok, None, scores)),
        ("expert_indices", TypeError, lambda: f(x, tok, exp.float(), scores)),
        ("expert_indices", ValueError, lambda: f(x, tok, exp[:2], scores)),
        ("expert_indices", ValueError, lambda: f(x, tok, exp[None], scores)),
        ("expert_indices", ValueError, lambda: f(x, tok, exp.to("meta"), scores)),
        ("scores", TypeError, lambda: f(x, tok, exp, scores.long())),
        ("scores", ValueError, lambda: f(x, tok, exp, scores[0])),
        ("scores", ValueError, lambda: f(x, tok, exp, scores[:3])),
        ("scores", ValueError, lambda: f(x, tok, exp, scores.to("meta"))),
        ("scale_ub", TypeError, lambda: f(x, tok, exp, scores, 1200.0)),
        ("scale_ub", TypeError, lambda: f(x, tok, exp, scores, ub.half())),
        ("scale_ub", ValueError, lambda: f(x, tok, exp, scores, torch.ones(2))),
        ("scale_ub", ValueError, lambda: f(x, tok, exp, scores, ub.to("meta"))),
        ("valid_token_count", TypeError, lambda: f(x, tok, exp, scores, None, 2)),
        ("valid_token_count", TypeError, lambda: f(x, tok, exp, scores, ub, vtc.float())),
        ("valid_token_count", ValueError, lambda: f(x, tok, exp, scores, None, vtc[:0])),
        ("valid_token_count", ValueError, lambda: f(x, tok, exp, scores, None, vtc.to("meta"))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_argument_before_any_launch(case, monkeypatch):
    def never(*args):
        raise AssertionError("launched")

    monkeypatch.setattr(gq.gather_scale_quant_dense_tokens_op, "call", never)
    name, exc, fn = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        fn()


# --------------------------------------------------------------------------------------------
# sm_90a: every GPU launch the launcher picks compiles, with the instructions it must have


@pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without INTERPRET")
def test_launches_compile_for_sm90(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import gather_quant as tri

    # meta tensors stand for an sm90 device's: its launcher picks the hardware e4m3 cast
    monkeypatch.setattr(tri, "e4m3_native", lambda device: True)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    ub, vtc = meta(1, dtype=torch.float32), meta(1, dtype=torch.int32)
    calls = []
    # (T, D, k, E): the 65536-token, k = 8 shape, FBGEMM's test shapes, odd D, a wide row
    for t, d, k, e in [(65536, 2048, 8, 128), (16384, 5120, 1, 8), (128, 7168, 1, 2),
                       (300, 130, 4, 16), (64, 16384, 2, 4)]:  # fmt: skip
        x, scores = meta(t, d), meta(e, t).t()
        tok, exp = meta(t * k, dtype=torch.int32), meta(t * k, dtype=torch.int64)
        calls.append(lambda x=x, tok=tok, exp=exp, s=scores: tri.gather_scale_quant(
            x, tok, exp, s, ub, vtc))  # fmt: skip
    x, scores = meta(4096, 2048, dtype=torch.float32), meta(4096, 8, dtype=torch.float32)
    tok = meta(4096, dtype=torch.int64)
    calls.append(lambda: tri.gather_scale_quant(x, tok, tok, scores, None, None))
    calls.append(lambda: tri.gather_scale_quant(x[:, ::2], tok, tok, scores, ub, None))
    calls.append(lambda: tri.gather_scale_quant(x, tok, tok, scores, ub, None, ieee_div=True))
    compiled = compile_launches([tri._gather_quant], calls, monkeypatch)
    assert any(cx["NUM_CHUNKS"] > 1 for cx, _, _ in compiled)
    assert any("stride_xd" not in cx for cx, _, _ in compiled)  # the strided launch
    for cx, _, ptx in compiled:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert bool(IEEE_DIV_PTX.search(ptx)) == cx["IEEE_DIV"], cx
        assert ("div.full.f32" in ptx) == (not cx["IEEE_DIV"]), cx


@pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without INTERPRET")
def test_kernel_writes_only_its_outputs(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import gather_quant as tri

    x, scores = rand((64, 256), torch.bfloat16, 1), torch.rand(64, 4)
    tok, exp = routing(64, 4, 128, 2)
    q, s = torch.empty(128, 256, dtype=torch.uint8), torch.empty(128)
    args = (q, s, x, tok, exp, scores, torch.tensor([1.0]), torch.tensor([3]), 128, 256, 64, 4,
            *x.stride(), *scores.stride())  # fmt: skip
    consts = dict(HAS_UB=True, HAS_VTC=True, IEEE_DIV=True, NATIVE_CAST=True, BLOCK_T=2,
                  BLOCK_D=256, NUM_CHUNKS=1, COL64=False)  # fmt: skip
    written = written_arguments(tri._gather_quant_kernel, args, consts, monkeypatch)
    assert written == ["q_ptr", "scale_ptr"]
