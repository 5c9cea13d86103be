"""moe_kernels on its own: the routing plan (route, dispatch, combine) around a by-hand expert
MLP, then the fused ops that replace the middle steps (gather_grouped_mm, expert_mlp,
routed_experts), and DeepSeek-V3's routing options. Each result is checked against plain torch.

    python examples/routing_and_experts.py

CUDA tensors run the Triton kernels, CPU tensors the pure-torch reference (or, with
TRITON_INTERPRET=1 set, the Triton kernels in Triton's interpreter). Shapes in the names:
T tokens, E experts, k experts per token, D model width, H expert hidden size.
"""

# README >>>
import torch
import torch.nn.functional as F

import moe_kernels as mk

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
T, E, k, D, H = 64, 8, 2, 32, 16
torch.manual_seed(0)
x_TD = torch.randn(T, D, device=device, dtype=dtype)
w_in_EHD = torch.randn(E, H, D, device=device, dtype=dtype) / D**0.5  # nn.Linear layout: out x in
w_out_EDH = torch.randn(E, D, H, device=device, dtype=dtype) / H**0.5
probs_TE = torch.softmax(torch.randn(T, E, device=device), dim=-1)  # the router's scores

# The routing plan: deterministic end to end (pairs sorted by expert, then token)
plan = mk.route(probs_TE, top_k=k)  # counts (E,), offsets (E+1,), expert/token indices, weights
xs = mk.dispatch(x_TD, plan)  # (T*k, D): x's rows grouped by expert
# Expert e owns the rows offsets[e]:offsets[e+1]. One expert at a time here; on CUDA sm90+
# torch._grouped_mm(xs, w_in_EHD.mT, offs=plan.offsets[1:]) runs them all in one call.
bounds = plan.offsets.tolist()
ys = torch.empty_like(xs)
for e in range(E):
    rows = slice(bounds[e], bounds[e + 1])
    ys[rows] = F.silu(xs[rows] @ w_in_EHD[e].T) @ w_out_EDH[e].T
y_TD = mk.combine(ys, plan)  # (T, D): each token's k rows, weighted, summed in fp32, no atomics

# The same, fused: the gather and SiLU in the first GEMM, the whole MLP, the MLP and the combine
h = mk.gather_grouped_mm(x_TD, w_in_EHD, plan.offsets, plan.token_indices, activation="silu")
ys_fused = mk.expert_mlp(x_TD, w_in_EHD, w_out_EDH, plan.offsets, plan.token_indices, plan.inverse)
y_fused = mk.routed_experts(x_TD, w_in_EHD, w_out_EDH, plan)  # one autograd node

# DeepSeek-V3's routing: score + bias selects, within each token's 2 best of 4 expert groups;
# the weights (unbiased scores) renormalised, then scaled
sigmoid_TE = torch.sigmoid(torch.randn(T, E, device=device))
bias_E = 0.01 * torch.randn(E, device=device)
options = {"bias": bias_E, "n_groups": 4, "topk_groups": 2, "renormalize": True, "scale": 2.5}
ds_plan = mk.route(sigmoid_TE, k, **options)
# README <<<

# What the plan says: token t's j-th choice (by descending score) sits at row plan.inverse[t, j].
top = torch.topk(probs_TE, k)
inv = plan.inverse.long()
assert torch.equal(plan.expert_indices[inv].long(), top.indices)
tokens_TK = torch.arange(T, device=device)[:, None].expand(T, k)
assert torch.equal(plan.token_indices[inv].long(), tokens_TK)
assert torch.equal(plan.weights[inv], top.values)
assert torch.equal(plan.counts.long(), torch.bincount(top.indices.flatten(), minlength=E))
assert torch.equal(plan.offsets[1:].long(), torch.cumsum(plan.counts, 0))

# dispatch gathers rows; combine is the fp32 sum over j of weight * row, in j order
assert torch.equal(xs, x_TD[plan.token_indices.long()])
acc_TD = torch.zeros(T, D, device=device)
for j in range(k):
    acc_TD = acc_TD + plan.weights[inv[:, j], None] * ys[inv[:, j]].float()
assert torch.equal(y_TD, acc_TD.to(dtype))

# The fused ops against the by-hand steps (other roundings: close, not equal, in bf16)
tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
h_by_hand = [F.silu(xs[bounds[e] : bounds[e + 1]] @ w_in_EHD[e].T) for e in range(E)]
torch.testing.assert_close(h, torch.cat(h_by_hand), **tol)
torch.testing.assert_close(ys_fused, ys, **tol)
torch.testing.assert_close(y_fused, y_TD, **tol)
assert torch.equal(y_fused, mk.combine(ys_fused, plan))  # routed_experts is combine(expert_mlp)

# The selection options against topk_choices, route's rule in plain torch
ds = mk.topk_choices(sigmoid_TE, k, **options)
assert torch.equal(ds_plan.expert_indices[ds_plan.inverse.long()].long(), ds.experts)
torch.testing.assert_close(ds_plan.weights[ds_plan.inverse.long()], ds.weights)
torch.testing.assert_close(ds.weights.sum(1), torch.full((T,), 2.5, device=device))

print(f"device {device}, {dtype}: T={T} tokens, E={E} experts, top-{k}, D={D}, H={H}")
print(f"  pairs per expert {plan.counts.tolist()}, group offsets {plan.offsets.tolist()}")
weights = ", ".join(f"{w:.3f}" for w in top.values[0].tolist())
print(f"  token 0 -> experts {top.indices[0].tolist()} with weights {weights}")
gap = (y_fused.float() - y_TD.float()).abs().max().item()
print(f"  routed_experts == combine(expert_mlp); max |fused - by hand| {gap:.2e}")
print(f"  DeepSeek-V3 routing: token 0 -> experts {ds.experts[0].tolist()}, weights sum to 2.5")
print("OK")
