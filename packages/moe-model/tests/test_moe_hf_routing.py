"""MoELayer's Hugging Face routing options (issue 49): ``router_bias``, ``router_dtype``,
``shared_hidden``, ``shared_gate``, against transformers' own modules as independent references
(random weights, CPU):

* Qwen2-MoE's ``Qwen2MoeSparseMoeBlock`` (its own eager experts; a shared expert of its own size
  behind a sigmoid gate): output and every gradient in fp32 (<= 1e-5 relative), and in bf16;
* bf16 routing: with ``router_dtype=torch.bfloat16`` the weights are HF's bit for bit and the
  choices HF's wherever HF's scores have no exact tie (torch.topk breaks those its own way, this
  layer to the lower expert); with ``router_dtype=None`` (fp32 logits) the weights differ;
* GPT-OSS's ``GptOssTopKRouter`` (a router bias, softmax over the top-k logits) against
  ``router_bias=True, renormalize=True``: same experts, same weights and router gradients;
* every impl runs the options (the kernel impls' ``router_scores`` only at the defaults),
  ``ExpertParallelMoE``, bad arguments, torch.compile(fullgraph=True) == eager.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import moe_kernels
from moe_kernels import topk_choices
from moe_model import ExpertParallelMoE, MoELayer

tf = pytest.importorskip("transformers", minversion="5.0")
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import (  # noqa: E402
    Qwen2MoeSparseMoeBlock,
    Qwen2MoeTopKRouter,
)

D, E, K, H, SH, T = 64, 8, 2, 32, 40, 48
NEW = dict(router_bias=True, router_dtype=torch.bfloat16, shared_hidden=SH, shared_gate=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def inputs(seed: int = 1, n: int = T, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qwen2_config() -> object:
    cfg = tf.Qwen2MoeConfig(
        hidden_size=D,
        moe_intermediate_size=H,
        shared_expert_intermediate_size=SH,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=False,
    )
    cfg._experts_implementation = "eager"  # HF's own loop over experts: the reference
    return cfg


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter normal with std 1/sqrt(its last dim) (HF's init leaves some zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def qwen2_pair(dtype: torch.dtype, impl: str = "torch", **kw) -> tuple[torch.nn.Module, MoELayer]:
    """HF's Qwen2-MoE block in ``dtype`` and the MoELayer of the same weights."""
    block = Qwen2MoeSparseMoeBlock(qwen2_config())
    randomize(block, 0)
    block = block.to(dtype)
    layer = MoELayer(
        D, E, K, H, gated=True, score_fn="softmax", renormalize=False, shared_hidden=SH,
        shared_gate=True, impl=impl, dtype=dtype, **kw,
    )  # fmt: skip
    se = block.shared_expert
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)  # (bf16 -> fp32: exact)
        layer.in_proj.copy_(block.experts.gate_up_proj)  # (E, 2H, D), gate rows first
        layer.out_proj.copy_(block.experts.down_proj)  # (E, D, H)
        layer.shared_experts.in_proj.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
        layer.shared_experts.out_proj.copy_(se.down_proj.weight)
        layer.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return block, layer


def run_grads(module: torch.nn.Module, x: torch.Tensor, shape=None, fn=None) -> dict:
    """y, and the gradients of x and of every parameter of ``module``, for a fixed cotangent;
    ``fn`` (default: the module) called on x viewed as ``shape``."""
    module.zero_grad(set_to_none=True)
    xx = x.clone().view(shape or x.shape).requires_grad_()
    y = (module if fn is None else fn)(xx)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view_as(y).to(y.dtype))
    out = {"y": y.detach().reshape(-1, D), "x": xx.grad.reshape(-1, D)}
    out.update({n: p.grad for n, p in module.named_parameters()})
    return out


def hf_as_layer(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's gradients under the layer's parameter names."""
    return {
        "y": g["y"],
        "x": g["x"],
        "router.weight": g["gate.weight"],
        "in_proj": g["experts.gate_up_proj"],
        "out_proj": g["experts.down_proj"],
        "shared_experts.in_proj": torch.cat(
            [g["shared_expert.gate_proj.weight"], g["shared_expert.up_proj.weight"]]
        ),
        "shared_experts.out_proj": g["shared_expert.down_proj.weight"],
        "shared_expert_gate.weight": g["shared_expert_gate.weight"],
    }


# ---------------------------------------------------------------------------------------------
# (a) Qwen2-MoE's block: shared_hidden + shared_gate


@pytest.mark.parametrize("impl", ["torch", "baseline", "triton_fp32"])
def test_qwen2_moe_block_fp32(impl):
    block, layer = qwen2_pair(torch.float32, impl)
    assert layer.shared_experts.hidden == SH and layer.shared_expert_gate.weight.shape == (1, D)
    x = inputs()
    ref = hf_as_layer(run_grads(block, x, (2, T // 2, D)))  # HF's block takes (B, S, D)
    got = run_grads(layer, x)
    assert set(got) == set(ref)
    for name in ref:
        assert rel(got[name], ref[name]) <= 1e-5, (name, rel(got[name], ref[name]))


def test_qwen2_moe_block_bf16():
    """bf16 weights and x, the router in bf16 as HF's: the same experts for these tokens (checked
    first: as sets, the order of two tied experts is torch.topk's), outputs and the gradient of
    x within bf16 rounding (HF rounds each expert's weighted output to bf16 before its
    index_add, this layer combines in fp32)."""
    block, layer = qwen2_pair(torch.bfloat16, router_dtype=torch.bfloat16)
    x = inputs(dtype=torch.bfloat16)
    with torch.no_grad():
        _, _, i_hf = block.gate(x)
        i = topk_choices(layer.scores(x), K)[1]
        assert torch.equal(i.sort(dim=1).values, i_hf.to(torch.int32).sort(dim=1).values)
    ref = hf_as_layer(run_grads(block, x, (2, T // 2, D)))
    got = run_grads(layer, x)
    assert got["y"].dtype == torch.bfloat16
    for name in ("y", "x"):
        assert rel(got[name], ref[name]) <= 2e-2, (name, rel(got[name], ref[name]))


# ---------------------------------------------------------------------------------------------
# (b) router_dtype: bf16 routing as HF's


def _hf_routers(name: str) -> tuple[torch.nn.Module, bool]:
    """A bf16 HF router with random weights, and whether it renormalises."""
    if name == "qwen2_moe":
        router = Qwen2MoeTopKRouter(qwen2_config())
    else:
        cfg = tf.MixtralConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K)
        router = MixtralTopKRouter(cfg)
    randomize(router, 5)
    return router.to(torch.bfloat16), name == "mixtral"


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_bf16_router_matches_hf(family):
    router, renorm = _hf_routers(family)
    x = inputs(7, n=4096, dtype=torch.bfloat16)
    with torch.no_grad():
        logits_hf, w_hf, i_hf = router(x)
        probs_hf = torch.softmax(logits_hf, dim=-1, dtype=torch.float)
        # HF's top-k of fp32 probabilities; an exact tie at the top k + 1 is torch.topk's to break
        top = probs_hf.topk(K + 1, dim=-1).values
        tie = (top[:, :-1] == top[:, 1:]).any(dim=1)

        def layer_choices(router_dtype):
            layer = MoELayer(D, E, K, H, gated=True, renormalize=renorm, impl="torch",
                             router_dtype=router_dtype)  # fmt: skip
            layer.router.weight.copy_(router.weight)
            s = layer.scores(x)
            w, i = topk_choices(s, K, **layer.route_options())
            return s, w, i.long()

        s, w, i = layer_choices(torch.bfloat16)
        assert torch.equal(s, probs_hf)  # the scores themselves, bit for bit
        assert 0 < tie.sum() < 0.02 * len(x)  # (bf16 logits tie now and then)
        assert torch.equal(i[~tie], i_hf[~tie])
        # on a tie HF's experts may differ, never their scores; this layer takes the lower expert
        assert torch.equal(s.gather(1, i), s.gather(1, i_hf))
        assert torch.equal(w.to(w_hf.dtype), w_hf)
        if renorm:  # Mixtral keeps fp32 weights: bit for bit
            assert w_hf.dtype == torch.float32 and torch.equal(w, w_hf)
        else:  # Qwen2-MoE rounds them to the logits' bf16: before that, bit for bit
            assert torch.equal(w, probs_hf.gather(1, i_hf))

        # router_dtype None: fp32 logits, so other weights than HF's bf16 router's for most
        # tokens, and other choices on some of HF's ties (rounding to bf16 keeps the order of
        # the logits, so here it only makes ties, which the fp32 logits resolve)
        s32, w32, i32 = layer_choices(None)
        ref = probs_hf.gather(1, i_hf)
        if renorm:
            ref = ref / ref.sum(dim=-1, keepdim=True)
        assert (w32 != ref).float().mean() > 0.5
        differ = (i32 != i_hf).any(dim=1)
        assert differ.sum() > 0 and not (differ & ~tie).any()


# ---------------------------------------------------------------------------------------------
# (c) router_bias: GPT-OSS's router


def gpt_oss_pair(dtype: torch.dtype) -> tuple[torch.nn.Module, MoELayer]:
    cfg = tf.GptOssConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K)
    router = GptOssTopKRouter(cfg)
    randomize(router, 3)  # (the bias too: std 1/sqrt(E), of the logits' scale)
    router = router.to(dtype)
    rd = None if dtype == torch.float32 else dtype
    layer = MoELayer(D, E, K, H, gated=True, router_bias=True, renormalize=True, impl="torch",
                     router_dtype=rd)  # fmt: skip
    with torch.no_grad():
        layer.router.weight.copy_(router.weight)
        layer.router.bias.copy_(router.bias)
    return router, layer


def test_router_bias_matches_gpt_oss_fp32():
    """GPT-OSS: softmax over the k largest logits (bias included) == this layer's softmax over
    all E renormalised over its top k; the gradients of the router weight and bias too."""
    router, layer = gpt_oss_pair(torch.float32)
    assert layer.router.bias.dtype == torch.float32 and "router.bias" in layer.state_dict()
    x = inputs(11, n=4096)
    _, w_hf, i_hf = router(x)
    w, i = topk_choices(layer.scores(x), K, **layer.route_options())
    assert torch.equal(i.long(), i_hf)
    torch.testing.assert_close(w, w_hf, atol=1e-6, rtol=1e-6)
    # the bias matters: without it other experts are chosen
    no_bias = torch.nn.functional.linear(x, layer.router.weight).topk(K, dim=-1).indices
    assert (no_bias != i_hf).any(dim=1).float().mean() > 0.1
    c = torch.cos(torch.arange(w.numel(), dtype=torch.float32)).view_as(w)
    (w_hf * c).sum().backward()
    (w * c).sum().backward()
    for ours, theirs in ((layer.router.weight, router.weight), (layer.router.bias, router.bias)):
        assert rel(ours.grad, theirs.grad) <= 1e-5


def test_router_bias_matches_gpt_oss_bf16():
    """bf16 GPT-OSS (logits and their top-k softmax in bf16) against router_dtype=bfloat16: the
    same experts wherever the bf16 logits have no exact tie at the top k + 1, weights within
    bf16 rounding (this layer's softmax is fp32)."""
    router, layer = gpt_oss_pair(torch.bfloat16)
    x = inputs(12, n=4096, dtype=torch.bfloat16)
    with torch.no_grad():
        logits_hf, w_hf, i_hf = router(x)
        top = logits_hf.topk(K + 1, dim=-1).values
        tie = (top[:, :-1] == top[:, 1:]).any(dim=1)
        s = layer.scores(x)
        w, i = topk_choices(s, K, **layer.route_options())
    assert tie.float().mean() < 0.02
    assert torch.equal(i.long()[~tie], i_hf[~tie])
    assert torch.equal(s.gather(1, i.long()), s.gather(1, i_hf))
    torch.testing.assert_close(w[~tie], w_hf[~tie].float(), atol=4e-3, rtol=0)


# ---------------------------------------------------------------------------------------------
# Every impl, the kernel fast path, ExpertParallelMoE, state and repr


def _new_layer(impl: str = "torch", **kw) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, gated=True, renormalize=True, impl=impl, **{**NEW, **kw})
    with torch.no_grad():  # a nonzero router bias of the logits' scale
        layer.router.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(4)))
    return layer


def grad_tol(name: str, router_dtype: torch.dtype | None, tol: float) -> float:
    """A bf16 router runs its backward GEMMs in bf16 too: the gradients of x and the router
    weight carry that rounding of inputs that differ in their last fp32 bits."""
    if router_dtype == torch.bfloat16 and name in ("x", "router.weight"):
        return max(tol, 1e-4)
    return tol


@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["baseline", "triton_fp32", "triton_bf16"])
def test_every_impl_runs_the_options(impl, router_dtype):
    """The routing is computed before the impl runs: every impl routes with the router bias
    and dtype (the same scores bit for bit), and runs the gated shared MLP; forward and
    backward agree with ``torch``."""
    ref_layer = _new_layer(router_dtype=router_dtype)
    layer = copy.deepcopy(ref_layer)
    layer.impl = impl
    x = inputs(2)
    assert torch.equal(layer.scores(x), ref_layer.scores(x))
    ref, got = run_grads(ref_layer, x), run_grads(layer, x)
    assert torch.equal(layer.last_counts, ref_layer.last_counts)
    tol = 2e-2 if impl == "triton_bf16" else 1e-5
    for name in ref:
        err = rel(got[name], ref[name])
        assert err <= grad_tol(name, router_dtype, tol), (name, err)


def test_kernel_router_only_at_defaults(monkeypatch):
    """A kernel impl scores with ``moe_kernels.router_scores`` while the router options are
    at their defaults (the shared options leave the router alone), else by the torch formula."""
    calls = []
    real = moe_kernels.router_scores

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernels, "router_scores", spy)
    x = inputs(3)
    plain = MoELayer(D, E, K, H, impl="triton_fp32", shared_hidden=SH, shared_gate=True)
    s_plain = plain.scores(x)
    assert len(calls) == 1
    for kw in (dict(router_bias=True), dict(router_dtype=torch.bfloat16),
               dict(router_dtype=torch.float32)):  # fmt: skip
        layer = MoELayer(D, E, K, H, impl="triton_fp32", **kw)
        with torch.no_grad():
            layer.router.weight.copy_(plain.router.weight)
        s = layer.scores(x)
        assert len(calls) == 1, kw
        if kw == dict(router_dtype=torch.float32):  # the same fp32 math, summed in torch's order
            torch.testing.assert_close(s, s_plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("router_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_router_dtype_formula(router_dtype, score_fn):
    """logits = F.linear in router_dtype (x, weight and bias cast to it), scores in fp32 of
    them, for x of any dtype the impl takes."""
    layer = _new_layer(router_dtype=router_dtype, score_fn=score_fn)
    w, b = layer.router.weight, layer.router.bias
    for x in (inputs(9), inputs(9, dtype=torch.float64), inputs(9, dtype=torch.bfloat16)):
        rd = router_dtype
        logits = torch.nn.functional.linear(x.to(rd), w.to(rd), b.to(rd)).float()
        want = torch.softmax(logits, -1) if score_fn == "softmax" else torch.sigmoid(logits)
        got = layer.scores(x)
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_shared_output_formula():
    layer = _new_layer(router_dtype=None)
    x = inputs(4)
    se, g = layer.shared_experts, layer.shared_expert_gate.weight
    a, b = (x @ se.in_proj.t()).chunk(2, dim=-1)
    want = torch.sigmoid(x @ g.t()) * ((torch.nn.functional.silu(a) * b) @ se.out_proj.t())
    torch.testing.assert_close(layer.shared_output(x), want, atol=1e-6, rtol=1e-5)
    # n_shared_experts=1 with shared_hidden: the same one MLP of shared_hidden
    one = MoELayer(D, E, K, H, gated=True, n_shared_experts=1, shared_hidden=SH)
    assert one.shared_experts.hidden == SH
    # without shared_hidden: hidden * n_shared_experts, ungated, as before
    two = MoELayer(D, E, K, H, n_shared_experts=2)
    assert two.shared_experts.hidden == 2 * H and two.shared_expert_gate is None


def test_state_repr_and_reset():
    layer = _new_layer()
    keys = set(layer.state_dict())
    assert {"router.weight", "router.bias", "shared_expert_gate.weight"} <= keys
    assert layer.router.bias.dtype == torch.float32
    assert layer.shared_expert_gate.weight.dtype == layer.in_proj.dtype
    text = repr(layer)
    for part in ("router_bias=True", "router_dtype=torch.bfloat16", f"shared_hidden={SH}",
                 "shared_gate=True"):  # fmt: skip
        assert part in text, text
    plain = MoELayer(D, E, K, H)
    assert "router" not in plain.extra_repr() and "shared" not in plain.extra_repr()
    assert plain.router.bias is None and plain.shared_expert_gate is None
    assert set(plain.state_dict()) == {"router.weight", "in_proj", "out_proj"}
    layer.reset_parameters()
    assert not layer.router.bias.any() and layer.shared_expert_gate.weight.std() > 0
    bf = MoELayer(D, E, K, H, shared_gate=True, n_shared_experts=1, dtype=torch.bfloat16)
    assert bf.shared_expert_gate.weight.dtype == torch.bfloat16
    assert bf.router.weight.dtype == torch.float32


def test_expert_parallel_keeps_the_options():
    """One rank, no process group: the wrapped layer's output and gradients are the layer's;
    from_config builds and runs the options too."""
    layer = _new_layer()
    ref = run_grads(layer, inputs(5))
    ep = ExpertParallelMoE(copy.deepcopy(layer))
    got = run_grads(ep, inputs(5))
    for name, g in ref.items():
        key = name if name in ("y", "x", "in_proj", "out_proj") else "layer." + name
        torch.testing.assert_close(got[key], g, atol=1e-6, rtol=1e-5, msg=name)
    built = ExpertParallelMoE.from_config(D, E, K, H, gated=True, impl="torch", seed=1, **NEW)
    assert built.layer.router.bias is not None and built.layer.shared_expert_gate is not None
    assert not built.layer.router.bias.any()
    assert built(inputs(6)).shape == (T, D)


# ---------------------------------------------------------------------------------------------
# (d) bad arguments


@pytest.mark.parametrize(
    ("kw", "exc", "words"),
    [
        (dict(router_bias=1), TypeError, "router_bias"),
        (dict(router_bias="yes"), TypeError, "router_bias"),
        (dict(router_dtype=torch.float64), TypeError, "router_dtype"),
        (dict(router_dtype=torch.int32), TypeError, "router_dtype"),
        (dict(router_dtype="bfloat16"), TypeError, "router_dtype"),
        (dict(shared_hidden=0), ValueError, "shared_hidden"),
        (dict(shared_hidden=-8), ValueError, "shared_hidden"),
        (dict(shared_hidden=40.0), ValueError, "shared_hidden"),
        (dict(shared_hidden=True), ValueError, "shared_hidden"),
        (dict(shared_hidden=40, n_shared_experts=2), ValueError, "n_shared_experts"),
        (dict(shared_gate=1), TypeError, "shared_gate"),
        (dict(shared_gate=True), ValueError, "shared_gate"),
        (dict(shared_gate=True, n_shared_experts=0), ValueError, "shared_gate"),
    ],
)
def test_bad_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        MoELayer(D, E, K, H, **kw)


# ---------------------------------------------------------------------------------------------
# (e) torch.compile(fullgraph=True) == eager


@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_equals_eager(router_dtype):
    torch._dynamo.reset()
    try:
        with torch.compiler.config.patch(force_disable_caches=True):
            eager = _new_layer(router_dtype=router_dtype)
            layer = copy.deepcopy(eager)
            compiled = torch.compile(layer, fullgraph=True)
            x = inputs(8)
            ref, got = run_grads(eager, x), run_grads(layer, x, fn=compiled)
            assert torch.equal(layer.last_counts, eager.last_counts)
            for name in ref:
                err = rel(got[name], ref[name])
                assert err <= grad_tol(name, router_dtype, 1e-5), (name, err)
    finally:
        torch._dynamo.reset()
