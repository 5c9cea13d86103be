"""The grouped GEMMs on the GPU at MoE shapes:

* ``gather_grouped_mm`` (rows gathered through a routing plan, SiLU; and sorted rows) at the seed
  layer's shape against the fp32 reference within one bf16 rounding of each side plus fp32
  accumulation-order noise, rows past the plan exactly zero, outputs poisoned, no host sync,
  bitwise repeatable;
* sorted rows on sm90 bf16, where the public op runs the persistent Triton kernel (few rows per
  expert) or ``torch._grouped_mm``'s CUTLASS GEMM: the four row-grouped GEMMs of a training step
  (up, down and the two data gradients through ``.mT`` views) bit for bit equal to CUTLASS at 128
  to 1024 rows per expert;
* ``grouped_weight_grad`` (the layer's two weight gradients over a real plan's unaligned groups)
  against the fp32 reference, bitwise repeatable.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import grouped_mm as ref
from moe_kernels.testing import bits_equal, forbid_host_sync, gpu_test_device, poison

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]


def within_bf16(y: torch.Tensor, want: torch.Tensor, n_valid: int) -> None:
    """|y - want| <= 2**-7 |want| + 2**-7 max |want| / 64, finite, rows past n_valid zero."""
    yf, wf = y.float(), want.float()
    err = (yf - wf).abs()
    tol = 2.0**-7 * wf.abs() + 2.0**-7 * float(wf.abs().max()) / 64
    assert bool(torch.isfinite(yf).all()), "non-finite outputs"
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g} beyond the bf16 bound"
    assert bool((y[n_valid:] == 0).all()), "rows past the plan must be zero"


@pytest.mark.parametrize("T", [2048, 512])
def test_gather_grouped_mm_at_the_seed_shape(T):
    """Seed MoE: E 16, top-8, d_model 2048, hidden 1024, bf16; GEMM1 gathers x through the plan
    with SiLU, GEMM2 takes its sorted output."""
    E, K, D, H = (16, 8, 2048, 1024) if ON_GPU else (4, 2, 64, 32)
    T = T if ON_GPU else 32
    g = torch.Generator(device=DEV).manual_seed(0)
    plan = mk.route(torch.randn(T, E, device=DEV, generator=g).softmax(-1), K)
    x = (torch.randn(T, D, device=DEV, generator=g) * 0.5).bfloat16()
    w1 = (torch.randn(E, H, D, device=DEV, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device=DEV, generator=g) / H**0.5).bfloat16()
    n = plan.token_indices.shape[0]
    want1 = ref.gather_grouped_mm(x, w1, plan.offsets, plan.token_indices, "silu")
    want2 = ref.gather_grouped_mm(want1, w2, plan.offsets, None, None)
    for _ in range(2):  # the first launch compiles, the second takes the cached handle
        poison(n * D * 2, device=DEV)  # 0xFF: NaN in bf16
        with forbid_host_sync(ON_GPU):
            y1 = mk.gather_grouped_mm(x, w1, plan.offsets, plan.token_indices, activation="silu")
            y2 = mk.gather_grouped_mm(want1, w2, plan.offsets)
        within_bf16(y1, want1, n)
        within_bf16(y2, want2, n)
    assert bits_equal(y1, mk.gather_grouped_mm(x, w1, plan.offsets, plan.token_indices,
                                               activation="silu"))  # fmt: skip


SHAPES = {  # name: (tokens, d_model, hidden, experts, top_k, gated); rows per expert T k / E
    "k2": (8192, 2048, 768, 128, 2, True),  # 128
    "t2048": (2048, 2048, 768, 128, 8, True),  # 128
    "e256": (8192, 2048, 768, 256, 8, True),  # 256
    "seed": (2048, 2048, 1024, 16, 8, False),  # 1024
}


def layer_problem(shape):
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=DEV).manual_seed(0)
    plan = mk.route(torch.randn(T, E, device=DEV, generator=g).softmax(-1), k)
    R, X = plan.token_indices.shape[0], 2 * H if gated else H

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=DEV, generator=g) * scale).to(torch.bfloat16)

    return plan, R, X, r


@pytest.mark.parametrize("name", list(SHAPES))
def test_sorted_rows_equal_cutlass(name):
    """The public op on sorted rows (persistent kernel or CUTLASS, as the rule picks) equals
    ``torch._grouped_mm`` bit for bit on the group rows."""
    if not ON_GPU or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("CUTLASS's grouped GEMM is the sm90 bf16 path")
    T, D, H, E, k, gated = SHAPES[name]
    plan, R, X, r = layer_problem(SHAPES[name])
    w_in, w_out = r(E, X, D, scale=D**-0.5), r(E, D, H, scale=H**-0.5)
    offs32 = plan.offsets[1:].to(torch.int32)
    rows = int(plan.offsets[-1])
    gemms = {  # name: (a (R, K), w as the (E, N, K) operand the public op takes)
        "up": (r(R, D), w_in),
        "down": (r(R, H), w_out),
        "dgrad": (r(R, D, scale=D**-0.5), w_out.mT),
        "dx": (r(R, X), w_in.mT),
    }
    for gemm, (a, w) in gemms.items():
        got = mk.gather_grouped_mm(a, w, plan.offsets)
        cutlass = torch._grouped_mm(a, w.mT, offs=offs32)
        assert torch.equal(got[:rows], cutlass[:rows]), gemm


@pytest.mark.parametrize("name", ["t2048", "seed"])
def test_grouped_weight_grad(name):
    """dw_in[e] = dh_e.T @ xs_e and dw_out[e] = dyg_e.T @ a_e over a plan's unaligned groups."""
    T, D, H, E, k, gated = SHAPES[name] if ON_GPU else (64, 32, 16, 4, 2, True)
    plan, R, X, r = layer_problem((T, D, H, E, k, gated))
    for dy, x in ((r(R, X), r(R, D)), (r(R, D), r(R, H))):
        want = ref.grouped_weight_grad(dy.float(), x.float(), plan.offsets, None, torch.float32)
        got = mk.grouped_weight_grad(dy, x, plan.offsets)
        err = ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 1e-2, f"relative error {err:.2e}"
        assert bits_equal(got, mk.grouped_weight_grad(dy, x, plan.offsets)), "not repeatable"
