"""moe_model.MoELayer: a forward and a backward, checked against the layer's formula written out in
plain torch from its parameters; the same weights under other implementations; a published
model's layer (DeepSeek-V3's routing options), shrunk.

    python examples/moe_layer.py

On CUDA the kernel implementations run Triton kernels; on CPU the pure-torch reference.
"""

# README >>>
import torch

from moe_model import MOE_IMPLS, MoELayer

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
# d_model 64, 8 SiLU experts of hidden 32, top-2; impl: one of MOE_IMPLS, switchable later
moe = MoELayer(64, n_experts=8, top_k=2, hidden=32, impl="triton_bf16", device=device, dtype=dtype)
x = torch.randn(4, 16, 64, device=device, dtype=dtype, requires_grad=True)  # (..., d_model)
y = moe(x)  # (..., d_model) in x's dtype; moe.last_counts: pairs per expert
y.float().square().sum().backward()  # x.grad, and the router's and experts' .grad

# A published model's layer and its routing options (MOE_PRESETS, docs/moe_layer.md), shrunk
ds = MoELayer.from_preset("deepseek-v3", d_model=64, n_experts=16, hidden=32, device=device)
y_ds = ds(x.detach().float())
# README <<<


def by_hand(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """The layer's formula for plain top-k softmax routing: y = sum_j s_j expert_{e_j}(x), with
    s = softmax(router(x)) in fp32 and expert_e(x) = out_proj[e] @ silu(in_proj[e] @ x)."""
    scores = torch.softmax(x_TD.float() @ layer.router.weight.float().T, dim=-1)
    weights, experts = torch.topk(scores, layer.top_k)
    y = torch.zeros_like(x_TD, dtype=torch.float32)
    for j in range(layer.top_k):
        w_in, w_out = layer.in_proj[experts[:, j]].float(), layer.out_proj[experts[:, j]].float()
        h = torch.nn.functional.silu(torch.einsum("thd,td->th", w_in, x_TD.float()))
        y = y + weights[:, j, None] * torch.einsum("tdh,th->td", w_out, h)
    return y.to(x_TD.dtype)


def assert_near(got: torch.Tensor, want: torch.Tensor, impl: str) -> None:
    """max |got - want| within a fraction of max |want|: 8-bit GEMM operands (mxfp8, fp8), bf16
    roundings (bf16 x, or triton_bf16's bf16 combine output), else fp32 sums in other orders."""
    if impl in ("mxfp8", "fp8"):
        rel = 0.15
    elif dtype == torch.bfloat16 or impl == "triton_bf16":
        rel = 3e-2
    else:
        rel = 1e-5
    err, size = (got.float() - want.float()).abs().max().item(), want.abs().max().item()
    assert err <= rel * size, f"{impl}: max error {err:.3g}, max value {size:.3g}"


grads = [x.grad, moe.router.weight.grad, moe.in_proj.grad, moe.out_proj.grad]
x_ref = x.detach().clone().requires_grad_()
params = [moe.router.weight, moe.in_proj, moe.out_proj]
for p in params:
    p.grad = None
y_ref = by_hand(moe, x_ref.reshape(-1, 64)).reshape(x.shape)
y_ref.float().square().sum().backward()
assert_near(y, y_ref, moe.impl)
for got, want in zip(grads, [x_ref.grad] + [p.grad for p in params], strict=True):
    assert_near(got, want, moe.impl)
counts = moe.last_counts.tolist()
assert sum(counts) == x.shape[0] * x.shape[1] * moe.top_k

# Every implementation that runs here computes the same layer from the same weights
ran = []
for impl in MOE_IMPLS:
    try:
        moe.impl = impl
    except (RuntimeError, TypeError, ValueError) as why:  # e.g. fbgemm_gpu not installed
        print(f"  impl {impl}: skipped ({why})")
        continue
    with torch.no_grad():
        out = moe(x)
    assert_near(out, y_ref, impl)
    ran.append(impl)

# DeepSeek-V3's options: top-8 within 4 of 8 expert groups, a shared expert
assert ds.top_k == 8 and ds.n_groups == 8 and ds.topk_groups == 4
assert ds.shared_experts is not None
assert y_ds.shape == x.shape and bool(y_ds.isfinite().all())

print(f"device {device}, {dtype}: MoELayer(64, n_experts=8, top_k=2, hidden=32)")
print(f"  y {tuple(y.shape)} {y.dtype}; pairs per expert {counts}")
print("  forward and gradients (x, router, experts) match the formula written out in torch")
print(f"  the same layer under {', '.join(ran)}: the same output")
print(f"  deepseek-v3 preset, shrunk: {ds.n_experts} experts, top-{ds.top_k}, {ds.n_groups} groups")
print("OK")
