"""``qk_norm_rope`` (QK RMS-norm + RoPE + KV ring write) against the world model's formula.

Runs on the torch reference path (TRITON_INTERPRET=0) and on the Triton kernel in the
interpreter (TRITON_INTERPRET=1).

* The reference equals the model's former code path (``RMSNorm`` then ``apply_rope`` then
  ``index_copy_``, written out below) bit for bit, and a float64 oracle to rounding.
* Kernel vs reference. They differ only in the order of the fp32 sum over D (and, in the
  interpreter, in truncating fp32 -> bf16 casts instead of rounding to nearest). Let r be the
  magnitude of a rotation pair of normed values (r = |(y0, y1)|, which the rotation keeps) and
  ulp(r) the spacing of the dtype at r. bf16 / fp16: a normed value is the same or one ulp off,
  so a rotated value moves by at most (|c| + |s|) ulp(r) <= 1.42 ulp(r) before its last
  rounding, which adds at most 1.5 ulp(r) (rounding vs truncating): tolerance 3 ulp(r) (on
  the GPU, which rounds both, the same argument gives 2.5). fp32: the normed value carries the
  sum's order noise (a few ulps; the rigorous worst case grows with D), tolerance 8 ulp(r) (5
  seen over the seeds tried). v is copied bit for bit; every cache element outside the written
  slots is unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.reference import rope as ref
from moe_kernels.rope import qk_norm_rope
from moe_kernels.testing import oracle_norm_rope, oracle_rope_model_formula

CPU = torch.device("cpu")
TRITON = use_triton(CPU)
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
TOL_ULPS = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 8}
EPS = 1e-6


class Problem:
    """q, k, v as column slices of one (N, (H + 2K) * D) projection output, scales, angles,
    caches (L, K, S, N, D) poisoned with NaN."""

    def __init__(self, N=37, H=4, K=2, D=16, L=3, S=4, dtype=torch.bfloat16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.N, self.H, self.K, self.D, self.L, self.S, self.dtype = N, H, K, D, L, S, dtype
        self.qkv = (torch.randn(N, (H + 2 * K) * D, generator=g) * 2 + 0.1).to(dtype)
        self.q = self.qkv[:, : H * D]
        self.k = self.qkv[:, H * D : (H + K) * D]
        self.v = self.qkv[:, (H + K) * D :]
        self.q_weight = torch.rand(D, generator=g) + 0.5
        self.k_weight = torch.rand(D, generator=g) + 0.5
        ang_NP = torch.randn(N, D // 2, generator=g) * 3
        self.cos, self.sin = torch.cos(ang_NP), torch.sin(ang_NP)
        self.k_cache = torch.full((L, K, S, N, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full((L, K, S, N, D), float("nan"), dtype=dtype)

    def args(self, layer, slots, q=True):
        return (
            self.q if q else None, self.k, self.v, self.q_weight if q else None, self.k_weight,
            self.cos, self.sin, self.k_cache, self.v_cache, layer, slots,
        )  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (at least its smallest normal's), fp32."""
    tiny = torch.finfo(dtype).tiny
    e = torch.floor(torch.log2(x.float().abs().clamp_min(tiny)))
    return torch.exp2(e - MANTISSA[dtype])


def pair_norm(x_NC: torch.Tensor, w_D: torch.Tensor) -> torch.Tensor:
    """r per element of (N, h, D): the magnitude of its rotation pair of normed values."""
    D = w_D.shape[0]
    y = ref.rms_norm(x_NC.reshape(x_NC.shape[0], -1, D), w_D, EPS).float()
    r = y.unflatten(-1, (D // 2, 2)).norm(dim=-1, keepdim=True)
    return r.expand(*r.shape[:-1], 2).flatten(-2)


def assert_rope_close(got_hND: torch.Tensor, want_hND: torch.Tensor, r_hND: torch.Tensor):
    """Bitwise on the reference path; within TOL_ULPS ulp(r) where the kernel runs."""
    assert got_hND.shape == want_hND.shape and got_hND.dtype == want_hND.dtype
    if not TRITON:
        assert torch.equal(bits(got_hND), bits(want_hND))
        return
    err = (got_hND.float() - want_hND.float()).abs()
    tol = TOL_ULPS[got_hND.dtype] * ulp(r_hND, got_hND.dtype)
    assert bool(torch.isfinite(got_hND).all())
    assert bool((err <= tol).all()), float((err / tol).max())


def expected_caches(p: Problem, layer, slots, q=True):
    """The caches after the reference call, and the reference's q_out."""
    kc, vc = p.k_cache.clone(), p.v_cache.clone()
    args = list(p.args(layer, slots, q))
    args[7:9] = kc, vc
    q_out = ref.qk_norm_rope(*args, EPS)
    return kc, vc, q_out


def check_call(p: Problem, layer, slots, q=True):
    kc, vc, want_q = expected_caches(p, layer, slots, q)
    got_q = qk_norm_rope(*p.args(layer, slots, q), eps=EPS)
    written = torch.zeros(p.L, p.K, p.S, dtype=torch.bool)
    written[layer, :, slots] = True
    # outside the written slots every bit is unchanged (NaN poison included)
    assert torch.equal(bits(p.k_cache[~written]), bits(kc[~written]))
    assert torch.equal(bits(p.v_cache[~written]), bits(vc[~written]))
    r_KND = pair_norm(p.k, p.k_weight).transpose(0, 1)
    for s in slots.tolist():
        assert torch.equal(bits(p.v_cache[layer, :, s]), bits(vc[layer, :, s]))  # a bit copy
        assert_rope_close(p.k_cache[layer, :, s], kc[layer, :, s], r_KND)
    if q:
        assert got_q.shape == (p.H, p.N, p.D) and got_q.is_contiguous()
        assert_rope_close(got_q, want_q, pair_norm(p.q, p.q_weight).transpose(0, 1))
    else:
        assert got_q.shape == (0, p.N, p.D) and got_q.dtype == p.dtype
    return got_q


# --------------------------------------------------------------------------------------------
# the reference is the model's formula


@pytest.mark.parametrize("dtype", FLOATS)
def test_reference_is_the_model_formula_bit_for_bit(dtype):
    p = Problem(N=20, H=4, K=2, D=16, dtype=dtype, seed=1)
    slot = torch.tensor([3])
    kc, vc = p.k_cache.clone(), p.v_cache.clone()
    want_q = oracle_rope_model_formula(
        p.q, p.k, p.v, p.q_weight, p.k_weight, p.cos, p.sin, kc, vc, 2, slot, EPS
    )
    got_q = ref.qk_norm_rope(*p.args(2, slot), EPS)
    assert torch.equal(bits(got_q.view(p.K, -1, p.D)), bits(want_q))
    assert torch.equal(bits(p.k_cache), bits(kc)) and torch.equal(bits(p.v_cache), bits(vc))


def test_reference_matches_float64_oracle():
    """rope(norm(x)) in float64 with the rotation as a complex product: the fp32 reference is
    within a few fp32 ulps of it (an independent formula, not the same ops)."""
    p = Problem(N=12, H=2, K=1, D=8, dtype=torch.float32, seed=2)
    want = oracle_norm_rope(p.q, p.q_weight, p.cos, p.sin, EPS)  # (N, H, D)
    got = ref.norm_rope(p.q, p.q_weight, p.cos, p.sin, EPS).double()
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())


# --------------------------------------------------------------------------------------------
# values: the public op (the kernel under the interpreter) against the reference


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("D", [16, 24])  # 24: a head dim that is no power of two (masked)
@pytest.mark.parametrize("slots", [[2], [3, 0]], ids=["scratch", "scratch+ring"])
def test_matches_reference(dtype, D, slots):
    p = Problem(N=37, H=4, K=2, D=D, dtype=dtype, seed=D + len(slots))
    check_call(p, 1, torch.tensor(slots))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_q_writes_the_same_cache(dtype):
    p = Problem(N=9, dtype=dtype, seed=4)
    slots = torch.tensor([0, 3])
    check_call(p, 2, slots, q=False)
    with_q = Problem(N=9, dtype=dtype, seed=4)
    qk_norm_rope(*with_q.args(2, slots), eps=EPS)
    assert torch.equal(bits(with_q.k_cache), bits(p.k_cache))
    assert torch.equal(bits(with_q.v_cache), bits(p.v_cache))


def test_seed_head_dim_and_one_token():
    """D=64 (the seed model's head dim), G=2; a single token; layer 0 and the last layer."""
    p = Problem(N=5, H=4, K=2, D=64, L=2, S=3, seed=5)
    check_call(p, 0, torch.tensor([2]))
    check_call(p, 1, torch.tensor([1, 2]))
    one = Problem(N=1, H=2, K=1, D=64, L=1, S=2, seed=6)
    check_call(one, 0, torch.tensor([0, 1]))


def test_layouts_and_determinism():
    """Column slices (row stride (H+2K)*D), a transposed layout (column stride N) and contiguous
    copies give the same bits; a second call gives the same bits."""
    p = Problem(N=24, H=4, K=2, D=16, seed=7)
    slots = torch.tensor([1, 3])
    q1 = check_call(p, 0, slots)
    cont = Problem(N=24, H=4, K=2, D=16, seed=7)
    cont.q, cont.k, cont.v = cont.q.contiguous(), cont.k.contiguous(), cont.v.contiguous()
    q2 = qk_norm_rope(*cont.args(0, slots), eps=EPS)
    trans = Problem(N=24, H=4, K=2, D=16, seed=7)
    qkv_t = trans.qkv.T.contiguous().T  # strides (1, N)
    H, K, D = 4, 2, 16
    trans.q, trans.k, trans.v = (qkv_t[:, : H * D], qkv_t[:, H * D : (H + K) * D],
                                 qkv_t[:, (H + K) * D :])  # fmt: skip
    assert trans.q.stride() == (1, 24)
    q3 = qk_norm_rope(*trans.args(0, slots), eps=EPS)
    for other in (cont, trans):
        assert torch.equal(bits(other.k_cache), bits(p.k_cache))
        assert torch.equal(bits(other.v_cache), bits(p.v_cache))
    assert torch.equal(bits(q1), bits(q2)) and torch.equal(bits(q1), bits(q3))
    q4 = qk_norm_rope(*p.args(0, slots), eps=EPS)
    assert torch.equal(bits(q4), bits(q1))


def test_duplicate_slots_and_bf16_weights():
    """Both entries the same slot (one write, same values); scales in bf16, as the engine casts
    the model's parameters (upcast exactly)."""
    p = Problem(N=10, seed=8)
    p.q_weight, p.k_weight = p.q_weight.bfloat16(), p.k_weight.bfloat16()
    check_call(p, 1, torch.tensor([2, 2]))


def test_kernel_skips_out_of_range_slots():
    p = Problem(N=8, seed=9)
    before_k, before_v = p.k_cache.clone(), p.v_cache.clone()
    qk_norm_rope(*p.args(0, torch.tensor([-1, 4])), eps=EPS)  # S = 4
    assert torch.equal(bits(p.k_cache), bits(before_k))
    assert torch.equal(bits(p.v_cache), bits(before_v))


def test_empty_frame():
    p = Problem(N=0, seed=10)
    q_out = qk_norm_rope(*p.args(0, torch.tensor([1])), eps=EPS)
    assert q_out.shape == (4, 0, 16)


# --------------------------------------------------------------------------------------------
# argument checks: raise naming the argument, caches untouched


def _bad_cases():
    p = Problem(N=6, H=4, K=2, D=8, L=2, S=3, seed=11)
    good = dict(zip(
        ["q", "k", "v", "q_weight", "k_weight", "cos", "sin", "k_cache", "v_cache", "layer",
         "slots"], p.args(1, torch.tensor([0])), strict=True,
    ))  # fmt: skip
    f16 = torch.float16
    cases = [  # (argument, bad value, exception, what the message must say)
        ("k", [[1.0]], TypeError, "k must be a torch.Tensor"),
        ("k", p.k[:, :-1], ValueError, "k must have size 16 in dim 1"),  # K*D columns
        ("k", p.k[:-1], ValueError, "k must have size 6 in dim 0"),  # N rows
        ("k", p.k.float(), TypeError, "v must have k's dtype"),  # the others are bf16
        ("k", p.k[None], ValueError, "k must be 2-D"),
        ("k", p.k.to("meta"), ValueError, "must be on k's device"),
        ("v", p.v.to(f16), TypeError, "v must have k's dtype"),
        ("v", p.v[:, :8], ValueError, "v must have size 16 in dim 1"),
        ("q", p.q.to(f16), TypeError, "q must have k's dtype"),
        ("q", p.q[:, :-1], ValueError, "q's columns must be H\\*D"),
        ("q", p.q[:-2], ValueError, "q must have size 6 in dim 0"),
        ("q_weight", None, TypeError, "q_weight must be a torch.Tensor"),  # needed with q
        ("q_weight", torch.ones(9), ValueError, "q_weight must have size 8"),
        ("k_weight", torch.ones(8, dtype=torch.int32), TypeError, "k_weight must have dtype"),
        ("k_weight", torch.ones(1, 8), ValueError, "k_weight must be 1-D"),
        ("cos", p.cos[:, :3], ValueError, "cos must have size 4 in dim 1"),
        ("sin", p.sin.double(), TypeError, "sin must have dtype"),
        ("sin", p.sin[:5], ValueError, "sin must have size 6 in dim 0"),
        ("k_cache", p.k_cache[..., :4], ValueError, "v_cache must have k_cache's shape"),
        ("k_cache", p.k_cache.transpose(0, 1).contiguous().transpose(0, 1), ValueError,
         "k_cache must be contiguous"),
        ("k_cache", p.k_cache[0], ValueError, "k_cache must be 5-D"),
        ("k_cache", p.k_cache.float(), TypeError, "k_cache must have k's dtype"),
        ("v_cache", p.v_cache[:1], ValueError, "v_cache must have k_cache's shape"),
        ("v_cache", p.k_cache, ValueError, "v_cache must be another tensor than k_cache"),
        ("caches", torch.empty(2, 2, 3, 6, 3, dtype=torch.bfloat16), ValueError,
         "head dim .* must be even"),
        ("layer", 2, ValueError, "layer must be in \\[0, 1\\]"),
        ("layer", -1, ValueError, "layer must be in"),
        ("layer", 1.0, TypeError, "layer must be an int"),
        ("layer", True, TypeError, "layer must be an int"),
        ("slots", torch.tensor([0], dtype=torch.int32), TypeError, "slots must have dtype"),
        ("slots", torch.tensor([[0]]), ValueError, "slots must be 1-D"),
        ("slots", torch.tensor([0, 1, 2]), ValueError, "slots must hold 1 or 2"),
        ("slots", torch.tensor([], dtype=torch.int64), ValueError, "slots must hold 1 or 2"),
        ("slots", [0], TypeError, "slots must be a torch.Tensor"),
        ("eps", "1e-6", TypeError, "eps must be a float"),
        ("eps", -1.0, ValueError, "eps must be a finite float >= 0"),
        ("eps", math.nan, ValueError, "eps must be a finite float >= 0"),
    ]  # fmt: skip
    return p, good, cases


@pytest.mark.parametrize("case", range(len(_bad_cases()[2])))
def test_bad_arguments(case):
    p, good, cases = _bad_cases()
    name, value, exc, match = cases[case]
    kwargs = dict(good, eps=EPS)
    if name == "caches":  # both caches of another shape
        kwargs["k_cache"], kwargs["v_cache"] = value, value.clone()
    else:
        kwargs[name] = value
    before_k, before_v = p.k_cache.clone(), p.v_cache.clone()
    with pytest.raises(exc, match=match):
        qk_norm_rope(**kwargs)
    assert torch.equal(bits(p.k_cache), bits(before_k))
    assert torch.equal(bits(p.v_cache), bits(before_v))


# --------------------------------------------------------------------------------------------
# custom op: opcheck and torch.compile


def test_opcheck():
    p = Problem(N=6, H=4, K=2, D=8, L=2, S=3, seed=12)
    op = torch.ops.moe_kernels.qk_norm_rope.default
    for q, slots in ((True, torch.tensor([2, 0])), (False, torch.tensor([1]))):
        torch.library.opcheck(
            op, (*p.args(1, slots, q), EPS), test_utils=("test_schema", "test_faketensor")
        )


def test_compile_fullgraph_matches_eager():
    """A denoise-then-commit step as the model runs it: scratch slot with q, read the cache, the
    ring slot without q; compiled (Inductor, fullgraph) equals eager bit for bit."""
    torch._dynamo.reset()

    def step(p_args, ring):
        q, k, v, qw, kw, cos, sin, kc, vc, layer, scratch = p_args
        q_out = qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, layer, scratch, eps=EPS)
        seen = kc[layer] + vc[layer]  # reads the freshly written slot
        qk_norm_rope(None, k, v, None, kw, cos, sin, kc, vc, layer, ring, eps=EPS)
        return q_out * 2, seen

    eager_p, comp_p = Problem(N=8, dtype=torch.float32, seed=13), Problem(N=8, dtype=torch.float32,
                                                                          seed=13)  # fmt: skip
    for p in (eager_p, comp_p):
        p.k_cache.zero_()
        p.v_cache.zero_()
    ring = torch.tensor([1])
    want = step(eager_p.args(2, torch.tensor([3])), ring)
    got = torch.compile(step, fullgraph=True, backend="inductor")(
        comp_p.args(2, torch.tensor([3])), ring
    )
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(eager_p.k_cache, comp_p.k_cache)
    assert torch.equal(eager_p.v_cache, comp_p.v_cache)
    assert bool(comp_p.k_cache[2, :, 1].ne(0).any())


class _Stop(Exception):
    """Raised once the post-grad graph is read: nothing is lowered for the stand-in device."""


@pytest.mark.skipif(INTERPRET, reason="the interpreter's kernels cannot be traced")
def test_compiled_graph_writes_the_caches_in_place(monkeypatch):
    """The model's commit form under ``torch.compile``, traced as it is on CUDA (the CPU stands in:
    the launches are traced for an sm_90 target, not run; as ``test_inductor_graph.py`` does):
    after Inductor's reinplacing both calls are in-place kernel launches into the caches (graph
    inputs), with no clone and no cache-sized buffer; the only copies left are the caches'
    self-copies (``copy_(c, c)``, which Inductor drops)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    import moe_kernels._dispatch as dispatch

    try:
        import torch._inductor.fx_passes.post_grad as post_grad

        lower = post_grad.decompose_triton_kernel_wrapper_functional
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"no post-grad lowering of triton launches here: {exc}")

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    nodes = []

    def read(graph):
        lower(graph)
        nodes.extend(n for n in graph.nodes if n.op == "call_function")
        raise _Stop

    monkeypatch.setattr(dispatch, "_BACKEND", "triton")  # CPU tensors run the launcher
    monkeypatch.setattr(dispatch, "_traced_kernels", lambda args: True)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90())
    monkeypatch.setattr(post_grad, "decompose_triton_kernel_wrapper_functional", read)

    def commit(q, k, v, qw, kw, cos, sin, kc, vc, scratch, ring):
        q_out = qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, 1, scratch, eps=EPS)
        seen = q_out.view(2, -1, 64) @ kc[1].view(2, -1, 64).transpose(1, 2)  # reads the slots
        qk_norm_rope(None, k, v, None, kw, cos, sin, kc, vc, 1, ring, eps=EPS)
        return q_out, seen

    p = Problem(N=64, H=4, K=2, D=64, L=2, S=3, seed=14)
    args = (*p.args(1, torch.tensor([2]))[:9], torch.tensor([2]), torch.tensor([0]))
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:  # noqa: PT011 - _Stop, wrapped by Inductor
        torch.compile(commit, fullgraph=True)(*args)
    stops, e = [], info.value
    while e is not None:
        stops.append(isinstance(e, _Stop))
        e = e.__cause__ or e.__context__
    if not any(stops):
        raise info.value
    torch._dynamo.reset()
    targets = [str(n.target) for n in nodes]
    launches = [n for n in nodes if "triton_kernel_wrapper" in str(n.target)]
    assert len(launches) == 2 and all("mutation" in str(n.target) for n in launches), targets
    cache_args = {n.kwargs["kwargs"][name] for n in launches for name in ("k_cache_ptr",
                  "v_cache_ptr")}  # fmt: skip
    assert len(cache_args) == 2 and all(a.op == "placeholder" for a in cache_args)
    copies = [n for n in nodes if "copy" in str(n.target) or "clone" in str(n.target)]
    assert all(n.args[0] is n.args[1] for n in copies), [n.format_node() for n in copies]
    assert not any("moe_kernels" in t or "scatter" in t for t in targets), targets
    cache_shape = [p.L, p.K, p.S, p.N, p.D]
    assert not any("empty" in str(n.target) and list(n.args[0]) == cache_shape for n in nodes)
