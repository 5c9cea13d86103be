"""MoELayer's expert features (issue 49): per-expert biases, a configurable gated activation
(``SwiGLU``: GPT-OSS's alpha, limit, up + 1, interleaved gate/up) and the routing weight on the
expert's input (Llama4), against an independent float64 loop over tokens and choices (its own
top-k of the layer's scores): outputs and every gradient, each impl; bad arguments."""

from __future__ import annotations

import pytest
import torch

from moe_model import ExpertParallelMoE, MoELayer, SwiGLU

D, E, K, H, T = 32, 6, 2, 16, 13
GPT_OSS = SwiGLU(alpha=1.702, limit=7.0, up_offset=1.0, interleaved=True)
CONFIGS = {
    "gpt_oss": dict(gated=True, swiglu=GPT_OSS, expert_biases=True, router_bias=True,
                    renormalize=True),
    "llama4": dict(gated=True, weight_on_input=True, score_fn="sigmoid"),
    "biased_silu": dict(gated=False, expert_biases=True),
    "clamp_only": dict(gated=True, swiglu=SwiGLU(limit=0.5)),
}  # fmt: skip
IMPLS = ["torch", "baseline", "triton_fp32"]


def make(config: str, impl: str) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, impl=impl, **CONFIGS[config])
    with torch.no_grad():
        for b in (layer.in_bias, layer.out_bias, layer.router.bias):
            if b is not None:
                b.normal_(0, 0.3)
    return layer


def reference(layer: MoELayer, x_TD: torch.Tensor, params: dict[str, torch.Tensor]):
    """float64: each token's k experts by torch.topk of the layer's own score formula, each
    expert's MLP written out, then the weighted sum."""
    logits = x_TD @ params["router.weight"].T
    if "router.bias" in params:
        logits = logits + params["router.bias"]
    s = logits.softmax(-1) if layer.score_fn == "softmax" else logits.sigmoid()
    w_Tk, e_Tk = torch.topk(s, K)
    if layer.renormalize:
        w_Tk = w_Tk / w_Tk.sum(-1, keepdim=True)
    act = layer.swiglu or SwiGLU()
    rows = []
    for t in range(x_TD.shape[0]):
        y = 0
        for j in range(K):
            e = int(e_Tk[t, j])
            x = x_TD[t] * w_Tk[t, j] if layer.weight_on_input else x_TD[t]
            h = params["in_proj"][e] @ x
            if "in_bias" in params:
                h = h + params["in_bias"][e]
            if not layer.gated:
                a = h * torch.sigmoid(h)
            else:
                g, u = (h[0::2], h[1::2]) if act.interleaved else (h[:H], h[H:])
                if act.limit is not None:
                    g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                a = (u + act.up_offset) * g * torch.sigmoid(act.alpha * g)
            o = params["out_proj"][e] @ a
            if "out_bias" in params:
                o = o + params["out_bias"][e]
            y = y + (o if layer.weight_on_input else w_Tk[t, j] * o)
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", CONFIGS)
def test_features_match_float64_loop(config, impl):
    layer = make(config, impl)
    x = (torch.randn(T, D, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    y = layer(x)
    g_y = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    y.backward(g_y)

    params = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    want = reference(layer, x64, params)
    want.backward(g_y.double())
    torch.testing.assert_close(y.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())
    got_grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    want_grads = {"x": x64.grad, **{n: p.grad for n, p in params.items()}}
    for name, g in want_grads.items():
        err = (got_grads[name].double() - g).abs().max() / g.abs().max().clamp_min(1e-30)
        assert err <= 2e-5, (name, err.item())


def test_features_are_repeatable_and_run_composed():
    layer = make("gpt_oss", "triton_fp32")
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    outs = []
    for _ in range(2):
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        y.pow(2).sum().backward()
        outs.append([y.detach(), x.grad, *(p.grad for p in layer.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    # a plain layer of the same weights differs: the features really run
    plain = MoELayer(D, E, K, H, gated=True, renormalize=True, router_bias=True,
                     impl="triton_fp32")  # fmt: skip
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "bias" not in k or
                           k == "router.bias"})  # fmt: skip
    assert not torch.allclose(plain(x), outs[0][0])


def test_standard_swiglu_is_the_plain_layer():
    layer = MoELayer(D, E, K, H, gated=True, swiglu=SwiGLU(), impl="torch")
    assert layer.swiglu is None and not layer.has_features


def test_features_compile_fullgraph():
    layer = make("llama4", "torch")
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(x)
        torch._dynamo.reset()
        got = torch.compile(layer, fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(gated=False, swiglu=GPT_OSS), ValueError, "swiglu needs gated"),
        (dict(gated=True, swiglu="gpt_oss"), TypeError, "swiglu"),
        (dict(gated=True, swiglu=SwiGLU(alpha=0.0)), ValueError, "swiglu.alpha"),
        (dict(gated=True, swiglu=SwiGLU(limit=float("inf"))), ValueError, "swiglu.limit"),
        (dict(gated=True, swiglu=SwiGLU(up_offset=float("nan"))), ValueError, "up_offset"),
        (dict(expert_biases=1), TypeError, "expert_biases"),
        (dict(weight_on_input="yes"), TypeError, "weight_on_input"),
    ],
)
def test_bad_feature_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoELayer(D, E, K, H, impl="torch", **kwargs)


def test_expert_parallel_refuses_features():
    with pytest.raises(ValueError, match="plain experts only"):
        ExpertParallelMoE(make("llama4", "torch"))
