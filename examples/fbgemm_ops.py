"""FBGEMM-style MoE calls (the names, arguments and outputs of fbgemm_gpu.experimental.gen_ai.moe):
index_shuffling, gather_scale_dense_tokens, a SwiGLU expert MLP with silu_mul,
scatter_add_dense_tokens; the FP8 variants; and the expert-parallel reshuffles. Each result is
checked against plain torch.

    python examples/fbgemm_ops.py

CUDA tensors run the Triton kernels, CPU tensors the pure-torch reference. Shapes in the names:
T tokens, E experts, k experts per token, D model width, H expert hidden size, N = T*k pairs.
"""

# README >>>
import torch

import moe_kernels as mk

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
T, E, k, D, H = 32, 4, 2, 64, 32
torch.manual_seed(0)
x_TD = torch.randn(T, D, device=device, dtype=dtype)
w_in_EXD = torch.randn(E, 2 * H, D, device=device, dtype=dtype) / D**0.5  # SwiGLU: gate, up
w_out_EDH = torch.randn(E, D, H, device=device, dtype=dtype) / H**0.5
scores_TE = torch.sigmoid(torch.randn(T, E, device=device))

# Pairs (expert, token) sorted by expert, then token; counts_E2: E per-expert counts, T, N
counts_E2, expert_idx_N, token_idx_N = mk.index_shuffling(scores_TE, top_k=k)
xs_ND = mk.gather_scale_dense_tokens(x_TD, token_idx_N, expert_idx_N, scores_TE)  # x * score
bounds = [0, *torch.cumsum(counts_E2[:E], 0).tolist()]  # expert e: rows bounds[e]:bounds[e+1]
ys_ND = torch.empty_like(xs_ND)
for e in range(E):
    h = xs_ND[bounds[e] : bounds[e + 1]] @ w_in_EXD[e].T
    ys_ND[bounds[e] : bounds[e + 1]] = mk.silu_mul(h[:, :H], h[:, H:]) @ w_out_EDH[e].T
out_TD = torch.zeros(T, D, device=device, dtype=dtype)
mk.scatter_add_dense_tokens(out_TD, ys_ND, token_idx_N)  # in place, ascending i, no atomics

# Row-wise FP8 (e4m3) variants: data and one fp32 scale per row
q_ND, q_scale_N = mk.gather_scale_quant_dense_tokens(x_TD, token_idx_N, expert_idx_N, scores_TE)
a_fp8, a_scale = mk.silu_mul_quant(h[:, :H], h[:, H:])  # the last expert's rows
# README <<<

# README >>>
# Expert parallelism over EP ranks. After the all-to-all a rank holds the rows every rank sent
# it, rank by rank: token_counts_RE[r, e] rows of rank r for expert e. This rank's experts are
# [lo, hi); combine_shuffling regroups their rows expert by expert, split_shuffling undoes it.
EP = 2
lo, hi = 0, E // EP
token_counts_RE = torch.randint(0, 4, (EP, E), device=device, dtype=torch.int32)
rows_MD = torch.randn(int(token_counts_RE.sum()), D, device=device, dtype=dtype)
by_expert_MD, local_counts = mk.combine_shuffling(rows_MD, token_counts_RE, lo, hi)
back_MD = mk.split_shuffling(by_expert_MD, token_counts_RE, lo, hi)  # rank-first, others zero

# The combine of padded per-rank buffers: position p of the sorted pairs comes from the rank
# of its expert, in_RND[rank, p]; summed into token order as scatter_add_dense_tokens does
in_RND = torch.zeros(EP, T * k, D, device=device, dtype=dtype)
rank_N = expert_idx_N.long() // (E // EP)
in_RND[rank_N, torch.arange(T * k, device=device)] = ys_ND
out_padded_TD = torch.zeros(T, D, device=device, dtype=dtype)
mk.scatter_add_padded_tokens(in_RND, counts_E2[:E], token_idx_N, out_padded_TD)
# README <<<

# index_shuffling: each token's top-k experts, the (expert, token) pairs sorted
top_TK = torch.topk(scores_TE, k).indices
key_N = torch.sort((top_TK * T + torch.arange(T, device=device)[:, None]).flatten()).values
assert torch.equal(expert_idx_N.long(), key_N // T)
assert torch.equal(token_idx_N.long(), key_N % T)
assert counts_E2[E] == T and counts_E2[E + 1] == T * k

# gather_scale_dense_tokens: the row times its score, in fp32, rounded once
picked_N = scores_TE[token_idx_N.long(), expert_idx_N.long()]
scaled_ND = x_TD[token_idx_N.long()].float() * picked_N[:, None]
assert torch.equal(xs_ND, scaled_ND.to(dtype))

# silu_mul (within a few fp32 ulps of torch's silu) and the MLP by hand
gate, up = h[:, :H].float(), h[:, H:].float()
swiglu = gate * torch.sigmoid(gate) * up
tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
torch.testing.assert_close(mk.silu_mul(h[:, :H], h[:, H:]).float(), swiglu, **tol)

# scatter_add_dense_tokens: exactly the sequential loop, each add in fp32 rounded to out's dtype
want_TD = torch.zeros(T, D, device=device, dtype=dtype)
for i, t in enumerate(token_idx_N.tolist()):
    want_TD[t] = (want_TD[t].float() + ys_ND[i].float()).to(dtype)
assert torch.equal(out_TD, want_TD)

# FP8 rows of the fp32 values: scale = row max / 448 (e4m3's largest value), data * scale
# within e4m3's precision (3 mantissa bits; subnormal step 2**-9 times the scale)
for data, scale, want in ((q_ND, q_scale_N, scaled_ND), (a_fp8, a_scale, swiglu)):
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    torch.testing.assert_close(scale, want.abs().amax(1) / 448, rtol=1e-5, atol=0)
    atol = float(scale.max()) * 2**-9  # e4m3's subnormal step, scaled
    torch.testing.assert_close(data.float() * scale[:, None], want, rtol=2**-4, atol=atol)

# combine_shuffling: the local experts' chunks, expert by expert, rank by rank; then zeros
starts = (torch.cumsum(token_counts_RE.flatten(), 0) - token_counts_RE.flatten()).tolist()
counts = token_counts_RE.flatten().tolist()
chunks = [(starts[r * E + e], counts[r * E + e]) for e in range(lo, hi) for r in range(EP)]
want_MD = torch.cat([rows_MD[s : s + n] for s, n in chunks])
assert torch.equal(by_expert_MD[: len(want_MD)], want_MD)
assert not by_expert_MD[len(want_MD) :].any()
assert local_counts.tolist() == [*token_counts_RE[:, lo:hi].sum(0).tolist(), len(want_MD)]
# split_shuffling puts the local experts' rows back where they came from
for s, n in chunks:
    assert torch.equal(back_MD[s : s + n], rows_MD[s : s + n])

# scatter_add_padded_tokens: the same sums as the dense scatter-add, bit for bit
assert torch.equal(out_padded_TD, out_TD)

print(f"device {device}, {dtype}: T={T} tokens, E={E} experts, top-{k}, D={D}, H={H} (SwiGLU)")
print(f"  index_shuffling counts {counts_E2.tolist()} (E per-expert counts, then T, then N)")
pairs = list(zip(expert_idx_N[:4].tolist(), token_idx_N[:4].tolist(), strict=True))
print(f"  first pairs (expert, token): {pairs}")
gap = (q_ND.float() * q_scale_N[:, None] - scaled_ND).abs().max().item()
print(f"  FP8 rows: max |dequantised - exact| {gap:.3f}")
print(f"  expert parallelism: rank-first counts {token_counts_RE.tolist()}")
print(f"  local experts [{lo}, {hi}) hold {local_counts.tolist()} rows (each expert, then all)")
print("OK")
