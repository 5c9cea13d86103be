"""moe_model.hf: transformers' MoE families on the ``"moe_kernels"`` experts backend against
HF's own eager experts (the independent reference): logits and every gradient of tiny random
models in fp32, on the fused path (SiLU-gated families) and the composed one (GPT-OSS: biases,
its clamped gate on interleaved rows; another activation); the backend really runs."""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers", minversion="5.0")
hf = pytest.importorskip("moe_model.hf")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def family_config(family: str):
    moe = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                                num_experts_per_tok=2)  # fmt: skip
    if family == "qwen2_moe":  # a sigmoid-gated shared expert of its own size
        return tf.Qwen2MoeConfig(**COMMON, **moe, intermediate_size=48,
                                 shared_expert_intermediate_size=40)  # fmt: skip
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, **moe, intermediate_size=48, norm_topk_prob=True,
                                 head_dim=16)  # fmt: skip
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if family == "deepseek_v3":  # sigmoid, correction bias, groups, scaling, shared experts
        mla = {**COMMON, "num_key_value_heads": 4}  # MLA: no grouped kv heads (HF masks fail)
        return tf.DeepseekV3Config(
            **mla, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        )  # fmt: skip
    if family == "gpt_oss":  # biases, transposed storage, interleaved gate/up, alpha, limit
        return tf.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                               num_experts_per_tok=2, head_dim=16, sliding_window=16)  # fmt: skip
    if family == "llama4":  # sigmoid of the top-k logits, the weight on the expert's input
        return tf.Llama4TextConfig(**COMMON, intermediate_size=32, intermediate_size_mlp=48,
                                   num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                   interleave_moe_layer_step=1)  # fmt: skip
    if family == "mixtral_gelu":  # another activation
        return tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                                num_experts_per_tok=2, hidden_act="gelu")  # fmt: skip
    raise AssertionError(family)


FUSED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]
FAMILIES = [*FUSED, "gpt_oss", "mixtral_gelu"]  # (Llama4's experts skip ExpertsInterface)
BLOCK_FAMILIES = [*FUSED, "gpt_oss", "llama4"]  # what replace_moe_blocks takes
# CUDA (``-m gpu``): the same fp32 parity with the Triton kernels against HF's eager experts
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def tiny_model(family: str, device: str = "cpu"):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    model = model.to(device)
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "_proj_bias")):  # not all zeros
                t.normal_(0, 0.1)
    return model


def logits_and_grads(model, impl: str, ids: torch.Tensor):
    model.set_experts_implementation(impl)
    model.zero_grad()
    logits = model(ids).logits
    logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_backend_matches_hf_eager(family, device, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    calls = []

    def spy(self, *args):
        calls.append(hf.fused(self))
        return hf.experts_forward(self, *args)

    monkeypatch.setitem(tf.integrations.moe.ExpertsInterface._global_mapping, hf.BACKEND, spy)
    model = tiny_model(family, device)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    want, want_grads = logits_and_grads(model, "eager", ids)
    assert not calls
    got, got_grads = logits_and_grads(model, hf.BACKEND, ids)
    assert calls and set(calls) == {family in FUSED}  # every MoE layer ran, on the right path
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        err = (got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
        assert err <= 1e-5, (name, err.item())


def test_backend_is_repeatable_and_compiles():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = family_config("qwen3_moe")
    config._experts_implementation = hf.BACKEND
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 9, 64, requires_grad=True)
    y = block(x)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x)
    y2 = block(x)
    (gx2,) = torch.autograd.grad(y2.pow(2).sum(), x)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x), y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sentinel_choices_contribute_nothing(family):
    """Expert-parallel sentinels (ids >= E) drop out, as HF's grouped_mm backend drops them."""
    experts = tiny_model(family).model.layers[1].mlp.experts
    x = torch.randn(5, 64)
    idx = torch.tensor([[0, 8], [1, 2], [9, 3], [4, 5], [7, 8]])
    w = torch.rand(5, 2)
    keep = idx < 8
    with torch.no_grad():
        got = hf.experts_forward(experts, x, idx, w)
        want = hf.experts_forward(experts, x, torch.where(keep, idx, 0), torch.where(keep, w, 0.0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_registered_and_selectable():
    assert hf.BACKEND in tf.integrations.moe.ALL_EXPERTS_FUNCTIONS
    model = tf.AutoModelForCausalLM.from_config(
        family_config("olmoe"), experts_implementation=hf.BACKEND
    )
    assert model.config._experts_implementation == hf.BACKEND


def test_ungated_experts_of_another_activation():
    """Nemotron-H's experts: ``up_proj`` without a gate and relu² (the composed path), against
    HF's eager experts on the same module: output and every gradient."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = tf.NemotronHConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                num_experts_per_tok=3)  # fmt: skip
    torch.manual_seed(0)
    experts = NemotronHExperts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert not experts.has_gate and not hf.fused(experts)
    x = torch.randn(9, 64, requires_grad=True)
    idx = torch.stack([torch.randperm(8)[:3] for _ in range(9)])
    w = torch.rand(9, 3, requires_grad=True)
    results = {}
    for impl in ("eager", hf.BACKEND):
        config._experts_implementation = impl
        y = experts(x, idx, w)
        grads = torch.autograd.grad(y.pow(2).sum(), (x, w, experts.up_proj, experts.down_proj))
        results[impl] = (y, *grads)
    for got, want in zip(results[hf.BACKEND], results["eager"], strict=True):  # fp32 sums
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_calls_name_the_argument():
    """Mismatched shapes and missing weights: a ValueError naming HF's argument or attribute
    (plan_from_choices names its own: the weights' shape)."""
    experts = tiny_model("qwen3_moe").model.layers[1].mlp.experts
    x, idx, w = torch.randn(5, 64), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    with pytest.raises(ValueError, match="hidden_states must have .* 64 columns"):
        hf.experts_forward(experts, torch.randn(5, 32), idx, w)
    with pytest.raises(ValueError, match="hidden_states must be a 2-D tensor"):
        hf.experts_forward(experts, x[None], idx, w)
    with pytest.raises(ValueError, match="top_k_index must have one row per token"):
        hf.experts_forward(experts, x, idx[:4], w[:4])
    with pytest.raises(ValueError, match="weights must have expert_indices' shape"):
        hf.experts_forward(experts, x, idx, w[:, :1])
    with pytest.raises(TypeError, match="expert_indices"):
        hf.experts_forward(experts, x, idx.float(), w)
    del experts.down_proj
    with pytest.raises(ValueError, match="Qwen3MoeExperts has no down_proj"):
        hf.experts_forward(experts, x, idx, w)
