"""``_gemm_plan.choose_gemm``: which kernel runs each grouped GEMM, from sizes and flags alone
(no GPU needed). Expected plans are written out from the rules' measured bounds (1024 rows per
expert for the persistent row-grouped GEMM, 128 for its weight gradient, X <= 1024 for the
gathering up-projection without gradients, 8 rows per expert and 1024 in all for the grouped GEMV),
not computed with the module's constants."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_kernels._gemm_plan import (
    GemmDevice,
    GemmPlan,
    GemmProblem,
    choose_gemm,
    gemm_device,
    plan_gather_mlp,
    plan_rows,
    plan_wgrad,
)

H100 = GemmDevice("triton", 9)
B200 = GemmDevice("triton", 10)
A100 = GemmDevice("triton", 8, fp8_mma=False)  # sm_80: no e4m3 type
L40 = GemmDevice("triton", 8)  # sm_89: e4m3 tensor cores
INTERP = GemmDevice("interpreter", 0)
REF = GemmDevice("reference", 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def rows(P, E, N=256, K=512, dtype=BF16, layout="nk", tma=True, aligned=True):
    return GemmProblem("rows", P, N, K, E, dtype, layout=layout, tma=tma, aligned=aligned)


def wgrad(P, E, N=256, K=512, dtype=BF16, T=None, tma=True, gathered=False, compiling=False):
    return GemmProblem("wgrad", P, N, K, E, dtype, x_rows=P if T is None else T, tma=tma,
                       gathered=gathered, compiling=compiling)  # fmt: skip


def kernel(problem, dev):
    return choose_gemm(problem, dev).kernel


@pytest.mark.parametrize(
    ("P", "E", "want"),
    [(8 * 1024, 8, "persistent"), (8 * 1024 + 1, 8, "cutlass"), (0, 8, "persistent"),
     (4096, 0, "triton"), (128 * 64, 64, "persistent"), (2048 * 64, 64, "cutlass")],
)  # fmt: skip
def test_rows_persistent_up_to_1024_rows_per_expert_then_cutlass(P, E, want):
    assert kernel(rows(P, E), H100) == want


def test_rows_persistent_plan_carries_config_and_layout():
    plan = choose_gemm(rows(4096, 16, N=96, K=40, layout="kn"), H100)
    assert plan.kernel == "persistent" and plan.layout == "kn"
    assert (plan.config.block_m, plan.config.block_n, plan.config.block_k) == (128, 128, 64)
    assert plan.config.tma and plan.config.flatten


@pytest.mark.parametrize(
    ("problem", "dev", "want"),
    [
        (rows(4096, 16, tma=False), H100, "cutlass"),  # no TMA: CUTLASS
        (rows(4096, 16, layout=""), H100, "cutlass"),  # w neither (E,N,K) nor its .mT
        (rows(4096, 16), B200, "cutlass"),  # persistent measured on sm90 only
        (rows(4096, 16), A100, "triton"),  # CUTLASS grouped GEMM needs sm90+
        (rows(4096, 16, dtype=FP16), H100, "triton"),
        (rows(4096, 16, dtype=FP32), H100, "triton"),
        (rows(4096, 16, N=200), H100, "persistent"),  # any N for the persistent kernel
        (rows(1 << 20, 16, N=200), H100, "triton"),  # CUTLASS needs N % 16 == 0
        (rows(1 << 20, 16, K=520), H100, "triton"),  # and K % 16 == 0
        (rows(1 << 20, 16, aligned=False), H100, "triton"),  # strided or misaligned rows
        (rows(4096, 16), INTERP, "triton"),
        (rows(4096, 16), REF, "reference"),
    ],
)
def test_rows_fallbacks(problem, dev, want):
    assert kernel(problem, dev) == want


@pytest.mark.parametrize("dev", [H100, B200, A100, INTERP])
def test_gather_always_the_gathering_triton_kernel(dev):
    assert kernel(GemmProblem("gather", 4096, 256, 512, 16), dev) == "triton"
    assert kernel(GemmProblem("gather", 4096, 256, 512, 16), REF) == "reference"


@pytest.mark.parametrize(
    ("X", "dev", "dtype", "want"),
    [(1024, H100, BF16, "triton"), (1040, H100, BF16, "gather_copy"),
     (4096, H100, BF16, "gather_copy"), (4096, A100, BF16, "triton"),
     (4096, H100, FP32, "triton"), (4104, H100, BF16, "triton"), (4096, INTERP, BF16, "triton")],
)  # fmt: skip
def test_gather_mlp_gathers_in_the_gemm_up_to_x_1024(X, dev, dtype, want):
    assert kernel(GemmProblem("gather_mlp", 4096, X, 512, 16, dtype, gathered=True), dev) == want


@pytest.mark.parametrize(
    ("problem", "want"),
    [
        (wgrad(128 * 32, 32), "triton_wgrad"),  # 128 rows per expert: the persistent kernel
        (wgrad(128 * 32 + 1, 32), "cutlass"),
        (wgrad(128 * 32, 32, gathered=True), "cutlass"),  # row indices: CUTLASS on a gather
        (wgrad(128 * 32, 32, compiling=True), "cutlass"),
        (wgrad(128 * 32, 32, tma=False), "cutlass"),
        (wgrad(1 << 16, 32, N=200), "triton_wgrad"),  # CUTLASS needs 16-aligned N and D
        (wgrad(1 << 16, 32, dtype=FP32), "triton_wgrad"),
        (wgrad(0, 32, tma=False), "triton_wgrad"),  # no rows: the kernel's zeros
        (wgrad(4096, 32, T=0, tma=False), "triton_wgrad"),
        (wgrad(4096, 0), "triton_wgrad"),
    ],
)
def test_wgrad_persistent_up_to_128_rows_per_expert_then_cutlass(problem, want):
    assert kernel(problem, H100) == want


def test_wgrad_configs():
    assert choose_gemm(wgrad(1 << 16, 8), A100).config.block_d == 256  # 16-bit: 128 x 256 x 64
    fp32 = choose_gemm(wgrad(1 << 16, 8, dtype=FP32), A100).config
    assert (fp32.block_n, fp32.block_d, fp32.block_k, fp32.tma) == (128, 128, 32, "none")
    interp = choose_gemm(wgrad(64, 8, N=24, K=40), INTERP).config
    assert (interp.block_n, interp.block_d, interp.num_stages, interp.tma) == (32, 64, 1, "none")


@pytest.mark.parametrize(
    ("dev", "want"),
    [(B200, "scaled_cutlass"), (H100, "dequantized"), (INTERP, "dequantized"),
     (REF, "dequantized"), (GemmDevice("triton", 10, scaled_grouped_mm=False), "dequantized")],
)  # fmt: skip
def test_mxfp8(dev, want):
    assert kernel(GemmProblem("mxfp8", 256, 0, 64, 0), dev) == want


@pytest.mark.parametrize(
    ("N", "out_dtype", "dev", "want"),
    [(64, BF16, H100, "cutlass"), (64, BF16, REF, "masked"), (64, FP32, H100, "masked"),
     (60, BF16, H100, "masked"), (64, BF16, A100, "masked"),
     (64, BF16, GemmDevice("triton", 9, grouped_mm=False), "masked")],
)  # fmt: skip
def test_dequantized(N, out_dtype, dev, want):
    assert kernel(GemmProblem("dequantized", 256, N, 64, 4, BF16, out_dtype), dev) == want


DECODE_DEVICES = [H100, B200, A100, INTERP, GemmDevice("triton", 9, grouped_mm=False)]


@pytest.mark.parametrize("dev", DECODE_DEVICES)
@pytest.mark.parametrize(
    ("P", "E", "want"),
    [(1 * 8, 128, True), (128 * 8, 128, True), (129 * 8, 128, False), (512 * 8, 128, False),
     (1, 4, True), (32, 4, True), (33, 4, False), (64, 8, True), (65, 8, False),
     (1024, 256, True), (1025, 256, False), (0, 16, False), (8, 0, False)],
)  # fmt: skip
def test_gemv_for_the_forward_gemms_up_to_8_rows_per_expert(dev, P, E, want):
    """A decode step's T * top_k rows (Qwen3-30B-A3B: 128 experts, top-8, T = 1..128) run the
    grouped GEMV on every Triton path and dtype, at most 8 per expert on average and 1024 in
    all; a prefill's do not, nor no experts."""
    for dtype in (BF16, FP16, FP32):
        for problem in (
            rows(P, E, N=1536, K=2048, dtype=dtype),
            rows(P, E, N=2048, K=768, dtype=dtype, layout="kn", tma=False, aligned=False),
            GemmProblem("gather", P, 1536, 2048, E, dtype, x_rows=max(P // 8, 1), gathered=True),
            GemmProblem("gather_mlp", P, 1536, 2048, E, dtype, gathered=True),
        ):
            assert (kernel(problem, dev) == "gemv") == want, (problem, dev)


@pytest.mark.parametrize("P", [8, 64])
def test_gemv_never_on_the_reference_nor_for_other_kinds(P):
    assert kernel(rows(P, 16), REF) == "reference"
    assert kernel(GemmProblem("gather_mlp", P, 1536, 2048, 16, gathered=True), REF) == "reference"
    assert kernel(rows(P, 16), H100._replace(gemv=False)) == "persistent"  # the plan without it
    assert kernel(wgrad(P, 16), H100) == "triton_wgrad"  # the weight gradient: its own kernels
    assert kernel(GemmProblem("mxfp8", P, 0, 64, 0), H100) == "dequantized"
    assert kernel(GemmProblem("dequantized", P, 512, 512, 8), H100) == "cutlass"


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        choose_gemm(GemmProblem("rowz", 1, 1, 1, 1), H100)


def test_plans_from_cpu_tensors():
    """The tensor readers on CPU: the reference path (or the interpreter), never a CUDA kernel;
    the rows of a gathering GEMM are its row indices' (P), not x's."""
    dev = gemm_device(torch.device("cpu"))
    assert dev.sm_major == 0 and dev.path in ("reference", "interpreter")
    x, w = torch.zeros(80, 32, dtype=BF16), torch.zeros(4, 48, 32, dtype=BF16)
    rows_80, rows_16 = torch.zeros(80, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    ref = dev.path == "reference"
    want, decode = ("reference", "reference") if ref else ("triton", "gemv")
    assert plan_rows(x, w, None, False) == GemmPlan(want)
    assert plan_rows(x, w.mT.contiguous().mT, rows_80, False) == GemmPlan(want)
    assert plan_rows(x, w, rows_16, True) == GemmPlan(decode)  # 16 rows of 80 tokens
    assert plan_rows(x[:16], w, rows_80, True) == GemmPlan(want)  # 80 rows of 16 tokens
    assert plan_gather_mlp(x, torch.zeros(4, 2048, 32, dtype=BF16), rows_80).kernel == want
    assert plan_gather_mlp(x, torch.zeros(4, 2048, 32, dtype=BF16), rows_16).kernel == decode
    assert plan_wgrad(torch.zeros(64, 48, dtype=BF16), x, 4, False).kernel in (
        "reference",
        "triton_wgrad",
    )


# A Hopper under MOE_KERNELS_BACKEND=portable: what gemm_device reports there (no CUTLASS grouped
# GEMMs), and problems whose operands TMA may not read (has_tma is False).
PORTABLE_H100 = GemmDevice("triton", 9, grouped_mm=False, scaled_grouped_mm=False)
ALL_KINDS = [
    rows(8, 16),  # a decode step: the grouped GEMV
    rows(2048, 16),
    rows(1 << 20, 16),
    wgrad(2048, 16, tma=False),
    wgrad(1 << 20, 16, tma=False),
    GemmProblem("gather_mlp", 8192, 2048, 2048, 16),
    GemmProblem("dequantized", 4096, 512, 512, 8),
    GemmProblem("mxfp8", 64, 0, 32, 0),
]


@pytest.mark.parametrize("problem", ALL_KINDS, ids=lambda p: f"{p.kind}-{p.rows}")
@pytest.mark.parametrize("dev", [PORTABLE_H100, A100], ids=["portable-h100", "a100"])
def test_portable_plans_use_neither_tma_nor_cutlass(problem, dev):
    problem = problem._replace(tma=False)  # has_tma: False on these devices
    plan = choose_gemm(problem, dev)
    assert plan.kernel in ("triton", "triton_wgrad", "gather_copy", "masked", "dequantized",
                           "gemv")  # fmt: skip
    if plan.kernel == "gather_copy":  # then its rows GEMM: the Triton kernel
        assert kernel(rows(problem.rows, problem.experts, tma=False), dev) == "triton"


def test_portable_backend_is_read_at_import():
    """MOE_KERNELS_BACKEND=portable: the plan's device has no CUTLASS grouped GEMMs; an unknown
    value fails at import, naming the variable and the choices."""
    probe = (
        "import torch; from moe_kernels._gemm_plan import gemm_device; "
        "d = gemm_device(torch.device('cpu')); print(d.grouped_mm, d.scaled_grouped_mm)"
    )
    for backend, want in (("portable", "False False"), ("auto", "True True")):
        env = {**os.environ, "MOE_KERNELS_BACKEND": backend}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=env, check=True).stdout  # fmt: skip
        assert out.split()[-2:] == want.split(), (backend, out)
    env = {**os.environ, "MOE_KERNELS_BACKEND": "fast"}
    bad = subprocess.run([sys.executable, "-c", "import moe_kernels"], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert bad.returncode != 0 and "MOE_KERNELS_BACKEND must be one of" in bad.stderr
    assert "portable" in bad.stderr


@pytest.mark.parametrize(
    ("dev", "P", "want"),
    [(H100, 4096, "triton_fp8"), (H100, 1, "triton_fp8"), (INTERP, 64, "triton_fp8"),
     (L40, 64, "triton_fp8"), (A100, 64, "triton_fp8_decoded"), (REF, 64, "reference")],
)  # fmt: skip
def test_fp8_runs_the_triton_fp8_kernel_off_the_reference_path(dev, P, want):
    """e4m3 operands: the FP8 kernel at every size (no GEMV for FP8 yet), its bytes decoded to
    bf16 on a GPU without the e4m3 type (before sm_89), the reference on CPU."""
    assert kernel(GemmProblem("fp8", P, 256, 512, 8, torch.float8_e4m3fn), dev) == want


@pytest.mark.parametrize(
    ("rows", "n", "d", "gathered", "block", "want"),
    [  # (block_m, block_n, num_stages, fast_accum, persistent), from the H100 sweep's winners
        (16384, 1024, 2048, False, False, (128, 256, 4, True, False)),  # seed up: 512 tiles
        (65536, 1536, 2048, False, False, (128, 256, 3, True, True)),  # Qwen3 up: 3072 tiles
        (65536, 2048, 768, False, False, (128, 256, 3, True, True)),  # Qwen3 down: 4096 tiles
        (262144, 2048, 4096, False, False, (128, 256, 4, True, False)),  # SonicMoE up: K 4096
        (65536, 128, 2048, False, False, (128, 128, 3, True, False)),  # narrow n
        (65536, 1536, 2048, True, False, (64, 128, 3, True, False)),  # gathered rows
        (65536, 1536, 2048, False, True, (128, 128, 3, False, False)),  # block scales
        (65536, 1536, 2048, True, True, (64, 128, 3, False, False)),
    ],
)
def test_fp8_config(rows, n, d, gathered, block, want):
    """FP8 tiles: fast accumulation with per-channel scales (never with block scales: each K
    step is promoted with its scale), the persistent kernel on sorted rows from 2048 tiles of
    128 x 256 at K <= 2048."""
    from moe_kernels._gemm_plan import fp8_config

    cfg = fp8_config(rows, n, d, block, gathered, interpret=False)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.fast_accum, cfg.persistent) == want
    assert cfg.block_k == 128
