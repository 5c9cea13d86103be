"""MoELayer: every implementation against the baseline and an independent per-token oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_kernels import topk_choices
from moe_model import IMPLS, MOE_IMPLS, MoELayer

D, E, K, H, T = 64, 8, 3, 32, 40


def make_layer(impl: str = "baseline", dtype=torch.float32, seed=0, **kw) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(D, E, K, H, impl=impl, **kw).requires_grad_(False)
    layer.in_proj.data = layer.in_proj.data.to(dtype)
    layer.out_proj.data = layer.out_proj.data.to(dtype)
    return layer


def naive_oracle(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token in float64, top-k by a Python sort (score desc, expert asc)."""
    w_r = layer.router.weight.double()
    w_in, w_out = layer.in_proj.double(), layer.out_proj.double()
    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t in range(x_TD.shape[0]):
        x = x_TD[t].double()
        logits = w_r @ x
        s = torch.softmax(logits, 0) if layer.score_fn == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(layer.n_experts), key=lambda e: (-float(s[e]), e))[: layer.top_k]
        total = sum(float(s[e]) for e in chosen)
        for e in chosen:
            h = w_in[e] @ x
            if layer.gated:
                g, u = h.chunk(2)
                a = F.silu(g) * u
            else:
                a = F.silu(h)
            w = float(s[e]) / total if layer.renormalize else float(s[e])
            out[t] += w * (w_out[e] @ a)
    return out


VARIANTS = [
    dict(),
    dict(gated=True),
    dict(score_fn="sigmoid", renormalize=True),
    dict(gated=True, renormalize=True),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=str)
def test_baseline_matches_naive_oracle(kw):
    layer = make_layer(**kw)
    x = torch.randn(T, D)
    y = layer(x)
    torch.testing.assert_close(y.double(), naive_oracle(layer, x), atol=1e-5, rtol=1e-5)


def _tolerance(impl: str, dtype: torch.dtype) -> dict:
    # fp32 paths differ from the fp32 baseline only by summation order: 1e-5.
    # bf16 weights/activations: the grouped GEMM outputs and the activation round to bf16
    # (2^-8 relative), the fp32 baseline does not: 3e-2 relative to the output scale.
    # triton_bf16 also rounds the combine output to bf16 (one more 2^-8). triton_fp32's first
    # GEMM is moe-kernels' own grouped GEMM (another summation order), still fp32.
    if dtype == torch.float32 and impl in ("torch", "triton_fp32"):
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=3e-2, rtol=3e-2)


SYNC_FREE = ["torch", "triton_bf16", "triton_fp32"]


@pytest.mark.parametrize("impl", SYNC_FREE + ["fbgemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", VARIANTS, ids=str)
def test_impl_matches_baseline(impl, dtype, kw):
    if impl == "fbgemm" and not IMPLS["fbgemm"].available:
        pytest.skip("unavailable: fbgemm_gpu not installed")
    layer = make_layer(dtype=dtype, **kw)
    x = torch.randn(T, D).to(dtype)
    y_ref = layer(x)
    layer.impl = impl
    y = layer(x)
    assert y.dtype == dtype and y.shape == x.shape
    scale = y_ref.float().abs().max()
    tol = _tolerance(impl, dtype)
    torch.testing.assert_close(y.float() / scale, y_ref.float() / scale, **tol)


def test_mxfp8_within_fp8_error():
    layer = make_layer(dtype=torch.bfloat16)
    x = torch.randn(T, D).to(torch.bfloat16)
    y_ref = layer(x).float()
    layer.impl = "mxfp8"
    y = layer(x).float()
    # e4m3 keeps 3 mantissa bits (relative step 2^-3 at worst, ~2^-5 rms per operand); over
    # K-long dot products the relative Frobenius error of the output stays a few percent.
    rel = (y - y_ref).norm() / y_ref.norm()
    assert 1e-4 < rel < 0.1, rel  # quantised (not equal) but close
    assert torch.equal(layer(x), layer(x))


@pytest.mark.parametrize("impl", SYNC_FREE + ["mxfp8"])
def test_deterministic(impl):
    layer = make_layer(impl=impl, dtype=torch.bfloat16)
    x = torch.randn(T, D).to(torch.bfloat16)
    y1, y2 = layer(x), layer(x)
    assert torch.equal(y1, y2)


def test_leading_dims_and_impl_switch():
    layer = make_layer(impl="torch")
    x = torch.randn(2, 5, D)
    y = layer(x)
    assert y.shape == x.shape
    layer.impl = "triton_fp32"
    torch.testing.assert_close(layer(x), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1, 3], layer(x.reshape(-1, D))[8], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(gated=True, renormalize=True)], ids=str)
def test_torch_gradients_match_baseline(kw):
    grads = {}
    x0 = torch.randn(T, D)
    for impl in ("baseline", "torch"):
        layer = make_layer(impl=impl, **kw).requires_grad_(True)
        x = x0.clone().requires_grad_(True)
        g_out = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
        (layer(x) * g_out).sum().backward()
        grads[impl] = [x.grad, layer.router.weight.grad, layer.in_proj.grad, layer.out_proj.grad]
    for a, b in zip(grads["torch"], grads["baseline"], strict=True):
        assert a is not None and a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", SYNC_FREE)
def test_compile_fullgraph_equals_eager(impl):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if impl == "triton_bf16" else torch.float32
    layer = make_layer(impl=impl, dtype=dtype)
    x = torch.randn(T, D).to(dtype)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        y_c, y_e = compiled(x), layer(x)
    # Fused elementwise code may round differently from eager: fp32 to 1e-6, bf16 to one ulp.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(y_c, y_e, **tol)
    assert torch.equal(compiled(x), y_c)


def test_topk_ties_and_nan():
    s = torch.tensor([[0.2, 0.5, 0.5, 0.1], [float("nan"), 0.3, 0.3, 0.3]])
    w, e = topk_choices(s, 2, renormalize=False)
    assert e.tolist() == [[1, 2], [1, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5], [0.3, 0.3]]))
    w, e = topk_choices(s, 4, renormalize=False)
    assert e[1].tolist() == [1, 2, 3, 0]  # NaN ranks last, like -inf


def test_bad_arguments():
    with pytest.raises(ValueError, match="impl"):
        MoELayer(D, E, K, H, impl="nope")
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(D, 4, 5, H)
    with pytest.raises(ValueError, match="score_fn"):
        MoELayer(D, E, K, H, score_fn="relu")
    layer = MoELayer(D, E, K, H, impl="torch")
    with pytest.raises(ValueError, match="impl"):
        layer.impl = "fast"
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(3, D + 1))
    assert set(MOE_IMPLS) == {
        "baseline",
        "torch",
        "triton_bf16",
        "triton_fp32",
        "fbgemm",
        "mxfp8",
        "fp8",
    }
    layer.impl = "triton_fused"  # a former name, kept as an alias
    assert layer.impl == "triton_bf16"


def _layer(**kw) -> MoELayer:
    return MoELayer(
        **{"d_model": D, "n_experts": E, "top_k": K, "hidden": H, "impl": "torch", **kw}
    )


def _switch(impl: str, **kw) -> None:
    _layer(**kw).impl = impl


MXFP8 = "impl='mxfp8' needs d_model and hidden multiples of 32"


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: MoELayer(64, 4, 2, 48, impl="mxfp8"), ValueError, MXFP8),  # the case
        (lambda: _layer(d_model=48, impl="mxfp8"), ValueError, MXFP8),
        (lambda: _switch("mxfp8", hidden=48), ValueError, MXFP8),  # impl setter
        (lambda: _layer(d_model=True), ValueError, "d_model must be a positive int"),
        (lambda: _layer(n_experts=True), ValueError, "n_experts must be a positive int"),
        (lambda: _layer(hidden=True), ValueError, "hidden must be a positive int"),
        (lambda: _layer(top_k=True), ValueError, "top_k must be in"),
        (lambda: _layer(gated="yes"), TypeError, "gated must be a bool"),
        (lambda: _layer(renormalize=1), TypeError, "renormalize must be a bool"),
        (lambda: _layer()([[0.0] * D]), TypeError, "x must be a torch.Tensor"),
        (lambda: _layer()(torch.tensor(1.0)), ValueError, r"x must have shape \(\.\.\., d_model"),
        (
            lambda: _layer()(torch.ones(3, D, dtype=torch.int64)),
            TypeError,
            r"x\.dtype must be one of",
        ),
        (
            lambda: _layer(impl="triton_bf16")(torch.ones(3, D, dtype=torch.float64)),
            TypeError,
            r"x\.dtype must be one of .* for impl 'triton_bf16'",
        ),
        (
            lambda: _layer()(torch.ones(3, D, device="meta")),
            ValueError,
            "x is on meta, the layer on cpu",
        ),
        (lambda: _layer().scores(torch.ones(3, D + 1)), ValueError, r"x must have shape"),
        (
            lambda: _layer(impl="triton_fp32").scores(torch.ones(3, D, dtype=torch.int32)),
            TypeError,
            r"x\.dtype must be one of",
        ),
    ],
)
def test_bad_layer_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(IMPLS["fbgemm"].available, reason="fbgemm_gpu is installed")
def test_fbgemm_unavailable_error():
    with pytest.raises(RuntimeError, match="unavailable: fbgemm_gpu not installed"):
        MoELayer(D, E, K, H, impl="fbgemm")


def test_parameter_shapes():
    layer = MoELayer(D, E, K, H, gated=True)
    assert layer.router.weight.shape == (E, D) and layer.router.weight.dtype == torch.float32
    assert layer.router.bias is None
    assert layer.in_proj.shape == (E, 2 * H, D) and layer.out_proj.shape == (E, D, H)
    n = sum(p.numel() for p in layer.parameters())
    assert n == E * D + E * 2 * H * D + E * D * H
    assert math.isfinite(float(layer(torch.randn(3, D)).detach().sum()))


def _cpu_grouped_mm_works() -> bool:
    try:
        a, b = (
            torch.zeros(4, 16, dtype=torch.bfloat16),
            torch.zeros(2, 16, 16, dtype=torch.bfloat16),
        )
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="torch._grouped_mm does not run on CPU")
@pytest.mark.parametrize("impl", ["torch", "triton_bf16"])
def test_grouped_mm_path_compiles(impl, monkeypatch):
    """The torch._grouped_mm path (on plan.offsets[1:]) forced on CPU: eager equals the
    static-loop fallback (forced too), and it traces with fullgraph=True (as it must on the GPU)."""
    from moe_model import expert_ops

    torch._dynamo.reset()
    layer = make_layer(impl=impl, dtype=torch.bfloat16)
    x = torch.randn(T, D).to(torch.bfloat16)
    monkeypatch.setattr(expert_ops, "grouped_mm_supported", lambda a, b: False)
    y_loop = layer(x)
    monkeypatch.setattr(expert_ops, "grouped_mm_supported", lambda a, b: True)
    y_gmm = layer(x)
    torch.testing.assert_close(y_gmm, y_loop, atol=1e-2, rtol=8e-3)
    with torch.no_grad():
        y_c = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(y_c, y_gmm, atol=1e-2, rtol=8e-3)
