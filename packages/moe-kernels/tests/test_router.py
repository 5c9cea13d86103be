"""Fused router scores against the torch formula and an independent float64 oracle.

Runs on the torch reference path (TRITON_INTERPRET=0) and on the Triton kernel in the
interpreter (TRITON_INTERPRET=1).

Tolerances. Upcasting x (bf16/fp16) and w to fp32 is exact, so the only errors are the fp32 sum
over D (kernel and reference sum in different orders) and the score function's exp / divide.
* Against the float64 oracle the bound is rigorous: for any summation order,
  |logit - exact| <= gamma_D * sum_d |x w| with gamma_D = D u / (1 - D u), u = 2**-24; a softmax
  score moves by at most s_e * (|dl_e| + max_j |dl_j|), a sigmoid by at most s * |dl|; plus a few
  ulps of exp / divide (8 u relative).
* Against the fp32 reference: rtol 1e-5, atol 1e-6. Rounding errors of a sum behave like a
  random walk: with w ~ N(0, 1/D) (the model's init) and x ~ N(0, 1), both logits sit within
  ~u * sqrt(D) * |logit scale| ~ 4e-6 of the exact one for D <= 4096, so relative score
  differences stay well under 1e-5 (2e-6 is typical at D = 256); atol covers scores near zero.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels._dispatch import use_triton
from moe_kernels.reference import router as ref
from moe_kernels.router import router_scores
from moe_kernels.testing import oracle_router_scores

CPU = torch.device("cpu")
TRITON = use_triton(CPU)
U = 2.0**-24


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + 0.05).to(dtype)  # random, non-zero


def make(num_tokens, num_experts, dim, x_dtype=torch.bfloat16, w_dtype=torch.float32, seed=0):
    x = rand((num_tokens, dim), x_dtype, seed)
    w = rand((num_experts, dim), w_dtype, seed + 1, scale=1.0 / math.sqrt(max(dim, 1)))
    return x, w


def assert_close_to_oracle(scores, x, w, score_fn):
    assert scores.dtype == torch.float32
    assert scores.shape == (x.shape[0], w.shape[0])
    exact, dl = oracle_router_scores(x, w, score_fn)
    if score_fn == "softmax":
        slack = dl + dl.amax(dim=1, keepdim=True) if dl.numel() else dl
    else:
        slack = dl
    tol = exact * (slack + 8 * U) + 1e-30
    err = (scores.double() - exact).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


def assert_close_to_reference(scores, x, w, score_fn):
    expected = ref.router_scores(x, w, score_fn)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# values


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dim", [32, 100, 256])
@pytest.mark.parametrize("num_experts", [1, 3, 16, 40])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 64])
def test_matches_reference_and_oracle(num_tokens, num_experts, dim, score_fn):
    x, w = make(num_tokens, num_experts, dim, seed=num_tokens * 7 + num_experts + dim)
    scores = router_scores(x, w, score_fn=score_fn)
    assert_close_to_reference(scores, x, w, score_fn)
    assert_close_to_oracle(scores, x, w, score_fn)
    if score_fn == "softmax" and num_tokens:
        torch.testing.assert_close(scores.sum(1), torch.ones(num_tokens), rtol=0, atol=4e-7)
    if num_experts == 1 and score_fn == "softmax":
        assert bool((scores == 1).all())  # exp(0) / exp(0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_dtypes(x_dtype, w_dtype):
    x, w = make(9, 5, 48, x_dtype, w_dtype, seed=3)
    for score_fn in ("softmax", "sigmoid"):
        scores = router_scores(x, w, score_fn=score_fn)
        assert_close_to_reference(scores, x, w, score_fn)
        assert_close_to_oracle(scores, x, w, score_fn)


def test_strided_inputs_and_determinism():
    base = rand((80, 2 * 72), torch.bfloat16, 11)
    x_rows = base[::2, :72]  # row stride 288, last dim contiguous
    x_cols = base[:40, ::2]  # last dim stride 2
    x_t = rand((72, 40), torch.bfloat16, 12).T  # column-major
    w = rand((72, 2 * 6), torch.float32, 13, scale=0.1).T  # (6, 72), strides (1, 12)
    for x in (x_rows, x_cols, x_t):
        assert not x.is_contiguous()
        for score_fn in ("softmax", "sigmoid"):
            scores = router_scores(x, w, score_fn=score_fn)
            assert_close_to_reference(scores, x, w, score_fn)
            assert_close_to_oracle(scores, x, w, score_fn)
            again = router_scores(x.contiguous(), w.contiguous(), score_fn=score_fn)
            assert torch.equal(scores, again)  # same bytes, same bits, whatever the layout


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid of -400 (numpy)
def test_large_logits_softmax_is_stable():
    x, w = make(6, 8, 64, torch.float32, seed=5)
    w = w * 400.0  # logits in the hundreds: exp without max-subtraction would overflow
    scores = router_scores(x, w)
    assert bool(torch.isfinite(scores).all())
    assert_close_to_oracle(scores, x, w, "softmax")
    sig = router_scores(x, w, score_fn="sigmoid")
    assert bool(torch.isfinite(sig).all()) and bool(((sig >= 0) & (sig <= 1)).all())


def test_zero_dim():
    x, w = torch.empty(3, 0), torch.empty(4, 0)
    torch.testing.assert_close(router_scores(x, w), torch.full((3, 4), 0.25), rtol=0, atol=0)
    sig = router_scores(x, w, score_fn="sigmoid")
    torch.testing.assert_close(sig, torch.full((3, 4), 0.5), rtol=0, atol=0)


@pytest.mark.skipif(not TRITON, reason="launch configs exist only on the Triton path")
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("mode", ["dot", "sum", "acc3"])
@pytest.mark.parametrize("block_t,block_d", [(16, 16), (32, 64), (4, 32), (4, 128)])
def test_kernel_configs(mode, block_t, block_d, prefetch):
    """Several programs, a ragged last D chunk (D=80), E padded to 32; (4, 128): one D chunk."""
    from moe_kernels._triton import router as tri

    x, w = make(37, 20, 80, seed=17)
    cfg = tri.RouterConfig(block_t, block_d, 4, 1, mode == "dot", mode == "acc3", prefetch)
    for score_fn in ("softmax", "sigmoid"):
        scores = tri.router_scores(x, w, score_fn == "sigmoid", config=cfg)
        assert_close_to_reference(scores, x, w, score_fn)
        assert_close_to_oracle(scores, x, w, score_fn)


def test_pick_config_shapes():
    pytest.importorskip("triton")
    from moe_kernels._triton import router as tri

    for num_tokens in (1, 512, 2048, 16384):
        for num_experts in (1, 16, 128, 1000):
            cfg = tri.pick_config(num_tokens, 2048, num_experts)
            for v in (cfg.block_t, cfg.block_d):
                assert v >= 1 and v & (v - 1) == 0
            assert cfg.block_d >= 16
            be = tri.block_e(num_experts)
            assert be >= max(16, num_experts) and be & (be - 1) == 0
            if not TRITON:  # the GPU rule: partial sums, <= 128 accumulator registers per thread
                assert cfg.acc3 and not cfg.dot
                assert cfg.block_t * be * cfg.block_d <= 128 * 32 * cfg.num_warps


# --------------------------------------------------------------------------------------------
# argument checks


@pytest.mark.parametrize(
    "x,w,kwargs,exc,name",
    [
        (torch.zeros(2, 3, 4), torch.zeros(4, 4), {}, ValueError, "x_TD"),
        (torch.zeros(4, 4), torch.zeros(4), {}, ValueError, "weight_ED"),
        (torch.zeros(4, 4, dtype=torch.int32), torch.zeros(2, 4), {}, TypeError, "x_TD"),
        (torch.zeros(4, 4), torch.zeros(2, 4, dtype=torch.float64), {}, TypeError, "weight_ED"),
        (torch.zeros(4, 4), torch.zeros(2, 5), {}, ValueError, "weight_ED"),
        (torch.zeros(4, 4), torch.zeros(0, 4), {}, ValueError, "weight_ED"),
        ([[1.0]], torch.zeros(2, 4), {}, TypeError, "x_TD"),
        (torch.zeros(4, 4), torch.zeros(2, 4), {"score_fn": "relu"}, ValueError, "score_fn"),
        (torch.zeros(4, 4), torch.zeros(2, 4), {"score_fn": None}, TypeError, "score_fn"),
        (torch.zeros(4, 4), torch.zeros(2, 4, device="meta"), {}, ValueError, "weight_ED"),
    ],
)
def test_bad_arguments(x, w, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        router_scores(x, w, **kwargs)


# --------------------------------------------------------------------------------------------
# custom op: opcheck and torch.compile


def test_opcheck():
    x, w = make(6, 5, 40, seed=21)
    for score_fn in ("softmax", "sigmoid"):
        torch.library.opcheck(
            torch.ops.moe_kernels.router_scores.default,
            (x, w, score_fn),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_torch(score_fn, x_dtype):
    x0, w0 = make(9, 6, 40, x_dtype, seed=27)
    g = rand((9, 6), torch.float32, 28)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    (router_scores(x, w, score_fn=score_fn) * g).sum().backward()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    (ref.router_scores(xr, wr, score_fn) * g).sum().backward()
    assert x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if x_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
    # only the weight needs a gradient (a frozen input)
    w2 = w0.clone().requires_grad_()
    router_scores(x0, w2, score_fn=score_fn).sum().backward()
    assert w2.grad is not None and bool(torch.isfinite(w2.grad).all())


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_experts", [6, 40])  # the "fma" and "split" variants
def test_compile_fullgraph_matches_eager(num_experts, device):
    """Scores and both gradients bit for bit. On CUDA Inductor emits the kernels in its own code
    (the comparison can fail there); on CPU the op stays opaque, so this checks that the step
    traces whole (``fullgraph``) and that its backward round trip changes nothing."""
    torch._dynamo.reset()
    x0, w0 = (t.to(device) for t in make(7, num_experts, 48, seed=23))
    g = rand((7, num_experts), torch.float32, 24).to(device)

    def step(x, w):
        return router_scores(x, w) + router_scores(x, w, score_fn="sigmoid")

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        (y * g).sum().backward()
        return y.detach(), x.grad, w.grad

    got = run(torch.compile(step, fullgraph=True, backend="inductor"))
    for a, b in zip(got, run(step), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# variants


def test_router_variant_rule():
    from moe_kernels.router import FMA_MAX_E, router_variant

    assert router_variant(FMA_MAX_E, torch.bfloat16) == "fma"
    assert router_variant(FMA_MAX_E + 1, torch.bfloat16) == "split"
    assert router_variant(128, torch.float16) == router_variant(128, torch.float32) == "fp32"


def test_split_pieces_are_exact():
    from moe_kernels._router_split import split3

    w = torch.cat([rand((64, 96), torch.float32, 40), torch.tensor([[3e-30, -1e30, 1.0, 0.0]])
                   .expand(64, 4)], dim=1)  # fmt: skip
    pieces = split3(w)
    assert pieces.dtype == torch.bfloat16
    assert torch.equal((pieces[0].float() + pieces[1].float()) + pieces[2].float(), w)
    if use_triton(w.device):  # the kernel's pieces (the interpreter truncates its casts: other
        # pieces than split3's round-to-nearest ones, also exact)
        from moe_kernels._triton.router_split import split_grad, split_weight

        w4 = split_weight(w).view(4, *w.shape).float()
        assert torch.equal(w4[0], w4[1]) and torch.equal((w4[1] + w4[2]) + w4[3], w)
        s = torch.softmax(rand((5, 100), torch.float32, 45), dim=-1)
        g = rand((5, 100), torch.float32, 46)
        a, b = (t.float().view(5, 3, 100) for t in split_grad(g, s, True))
        dl = s * (g - (g * s).sum(-1, keepdim=True))
        scale = float(dl.abs().max())  # cancellation: a few fp32 ulps of the largest
        torch.testing.assert_close((b[:, 0] + b[:, 1]) + b[:, 2], dl, rtol=1e-6, atol=1e-6 * scale)
        assert torch.equal(a[:, 0], b[:, 1]) and torch.equal(a[:, 1], b[:, 0])
        assert torch.equal(a[:, 2], b[:, 0])


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_split_variant_forward_and_backward(score_fn):
    """The split GEMMs (their CPU form: fp32 math of the exact pieces) against the float64 oracle
    and the fp32 formula's gradients, at 64 experts (what CUDA runs for bf16 x past FMA_MAX_E)."""
    from moe_kernels import _router_split as split

    x0, w0 = make(37, 64, 200, seed=41)
    logits = split.logits(x0, w0)
    exact, bound = oracle_router_scores(x0, w0, "softmax")
    l64 = x0.double() @ w0.double().T
    assert bool(((logits.double() - l64).abs() <= bound + 4 * U * l64.abs()).all())
    g0 = rand((37, 64), torch.float32, 42)
    s0 = torch.softmax(rand((37, 64), torch.float32, 44), dim=-1)
    for fn in ("softmax", "sigmoid"):
        dx, dw = split.scores_backward(g0, s0, fn, x0, w0)
        assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
        g, s = g0.double(), s0.double()
        dl = s * (g - (g * s).sum(-1, keepdim=True)) if fn == "softmax" else g * s * (1 - s)
        torch.testing.assert_close(dx.double(), dl @ w0.double(), rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(dw.double(), dl.T @ x0.double(), rtol=1e-5, atol=1e-6)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    g = rand((37, 64), torch.float32, 43)
    scores = router_scores(x, w, score_fn=score_fn)
    assert_close_to_oracle(scores, x0, w0, score_fn)
    (scores * g).sum().backward()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    (ref.router_scores(xr, wr, score_fn) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
