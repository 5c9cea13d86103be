"""Hugging Face transformers' MoE models on moe-kernels: a tiny random Qwen3-MoE switched to the
``"moe_kernels"`` experts backend, trained a few steps and asked to generate; checked against
transformers' own eager experts (the same logits, the same training, the same tokens).

    pip install 'moe-model[hf]'   # transformers >= 5
    python examples/hf_moe_backend.py

On CUDA the experts run moe-kernels' Triton kernels; on CPU their pure-torch references.
"""

# README >>>
import torch
import transformers

import moe_model.hf  # noqa: F401 (registers experts_implementation="moe_kernels")

device = "cuda" if torch.cuda.is_available() else "cpu"
config = transformers.Qwen3MoeConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
)  # fmt: skip
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(
    config, dtype=torch.float32, experts_implementation="moe_kernels"
).to(device)  # or, on a loaded model: model.set_experts_implementation("moe_kernels")

ids = torch.randint(0, 128, (4, 32), device=device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(5):
    loss = model(ids, labels=ids).loss  # the experts' forward and backward on moe-kernels
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
tokens = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
# README <<<


def train_and_generate(impl: str) -> tuple[list[float], torch.Tensor]:
    """The same five steps and the same greedy generation from the same start, on ``impl``."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, experts_implementation=impl
    ).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        step_loss = m(ids, labels=ids).loss
        step_loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(step_loss.item())
    return losses, m.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)


ours, our_tokens = train_and_generate("moe_kernels")
eager, eager_tokens = train_and_generate("eager")
print(f"device {device}")
print("loss, moe_kernels:", " ".join(f"{v:.5f}" for v in ours))
print("loss, HF eager:   ", " ".join(f"{v:.5f}" for v in eager))
assert ours[-1] < ours[0], "training lowers the loss"
# fp32 on both sides; other summation orders only (the experts' sums, the fp32 combine)
assert max(abs(a - b) for a, b in zip(ours, eager, strict=True)) <= 1e-4 * eager[0]
assert torch.equal(our_tokens, eager_tokens) and torch.equal(tokens, our_tokens)
print("generated:", tokens[0, 8:].tolist())
print("OK")
