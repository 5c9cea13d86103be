"""MoELayer's routing options (expert bias, groups, scale, renormalisation), shared experts,
auxiliary loss, last_counts and presets: each against an independent formula (a per-token Python
oracle in float64, hand-written counts, loss and bias update), every impl against the baseline
forward and backward, the torch routing bitwise against moe_kernels' reference, compiled ==
eager.

Tolerances (max |a - b| / max |b|) as in test_moe_backward.py: 1e-5 for the fp32 impls, 2e-2 for
triton_bf16 (its combine rounds to bf16), 2e-1 for mxfp8 (8-bit mantissas).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_kernels import plan_from_choices, topk_choices
from moe_model import IMPLS, MOE_PRESETS, MoELayer

D, E, K, H, T = 64, 8, 3, 32, 24
GROUPS, TOPK_GROUPS, SCALE = 4, 2, 2.5  # 4 groups of 2 experts; each token sees 2 groups
ALL = dict(
    score_fn="sigmoid",
    renormalize=True,
    expert_bias=True,
    n_groups=GROUPS,
    topk_groups=TOPK_GROUPS,
    routed_scaling_factor=SCALE,
    n_shared_experts=2,
)
TOL = {"torch": 1e-5, "triton_fp32": 1e-5, "triton_bf16": 2e-2, "mxfp8": 2e-1}


def make_layer(impl: str = "baseline", seed: int = 0, **kw) -> MoELayer:
    """A layer with all options (``kw`` overrides them) and a random nonzero expert bias of the
    scores' scale (so it changes choices)."""
    torch.manual_seed(seed)
    layer = MoELayer(D, E, K, H, impl=impl, **{**ALL, **kw})
    if layer.expert_bias is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(9)))
            layer.expert_bias.mul_(0.2)
    return layer


def inputs(seed: int = 1, n: int = T) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def oracle_choices(layer: MoELayer, s_TE: torch.Tensor) -> list[list[int]]:
    """Per token in Python: the k best biased scores inside the topk_groups best groups (group
    score = sum of its two largest biased scores), ties to the lower group / expert."""
    sel = s_TE.float() + (0 if layer.expert_bias is None else layer.expert_bias.float())
    per = layer.n_experts // layer.n_groups
    out = []
    for v in sel.tolist():
        g_score = [sum(sorted(v[g * per : (g + 1) * per])[-2:]) for g in range(layer.n_groups)]
        groups = sorted(range(layer.n_groups), key=lambda g: (-g_score[g], g))
        allowed = set(groups[: layer.topk_groups])
        cands = [e for e in range(layer.n_experts) if e // per in allowed]
        out.append(sorted(cands, key=lambda e: (-v[e], e))[: layer.top_k])
    return out


def naive_oracle(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """The layer token by token in float64: routed experts chosen by ``oracle_choices`` on the
    fp32 scores, weights = unbiased scores (renormalised, scaled), plus the shared MLP."""
    s_TE = layer.scores(x_TD).detach()
    w_in, w_out = layer.in_proj.detach().double(), layer.out_proj.detach().double()

    def mlp(w1, w2, x):
        h = w1 @ x
        if layer.gated:
            g, u = h.chunk(2)
            return w2 @ (F.silu(g) * u)
        return w2 @ F.silu(h)

    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t, chosen in enumerate(oracle_choices(layer, s_TE)):
        x = x_TD[t].double()
        s = s_TE[t].double()
        total = float(s[chosen].sum()) if layer.renormalize else 1.0
        for e in chosen:
            out[t] += float(s[e]) / total * layer.routed_scaling_factor * mlp(w_in[e], w_out[e], x)
        if layer.shared_experts is not None:
            se = layer.shared_experts
            out[t] += mlp(se.in_proj.detach().double(), se.out_proj.detach().double(), x)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("gated", [False, True])
def test_baseline_matches_naive_oracle(gated):
    layer = make_layer(gated=gated).requires_grad_(False)
    x = inputs()
    # the options matter here: the bias and the groups change choices of this input
    s = layer.scores(x)
    plain = topk_choices(s, K)[1]
    assert not torch.equal(plain, topk_choices(s, K, bias=layer.expert_bias)[1])
    unbiased = topk_choices(s, K, n_groups=GROUPS, topk_groups=TOPK_GROUPS)[1]
    assert not torch.equal(plain, unbiased)
    torch.testing.assert_close(layer(x).double(), naive_oracle(layer, x), atol=1e-5, rtol=1e-5)


def _grads(layer: MoELayer, x: torch.Tensor, fn=None) -> dict[str, torch.Tensor]:
    """y, and the gradients of x and every parameter, of ``fn`` (default: the layer)."""
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    y = (layer if fn is None else fn)(xx)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view_as(y))
    got = {"y": y.detach(), "x": xx.grad}
    got.update({n: p.grad for n, p in layer.named_parameters()})
    return got


@pytest.mark.parametrize("impl", list(TOL))
@pytest.mark.parametrize("gated", [False, True])
def test_impl_matches_baseline_all_options(impl, gated):
    base = make_layer(gated=gated)
    x = inputs()
    ref = _grads(base, x)
    assert set(ref) >= {"shared_experts.in_proj", "shared_experts.out_proj", "router.weight"}
    layer = copy.deepcopy(base)
    layer.impl = impl
    got = _grads(layer, x)
    for name in ref:
        assert got[name] is not None and ref[name].abs().sum() > 0, name
        assert rel(got[name], ref[name]) <= TOL[impl], f"{name}: {rel(got[name], ref[name]):.2e}"
    assert all(
        torch.equal(a, b) for a, b in zip(got.values(), _grads(layer, x).values(), strict=True)
    )
    with torch.no_grad():  # the inference path (triton_*: the fused dispatch + GEMM)
        y = layer(x)
    assert rel(y, ref["y"]) <= TOL[impl]
    assert torch.equal(layer.last_counts, base.last_counts)


@pytest.mark.parametrize("impl", ["torch", "triton_bf16"])
def test_bf16_weights_match_baseline(impl):
    layer = make_layer(dtype=torch.bfloat16).requires_grad_(False)
    assert layer.in_proj.dtype == layer.shared_experts.in_proj.dtype == torch.bfloat16
    assert layer.router.weight.dtype == layer.expert_bias.dtype == torch.float32
    x = inputs().to(torch.bfloat16)
    y_ref = layer(x)
    layer.impl = impl
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert rel(y, y_ref) <= 3e-2


def _random_scores(gen: torch.Generator, n: int, e: int) -> torch.Tensor:
    s = torch.randint(0, 5, (n, e), generator=gen).float() / 4  # many exact ties
    s[0, 0], s[1, :] = float("nan"), float("-inf")
    s[2, :] = -0.0
    s[3, : e // 2] = float("inf")
    return s


@pytest.mark.parametrize("n_groups, per_group", [(1, 8), (2, 4), (4, 2), (8, 1), (4, 3)])
def test_torch_routing_bitwise_equals_moe_kernels_reference(n_groups, per_group):
    from moe_kernels import route

    gen = torch.Generator().manual_seed(n_groups * 10 + per_group)
    e = n_groups * per_group
    for trial in range(12):
        s = _random_scores(gen, 20, e) if trial % 2 else torch.rand(20, e, generator=gen)
        bias = None if trial % 3 == 0 else torch.randint(-2, 3, (e,), generator=gen) / 8
        tg = 1 + trial % n_groups
        k = 1 + trial % (tg * per_group)
        renorm, scale = bool(trial % 2), (1.0, 2.5, -0.5)[trial % 3]
        opts = dict(bias=bias, n_groups=n_groups, topk_groups=tg, scale=scale)
        w, ch = topk_choices(s, k, renormalize=renorm, **opts)
        plan = route(s, k, **opts, renormalize=renorm)  # its choices, through its sorted plan
        ref_ch = plan.expert_indices[plan.inverse.long()].long()
        assert torch.equal(ch, ref_ch), trial
        ref_w = plan.weights[plan.inverse.long()]
        assert torch.equal(w.nan_to_num(7.0), ref_w.nan_to_num(7.0)), trial
        mine = plan_from_choices(ch, w, e)
        assert torch.equal(mine.offsets, plan.offsets)
        assert torch.equal(mine.expert_indices.int(), plan.expert_indices)
        assert torch.equal(mine.token_indices.int(), plan.token_indices)
        assert torch.equal(mine.inverse.int(), plan.inverse)
        assert torch.equal(mine.weights.nan_to_num(7.0), plan.weights.nan_to_num(7.0))


@pytest.mark.parametrize("impl", ["baseline", "torch", "triton_fp32"])
def test_last_counts_match_a_hand_count(impl):
    layer = make_layer(impl=impl)
    assert layer.last_counts.dtype == torch.int32 and layer.last_counts.shape == (E,)
    assert "last_counts" not in layer.state_dict() and "expert_bias" in layer.state_dict()
    for seed in (1, 2):
        x = inputs(seed)
        with torch.no_grad():
            layer(x)
        hand = [0] * E
        for chosen in oracle_choices(layer, layer.scores(x)):
            for e in chosen:
                hand[e] += 1
        assert layer.last_counts.tolist() == hand
        assert sum(hand) == T * K


def test_update_expert_bias_hand_formula():
    layer = make_layer(impl="torch")
    x = inputs()
    layer(x)
    counts = layer.last_counts.tolist()
    b0 = layer.expert_bias.clone()
    mean = sum(counts) / E
    assert any(c > mean for c in counts) and any(c < mean for c in counts)
    layer.update_expert_bias(0.01)
    sign = [float((mean > c) - (mean < c)) for c in counts]
    torch.testing.assert_close(layer.expert_bias, b0 + 0.01 * torch.tensor(sign))
    assert not layer.expert_bias.requires_grad and layer.expert_bias.grad_fn is None
    layer.last_counts.fill_(5)  # balanced: no change
    b1 = layer.expert_bias.clone()
    layer.update_expert_bias(0.5)
    assert torch.equal(layer.expert_bias, b1)
    layer.reset_parameters()
    assert not layer.expert_bias.any() and not layer.last_counts.any()


@pytest.mark.parametrize("impl", ["baseline", "torch", "triton_fp32"])
def test_aux_loss_hand_formula_and_gradient(impl):
    coef = 0.03
    layer = make_layer(impl=impl, aux_loss_coef=coef, score_fn="softmax")
    x = inputs()
    layer(x)
    aux = layer.aux_loss
    assert aux is not None and aux.dim() == 0
    chosen = oracle_choices(layer, layer.scores(x).detach())
    f = [sum(row.count(e) for row in chosen) / (T * K) for e in range(E)]
    w = layer.router.weight.detach().clone().requires_grad_()
    p_E = torch.softmax(x @ w.t(), dim=-1).mean(0)
    hand = coef * E * sum(f[e] * p_E[e] for e in range(E))
    torch.testing.assert_close(aux, hand.float(), atol=1e-7, rtol=1e-5)
    aux.backward()
    hand.backward()
    torch.testing.assert_close(layer.router.weight.grad, w.grad, atol=1e-7, rtol=1e-4)
    assert layer.in_proj.grad is None  # f is not differentiated: only the router gets a grad
    with torch.no_grad():
        layer(x)
    assert layer.aux_loss is None
    no_coef = make_layer(impl=impl)
    no_coef(x)
    assert no_coef.aux_loss is None


def test_shared_output_and_route_options():
    layer = make_layer(gated=True)
    x = inputs()
    se = layer.shared_experts
    assert se.in_proj.shape == (2 * 2 * H, D) and se.out_proj.shape == (D, 2 * H)
    g, u = (x @ se.in_proj.t()).chunk(2, dim=-1)
    torch.testing.assert_close(layer.shared_output(x), (F.silu(g) * u) @ se.out_proj.t())
    opts = layer.route_options()
    assert opts["bias"] is layer.expert_bias
    assert (opts["n_groups"], opts["topk_groups"]) == (GROUPS, TOPK_GROUPS)
    assert opts["scale"] == SCALE and opts["renormalize"] is True
    plain = MoELayer(D, E, K, H, n_groups=4, topk_groups=4)  # groups admitting every expert
    assert plain.route_options() == dict(
        bias=None, n_groups=1, topk_groups=None, scale=1.0, renormalize=False
    )
    assert plain.shared_experts is None and plain.shared_output(x) is None
    assert plain.expert_bias is None and "expert_bias" not in plain.state_dict()
    text = repr(layer)
    assert "expert_bias=True, n_groups=4, topk_groups=2, routed_scaling_factor=2.5" in text
    assert "n_shared_experts=2" in text and "SharedExperts" in text


def test_compile_fullgraph_equals_eager(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    # (config.patch, not monkeypatch.setattr: undoing that deletes a config entry)
    with torch.compiler.config.patch(force_disable_caches=True):
        _compiled_matches_eager()


def _compiled_matches_eager() -> None:
    torch._dynamo.reset()
    eager = make_layer(impl="triton_fp32", aux_loss_coef=0.01)
    layer = copy.deepcopy(eager)
    compiled = torch.compile(layer, fullgraph=True)
    for seed in (1, 2):  # last_counts follows each call (an in-place buffer update)
        x = inputs(seed)
        with torch.no_grad():
            y_c, y_e = compiled(x), eager(x)
        torch.testing.assert_close(y_c, y_e, atol=1e-6, rtol=1e-6)
        assert torch.equal(layer.last_counts, eager.last_counts)
        assert layer.aux_loss is None
    got, ref = _grads(layer, x, compiled), _grads(eager, x)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(layer.aux_loss, eager.aux_loss, atol=1e-7, rtol=1e-6)
    torch._dynamo.reset()


def _layer(**kw) -> MoELayer:
    return MoELayer(**{"d_model": D, "n_experts": E, "top_k": K, "hidden": H, **kw})


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(n_groups=3), ValueError, "n_groups must be a positive divisor of n_experts=8"),
        (dict(n_groups=0), ValueError, "n_groups"),
        (dict(n_groups=True), TypeError, "n_groups must be an int"),
        (dict(n_groups=4, topk_groups=0), ValueError, r"topk_groups must be in \[1, n_groups=4"),
        (dict(n_groups=4, topk_groups=5), ValueError, "topk_groups"),
        (dict(n_groups=4, topk_groups=2.0), TypeError, "topk_groups must be an int"),
        (dict(n_groups=4, topk_groups=1), ValueError, "top_k=3 exceeds the 2 experts"),
        (dict(n_shared_experts=-1), ValueError, "n_shared_experts must be >= 0"),
        (dict(n_shared_experts=1.0), TypeError, "n_shared_experts must be an int"),
        (dict(aux_loss_coef=-0.1), ValueError, "aux_loss_coef must be >= 0"),
        (dict(aux_loss_coef="0.1"), TypeError, "aux_loss_coef must be a float"),
        (dict(aux_loss_coef=float("nan")), ValueError, "aux_loss_coef must be finite"),
        (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor must be"),
        (dict(routed_scaling_factor=None), TypeError, "routed_scaling_factor must be a float"),
        (dict(expert_bias=1), TypeError, "expert_bias must be a bool"),
        (dict(dtype=torch.int32), TypeError, "dtype must be None or one of"),
    ],
)
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        _layer(**kw)


def test_bad_bias_updates_and_fbgemm_options(monkeypatch):
    with pytest.raises(ValueError, match="expert_bias=True"):
        _layer().update_expert_bias(0.1)
    for rate, exc in ((-0.1, ValueError), (float("inf"), ValueError), ("1", TypeError)):
        with pytest.raises(exc, match="rate"):
            _layer(expert_bias=True).update_expert_bias(rate)
    layer = make_layer(impl="torch")
    layer._impl = "fbgemm"  # fbgemm_gpu is not needed: the check runs before its import
    msg = (
        r"impl 'fbgemm' cannot route with expert_bias=True, topk_groups=2 of n_groups=4, "
        r"routed_scaling_factor=2.5, renormalize=True \(fbgemm's index_shuffling does plain"
    )
    with torch.no_grad(), pytest.raises(ValueError, match=msg):
        layer(inputs())
    monkeypatch.setattr(type(IMPLS["fbgemm"]), "available", True)
    with pytest.raises(ValueError, match="cannot route with renormalize=True"):
        _layer(impl="torch", renormalize=True).impl = "fbgemm"
    _layer(impl="torch", n_shared_experts=1, aux_loss_coef=0.1).impl = "fbgemm"  # it can do these


SMALL = dict(d_model=32, hidden=16, impl="torch")


@pytest.mark.parametrize("name", list(MOE_PRESETS))
def test_presets_build_small(name):
    preset = MOE_PRESETS[name]
    layer = MoELayer.from_preset(name, **SMALL)
    for key, value in preset.items():
        if key == "expert_bias":
            assert layer.expert_bias is not None and layer.expert_bias.shape == (layer.n_experts,)
        elif key not in SMALL:
            assert getattr(layer, key) == value, key
    assert (layer.d_model, layer.hidden) == (32, 16)
    x = torch.randn(5, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert int(layer.last_counts.sum()) == 5 * preset["top_k"]


def test_deepseek_v3_preset():
    p = MOE_PRESETS["deepseek-v3"]
    assert (p["n_experts"], p["top_k"], p["d_model"], p["hidden"]) == (256, 8, 7168, 2048)
    assert p["n_groups"] == 8 and p["topk_groups"] == 4 and p["routed_scaling_factor"] == 2.5
    assert p["score_fn"] == "sigmoid" and p["expert_bias"] and p["renormalize"] and p["gated"]
    assert p["n_shared_experts"] == 1
    assert MOE_PRESETS["qwen3-30b-a3b"]["n_experts"] == 128
    assert MOE_PRESETS["mixtral-8x7b"]["hidden"] == 14336
    # full size, without memory: the expert weights in the requested dtype, the router fp32
    layer = MoELayer.from_preset("deepseek-v3", device="meta", dtype=torch.bfloat16)
    assert layer.in_proj.dtype == torch.bfloat16 and layer.in_proj.device.type == "meta"
    assert layer.router.weight.dtype == torch.float32 and layer.expert_bias.shape == (256,)
    n_bytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    assert 22.5e9 < n_bytes < 22.8e9, n_bytes
    assert layer.route_options()["n_groups"] == 8


def test_presets_immutable_and_unknown():
    with pytest.raises(TypeError):
        MOE_PRESETS["mine"] = {}
    with pytest.raises(TypeError):
        MOE_PRESETS["mixtral-8x7b"]["top_k"] = 1
    with pytest.raises(ValueError, match="unknown MoE preset 'gpt'; presets: deepseek-v3, "):
        MoELayer.from_preset("gpt")
    assert MoELayer.from_preset("mixtral-8x7b", top_k=1, **SMALL).top_k == 1
    with pytest.raises(TypeError):
        MoELayer.from_preset("mixtral-8x7b", nope=1)
