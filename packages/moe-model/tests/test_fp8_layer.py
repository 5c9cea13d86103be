"""``MoELayer(impl="fp8")``: FP8 experts for inference, against a float64 oracle of FBGEMM's
chain written here from the formulas (row-wise e4m3 quantisation, products of the dequantised
operands, bf16 GEMM outputs, the fp32 weighted sum), and its contract: quantised once, re-made
after a state-dict load, stale copies refused, checkpoints' FP8 weights loaded, bad input named.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.testing import execution_path
from moe_model import MoELayer, WorldEngine, WorldModelConfig

FP8 = torch.float8_e4m3fn
D, E, K, H = 64, 8, 2, 48


def quantise_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM's row-wise e4m3: s = 448 / max(amax, 1e-12) in fp32, q = e4m3(clamp(v * s)),
    the dequantisation scale 1 / s."""
    v = v.float()
    s = 448.0 / v.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return (v * s).clamp(-448, 448).to(FP8), 1.0 / s


def oracle(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """y_TD in x's dtype from the layer's router, its FP8 experts and the formulas above."""
    (w_in, s_in), (w_out, s_out) = layer.fp8.get()
    w_in = mk.Fp8Weights(w_in, s_in).dequantize(torch.float64)
    w_out = mk.Fp8Weights(w_out, s_out).dequantize(torch.float64)
    scores_TE = torch.softmax(x_TD.float() @ layer.router.weight.float().t(), dim=-1)
    w_Tk, e_Tk = torch.topk(scores_TE, layer.top_k, dim=-1)
    q, sx = quantise_rows(x_TD)
    y_TD = torch.zeros(x_TD.shape[0], D, dtype=torch.float32)
    for t in range(x_TD.shape[0]):
        for j in range(layer.top_k):
            e = int(e_Tk[t, j])
            h = (q[t].double() * sx[t].double()) @ w_in[e].t()
            h = h.to(torch.bfloat16).float()
            gate, up = (h[:H], h[H:]) if layer.gated else (h, torch.ones_like(h))
            qa, sa = quantise_rows((gate * torch.sigmoid(gate) * up)[None])
            y = ((qa[0].double() * sa[0].double()) @ w_out[e].t()).to(torch.bfloat16).float()
            y_TD[t] += w_Tk[t, j] * y
    return y_TD.to(x_TD.dtype)


def _layer(gated=True, dtype=torch.bfloat16, **kw) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D, E, K, H, gated=gated, impl="fp8", dtype=dtype, **kw)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_oracle_and_repeats(gated, dtype, block):
    layer = _layer(gated, dtype)
    if block:
        layer.quantize_experts(block=True)
    assert layer.fp8.block is block
    x = torch.randn(37, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        got, again = layer(x), layer(x)
    want = oracle(layer, x)
    assert got.dtype == dtype and torch.equal(got, again)
    # Equal on the reference path; on the GPU only the K sums' order can move a bf16 rounding of
    # an expert's output, rarely an e4m3 one of its activation: a few bf16 ulps of the largest.
    # Triton's interpreter truncates bf16 stores (the GEMM's outputs), which moves e4m3 roundings
    # of the activations more often.
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < (5e-2 if execution_path(x.device) == "interpreter" else 1e-2), err


def test_same_function_as_the_unquantised_layer():
    """The FP8 copies are those of the layer's own weights: close to the fp32 torch impl."""
    layer = _layer(dtype=torch.float32)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x)
        layer.impl = "torch"
        want = layer(x)
    err = (got - want).abs().max() / want.abs().max()
    assert 1e-4 < err < 0.1, err  # e4m3 operands: percent-level, not exact, not garbage


@pytest.mark.parametrize("gated", [False, True])
def test_trains_through_routed_experts_fp8(gated):
    """With autograd the layer is ``routed_experts(fp8=True)`` on its master weights (the same
    bits, gradients included), repeatable, near the unquantised impl; after an optimizer step
    the inference copies are stale until ``quantize_experts()``."""
    layer = _layer(gated, torch.float32)
    x = torch.randn(29, D, generator=torch.Generator().manual_seed(4)).requires_grad_()

    def grads(impl):
        layer.impl = impl
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        y.square().mean().backward()
        return [y.detach(), x.grad, layer.in_proj.grad, layer.out_proj.grad,
                layer.router.weight.grad]  # fmt: skip

    got, again = grads("fp8"), grads("fp8")
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    plan = mk.route(mk.router_scores(x.detach(), layer.router.weight), K)  # (the layer's router)
    with torch.no_grad():
        direct = mk.routed_experts(x, layer.in_proj, layer.out_proj, plan, gated=gated, fp8=True)
    assert torch.equal(got[0], direct)
    want = grads("triton_fp32")
    for a, b in zip(got, want, strict=True):
        rel = float((a - b).norm() / b.norm())
        assert 1e-4 < rel < 0.15, rel  # e4m3 operands: percent-level
    layer.impl = "fp8"
    with torch.no_grad():
        layer.in_proj.sub_(1e-3 * layer.in_proj.grad)
        with pytest.raises(RuntimeError, match="quantize_experts"):
            layer(x)
        layer.quantize_experts()
        layer(x)


def test_refuses_features_and_expert_parallelism():
    with pytest.raises(ValueError, match="biases"):
        MoELayer(D, E, K, H, gated=True, expert_biases=True, impl="fp8")
    from moe_model import ExpertParallelMoE

    with pytest.raises(ValueError, match="fp8"):
        ExpertParallelMoE(_layer())


def test_stale_copies_refused_until_requantised():
    layer = _layer()
    x = torch.randn(9, D, dtype=torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
        layer.out_proj.mul_(2)
        with pytest.raises(RuntimeError, match="quantize_experts"):
            layer(x)
        layer.quantize_experts()
        after = layer(x)
    ratio = after.float().abs().sum() / before.float().abs().sum()
    assert 1.9 < ratio < 2.1  # (SiLU is not linear in in_proj; out_proj scales the output)
    # switching to the impl makes stale copies again; current (or loaded) ones are kept
    layer.impl = "torch"
    with torch.no_grad():
        layer.out_proj.mul_(0.5)
    layer.impl = "fp8"
    with torch.no_grad():
        assert torch.equal(layer(x), before)
    kept = layer.fp8
    layer.impl = "torch"
    layer.impl = "fp8"
    assert layer.fp8 is kept


def test_cast_and_move_keep_the_copies_current():
    layer = _layer(dtype=torch.float32)
    (w_in, s_in), _ = layer.fp8.get()
    w_in, s_in = w_in.clone(), s_in.clone()
    layer.to(torch.bfloat16)
    (w2, s2), _ = layer.fp8.get()
    assert w2.dtype == FP8 and s2.dtype == torch.float32
    assert torch.equal(w2.view(torch.uint8), w_in.view(torch.uint8)) and torch.equal(s2, s_in)
    with torch.no_grad():
        layer(torch.randn(3, D, dtype=torch.bfloat16))  # current: no error


def test_state_dict_has_no_copies_and_a_load_remakes_them():
    src, dst = _layer(), _layer()
    with torch.no_grad():
        src.in_proj.mul_(3)
    state = src.state_dict()
    assert not [k for k in state if "fp8" in k]
    dst.load_state_dict(state)
    x = torch.randn(11, D, dtype=torch.bfloat16)
    src.quantize_experts()
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))


def test_loads_a_checkpoints_fp8_experts():
    layer = _layer()
    g = torch.Generator().manual_seed(5)
    q_in = mk.quantize_fp8_weights(torch.randn(E, 2 * H, D, generator=g), block=True)
    q_out = mk.quantize_fp8_weights(torch.randn(E, D, H, generator=g), block=True)
    layer.load_fp8_experts(q_in, q_out)
    (w_in, s_in), (w_out, s_out) = layer.fp8.get()
    assert torch.equal(w_in.view(torch.uint8), q_in.weight.view(torch.uint8))
    assert torch.equal(s_out, q_out.scale) and layer.fp8.block
    assert torch.equal(layer.in_proj, q_in.dequantize(torch.bfloat16))
    x = torch.randn(21, D, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    tol = 5e-2 if execution_path(x.device) == "interpreter" else 1e-2  # (as above)
    torch.testing.assert_close(got, oracle(layer, x), rtol=0, atol=tol * got.abs().max().item())


def test_bad_fp8_experts_named_and_nothing_changed():
    layer = _layer()
    before = layer.in_proj.detach().clone()
    good_in = mk.quantize_fp8_weights(torch.randn(E, 2 * H, D))
    good_out = mk.quantize_fp8_weights(torch.randn(E, D, H))
    bad = [
        ((good_in.weight.float(), good_in.scale), TypeError, "in_proj.weight"),
        ((good_in.weight, good_in.scale.double()), TypeError, "in_proj.scale"),
        ((good_in.weight[:, :H], good_in.scale), ValueError, "in_proj.weight"),
        ((good_in.weight, good_in.scale[:, :3]), ValueError, "in_proj.scale"),
        ((good_in.weight, good_in.scale * float("nan")), ValueError, "finite"),
        ((good_in.weight, -good_in.scale), ValueError, "positive"),
        (good_in.weight, TypeError, "Fp8Weights"),
    ]
    for arg, exc, match in bad:
        with pytest.raises(exc, match=match):
            layer.load_fp8_experts(arg, good_out)
    with pytest.raises(ValueError, match="out_proj.weight"):
        layer.load_fp8_experts(good_in, good_in)
    with pytest.raises(TypeError, match="block"):
        layer.quantize_experts(block=1)
    assert torch.equal(layer.in_proj, before)


def test_compiled_equals_eager():
    layer = _layer()
    x = torch.randn(16, D, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True)(x)
    assert torch.equal(got, want)


def test_world_engine_runs_fp8_experts():
    cfg = WorldModelConfig.from_preset("tiny", moe_impl="fp8", n_layers=1, denoise_steps=1)
    fp8 = WorldEngine(cfg, device="cpu", dtype=torch.float32, seed=3)
    ref = WorldEngine(cfg, device="cpu", dtype=torch.float32, seed=3, impl="triton_fp32")
    for _ in range(3):
        a, b = fp8.gen_frame(return_img=False), ref.gen_frame(return_img=False)
        err = (a - b).abs().max() / b.abs().max()
        assert 0 < err < 2e-2, err
