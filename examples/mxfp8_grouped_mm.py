"""MXFP8 (e4m3 data, one e8m0 scale per 32 values): the casts, the per-group blocked scale layout
and the MXFP8 grouped GEMM of an MoE layer's first expert GEMM, on rows a routing plan grouped.
Each result is checked against plain torch.

    python examples/mxfp8_grouped_mm.py

CUDA tensors run the Triton kernels (and torch._scaled_grouped_mm on compute capability 10.x),
CPU tensors the pure-torch reference. Shapes in the names: T tokens, E experts, k experts per
token, D model width (the GEMM's K), N output width, M = T*k grouped rows.
"""

# README >>>
import torch

import moe_kernels as mk

device = "cuda" if torch.cuda.is_available() else "cpu"
T, E, k, D, N = 48, 4, 2, 64, 32  # D: a multiple of 32 (the MXFP8 block)
torch.manual_seed(0)
x_TD = torch.randn(T, D, device=device, dtype=torch.bfloat16)
w_EDN = torch.randn(E, D, N, device=device, dtype=torch.bfloat16) / D**0.5  # (E, K, N)
plan = mk.route(torch.softmax(torch.randn(T, E, device=device), dim=-1), top_k=k)
a_MD = mk.dispatch(x_TD, plan)  # (T*k, D), rows grouped by expert

data, scale = mk.to_mxfp8(a_MD)  # e4m3 data (M, D), e8m0 scale per 32 values (M, D // 32)
a_back = mk.from_mxfp8(data, scale)  # dequantised, bf16
ends_E = plan.offsets[1:]  # (E,) end offsets, as torch._grouped_mm takes them (offsets: (E+1,))
blocked, start_rows = mk.to_blocked_per_group_2d(scale, ends_E)  # cuBLAS's layout, per group
out_MN = mk.mxfp8_grouped_mm(a_MD, w_EDN, ends_E)  # q(a)[m] @ q(w[e]) for the rows m of e
# README <<<

# The scale of a block is the smallest power of two 2**e with 2**e * 448 >= the block's max |a|
amax = a_MD.float().abs().reshape(-1, D // 32, 32).amax(-1)
step = scale.float()  # 2**e per block
assert bool((step * 448 >= amax).all() and (step * 224 < amax).all())
# Dequantised values are within e4m3's precision: 3 mantissa bits, subnormal step 2**-9 * 2**e
err = (a_back.float() - a_MD.float()).abs()
bound = a_MD.float().abs() * 2**-4 + step.repeat_interleave(32, dim=1) * 2**-10
assert bool((err <= bound).all())

# Group g's scales sit in cuBLAS's blocked layout at rows start_rows[g]:start_rows[g+1]
bounds, starts = plan.offsets.tolist(), start_rows.tolist()
for e in range(E):
    tiles = mk.to_blocked(scale[bounds[e] : bounds[e + 1]]).view(torch.uint8)
    assert torch.equal(blocked[starts[e] : starts[e + 1]].view(torch.uint8), tiles)

# The grouped GEMM: both operands quantised along D (w[e] column by column), fp32 accumulation
for e in range(E):
    rows = slice(bounds[e], bounds[e + 1])
    w_data, w_scale = mk.to_mxfp8_dim1(w_EDN[e])  # (N, D): blocks of 32 down D
    w_back = mk.from_mxfp8(w_data, w_scale, torch.float32).T  # (D, N)
    want = (a_back[rows].float() @ w_back).to(torch.bfloat16)
    torch.testing.assert_close(out_MN[rows], want, rtol=1e-2, atol=1e-2)

rel = ((a_back.float() - a_MD.float()).norm() / a_MD.float().norm()).item()
print(f"device {device}: M={T * k} rows in E={E} groups {plan.counts.tolist()}, D={D}, N={N}")
print(f"  MXFP8 round trip: relative error {rel:.3%}")
print(f"  scale bytes (127 + e) of row 0: {scale[0].view(torch.uint8).tolist()}")
print(f"  blocked scales {tuple(blocked.shape)}, group start rows {starts}")
print(f"  mxfp8_grouped_mm -> {tuple(out_MN.shape)} {out_MN.dtype}, matches the dequantised GEMM")
print("OK")
