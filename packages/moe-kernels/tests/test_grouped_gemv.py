"""The grouped GEMV (``_triton/grouped_gemv.py``): a decode step's expert GEMMs.

Against the float64 oracle (``oracle_gather_grouped_mm``, one rounding to the output dtype plus
fp32 accumulation error; two bf16 ulps under the interpreter, which truncates) for T in {1, 2, 3,
8} tokens, top-k in {1, 2, 8}, E in {4, 16}, through the public ops on the plan's path
(``gather_grouped_mm``, ``expert_mlp`` without gradients) and through the launcher: skewed routing
(every row on one expert, more rows than a chunk and than the plan's bound), empty experts,
gathered and sorted rows, rows reading no token, the tail, SiLU and SwiGLU, fp32 / bf16 / fp16,
strided operands; bitwise repeatability and batch invariance (a token's bits the same alone or
among others, wherever its row lands). The kernel runs in the interpreter (``TRITON_INTERPRET=1``;
skipped on the reference path); the plan's rule runs everywhere; the GPU config's sm_90a / sm_89
compile runs without the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_kernels as mk
from moe_kernels._dispatch import INTERPRET, triton_kernels, use_triton
from moe_kernels._gemm_plan import (
    GEMV_MAX_ROWS,
    GEMV_MAX_ROWS_PER_EXPERT,
    GemmDevice,
    GemmProblem,
    choose_gemm,
    plan_gather_mlp,
    plan_rows,
)
from moe_kernels.testing import (
    ULP,
    bound_violations,
    oracle_expert_mlp_rows,
    oracle_gather_grouped_mm,
)

CPU = torch.device("cpu")
kernels = pytest.mark.skipif(not use_triton(CPU), reason="the kernel runs in the interpreter")
D, N = 48, 32  # two K steps of the interpreter's 32 (the second partial); N: one or two n-tiles


def rand(shape, dtype, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) + 0.25) * scale).to(dtype)


def offsets_of(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def gemv(x, w, offsets, rows, act="none", config=None):
    return triton_kernels("grouped_gemv").grouped_gemv(x, w, offsets, rows, act, config)


def oracle(x, w, offsets, rows, act):
    """(P, N_out) float64: act(x[rows] @ w[e].T), SwiGLU on the gate / up halves."""
    if act != "swiglu":
        return oracle_gather_grouped_mm(x, w, offsets, rows, None if act == "none" else act)
    g, u = oracle_gather_grouped_mm(x, w, offsets, rows, None).chunk(2, dim=1)
    return F.silu(g) * u


def assert_close(y, exact, dim=D):
    """Within one rounding to y's dtype (two ulps: the interpreter truncates) plus the fp32
    accumulation error of a dim-long dot (SwiGLU: of two); exact zeros stay zero."""
    tol = 2 * ULP[y.dtype] * exact.abs() + 2 * dim * 2.0**-22 + 1e-6
    err = (y.double() - exact).abs()
    assert bool((err <= tol).all()), f"max err {float(err.max())} at {int(err.argmax())}"
    assert bool((y.double()[exact == 0] == 0).all())


def layer(T, k, E, dtype, gated=False, seed=0):
    scores = torch.rand(T, E, generator=torch.Generator().manual_seed(seed))
    plan = mk.route(scores, k)
    x = rand((T, D), dtype, seed + 1)
    w_in = rand((E, 2 * N if gated else N, D), dtype, seed + 2)
    w_out = rand((E, D, N), dtype, seed + 3)
    return plan, x, w_in, w_out


# --------------------------------------------------------------------------------------------
# the plan


def test_plan_picks_the_gemv_at_decode_sizes_only():
    """Qwen3-30B-A3B's experts (128, top-8, d 2048, gate + up 1536) on an H100: T = 1..128
    tokens (8..1024 rows, 8 per expert) run the GEMV, T = 129 and a prefill do not; never on
    the reference path."""
    h100, ref = GemmDevice("triton", 9), GemmDevice("reference")
    assert (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT) == (1024, 8)
    for T, want in ((1, "gemv"), (128, "gemv"), (129, "gather_copy"), (512, "gather_copy")):
        p = GemmProblem("gather_mlp", T * 8, 1536, 2048, 128, gathered=True)
        assert choose_gemm(p, h100).kernel == want
        assert choose_gemm(p, ref).kernel == "reference"
        down = GemmProblem("rows", T * 8, 2048, 768, 128, layout="nk", tma=True, aligned=True)
        assert (choose_gemm(down, h100).kernel == "gemv") == (want == "gemv")


@kernels
def test_plan_from_tensors_in_the_interpreter():
    plan, x, w_in, w_out = layer(8, 8, 16, torch.float32)
    assert plan_gather_mlp(x, w_in, plan.token_indices).kernel == "gemv"  # 64 rows, 16 experts
    assert plan_rows(x.new_empty(128, N), w_out, None, False).kernel == "gemv"  # 8 per expert
    plan17, x17, _, _ = layer(17, 8, 16, torch.float32)
    assert plan_gather_mlp(x17, w_in, plan17.token_indices).kernel == "triton"  # 136 rows


# --------------------------------------------------------------------------------------------
# against the oracle, through the public ops on the plan's path

LAYERS = [(T, k, E) for T in (1, 2, 3, 8) for k in (1, 2, 8) for E in (4, 16) if k <= E]


@kernels
@pytest.mark.parametrize(("T", "k", "E"), LAYERS)
def test_public_ops_at_decode_sizes(T, k, E):
    """gather_grouped_mm (gathered + SiLU, then sorted, fp32) and expert_mlp without gradients
    (SwiGLU, bf16) on a routing plan's rows: the GEMV on both GEMMs."""
    plan, x, w_in, w_out = layer(T, k, E, torch.float32, seed=T * 100 + k * 10 + E)
    rows = plan.token_indices
    assert plan_rows(x, w_in, rows, True).kernel == "gemv"
    h = mk.gather_grouped_mm(x, w_in, plan.offsets, rows, activation="silu")
    assert_close(h, oracle(x, w_in, plan.offsets, rows, "silu"))
    y = mk.gather_grouped_mm(h, w_out, plan.offsets)
    assert_close(y, oracle(h, w_out, plan.offsets, None, "none"), N)

    plan, x, w_in, w_out = layer(T, k, E, torch.bfloat16, gated=True, seed=T + k + E)
    with torch.no_grad():
        y = mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                          gated=True)  # fmt: skip
    exact, bound = oracle_expert_mlp_rows(x, w_in, w_out, plan.offsets, plan.token_indices, True)
    assert bound_violations(y, exact, bound).bad == 0


# --------------------------------------------------------------------------------------------
# the launcher: routings the plans above do not reach

SKEWED = {  # name: (T, counts over E = 4 experts, P)
    "one_expert_many_chunks": (5, [0, 0, 40, 0], 40),  # 3 chunks of 16 on expert 2
    "past_the_plans_bound": (9, [1, 0, 0, 99], 100),  # 100 rows: correct past the plan's bound
    "empty_experts_and_tail": (6, [0, 3, 0, 2], 9),  # 4 tail rows
    "all_tail": (3, [0, 0, 0, 0], 5),
}


@kernels
@pytest.mark.parametrize("act", ["none", "silu", "swiglu"])
@pytest.mark.parametrize("case", list(SKEWED))
def test_skewed_routing_gathered_rows(case, act):
    T, counts, P = SKEWED[case]
    x = rand((T, D), torch.float32, 1)
    w = rand((4, 2 * N if act == "swiglu" else N, D), torch.float32, 2)
    offsets = offsets_of(counts)
    rows = torch.randint(0, T, (P,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    rows[int(offsets[-1]) :] = -1
    if P > 4:
        rows[1], rows[3] = -1, T  # rows reading no token: zero
    y = gemv(x, w, offsets, rows, act)
    assert y.shape == (P, N) and bool((y[int(offsets[-1]) :] == 0).all())
    assert_close(y, oracle(x, w, offsets, rows, act))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sorted_rows_strided_operands_and_tail(dtype):
    """Sorted rows (row_indices None, P = T) of a column slice of x, w as the .mT view of an
    (E, D, N) weight (the "kn" layout), int64 offsets, two n-tiles; the tail zeroed."""
    x = rand((20, D + 16), dtype, 4)[:, 8 : 8 + D]
    w = rand((3, D, 2 * N), dtype, 5).mT
    offsets = offsets_of([7, 0, 9]).long()
    for block_m in (16, 32):  # the config's chunk of rows
        cfg = triton_kernels("grouped_gemv").GemvConfig(32, 16, 4, 1, block_m)
        y = gemv(x, w, offsets, None, "silu", config=cfg)
        assert bool((y[16:] == 0).all())
        assert_close(y, oracle(x, w, offsets, None, "silu"))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeatable_and_batch_invariant(dtype):
    """A token's outputs hold the same bits alone (T = 1), among 7 others, and as the 1st or
    the 38th row of a 40-row group (its third chunk); two calls give the same bits."""
    E, k, T = 16, 8, 8
    _, x, w_in, w_out = layer(T, k, E, dtype, gated=True, seed=11)
    scores = torch.rand(T, E, generator=torch.Generator().manual_seed(12))

    def run(xs, sc):
        plan = mk.route(sc, k)
        with torch.no_grad():
            y = mk.expert_mlp(xs, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                              gated=True)  # fmt: skip
        return y, plan.inverse

    y, inverse = run(x, scores)
    assert torch.equal(y, run(x, scores)[0])
    for t in (0, 5):
        y1, inv1 = run(x[t : t + 1], scores[t : t + 1])
        assert torch.equal(y1[inv1[0].long()], y[inverse[t].long()]), t

    offsets = offsets_of([0, 40])  # 40 rows on expert 1: token 3 as row 0, then as row 37
    w = w_in[:2]
    first = torch.full((40,), 1, dtype=torch.int32)
    first[0] = 3
    last = torch.full((40,), 1, dtype=torch.int32)
    last[37] = 3
    a, b = gemv(x, w, offsets, first, "swiglu"), gemv(x, w, offsets, last, "swiglu")
    assert torch.equal(a[0], b[37])
    if dtype == torch.float32:  # the interpreter's tl.dot is numpy's matmul: with OpenBLAS
        # 0.3.31 an fp32 row's sum may differ in its last bit with the row's place in the block
        # (rows 5, 11 and 15 of 16 here: a last-bit change of the gate or up sum, carried
        # through SwiGLU); the device keeps the bits (test_grouped_gemv_gpu.py)
        tol = 4 * ULP[torch.float32] * float(b.abs().max())
        assert float((a[1:37] - b[:36]).abs().max()) <= tol
    else:
        assert torch.equal(a[1:37], b[:36])


# --------------------------------------------------------------------------------------------
# the GPU config, compiled without a GPU


@pytest.mark.skipif(INTERPRET, reason="GPU launch configs only without the interpreter")
@pytest.mark.parametrize(("arch", "act", "k"), [(90, 2, 2048), (90, 0, 768), (89, 1, 2048)])
def test_default_config_compiles_to_pipelined_mma(arch, act, k):
    """The GPU config (Qwen3's up- and down-projection) compiles for sm_90a and sm_89: MMAs from
    ``tl.dot``, the K loop's loads pipelined through cp.async, no TMA, within 99 KiB of shared
    memory (consumer GPUs too). Pointers and sizes 16-aligned, as Triton specialises Qwen3's."""
    pytest.importorskip("triton")
    from moe_kernels.testing import sm90_compiler_missing

    if sm90_compiler_missing():
        pytest.skip(sm90_compiler_missing())
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gv = triton_kernels("grouped_gemv")
    cfg = gv.default_config(k)
    bn = cfg.block_n // 2 if act == 2 else cfg.block_n
    ints = ("T", "P", "N", "K", "E", "stride_xt", "stride_we", "stride_wn", "up_offset")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "offs_ptr": "*i32", "ridx_ptr": "*i32",
           "y_ptr": "*bf16", **dict.fromkeys(ints, "i32")}  # fmt: skip
    consts = dict(stride_xk=1, stride_wk=1, HAS_RIDX=True, ACTIVATION=act,
                  BM=cfg.block_m, BN=bn, BK=cfg.block_k, NUM_K=k // cfg.block_k, EVEN_K=True,
                  BLOCK_E=256, UPCAST=False, IEEE=False)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    kern = gv._grouped_gemv_kernel
    aligned = ("x_ptr", "w_ptr", "y_ptr", "N", "K", "stride_xt", "stride_we", "stride_wn",
               "up_offset")  # fmt: skip
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = compiled.asm["ptx"]
    assert "mma.sync" in ptx and "cp.async" in ptx and "cp.async.bulk.tensor" not in ptx
    assert compiled.metadata.shared <= 99 * 1024


@kernels
def test_opcheck_and_compile_match_eager():
    """The op's schema and fake (SwiGLU halves the columns), and expert_mlp's no-grad forward
    under ``torch.compile(fullgraph=True)`` equal to eager, bit for bit."""
    plan, x, w_in, w_out = layer(3, 2, 4, torch.bfloat16, gated=True, seed=21)
    op = torch.ops.moe_kernels.grouped_gemv.default
    for args in ((x, w_in, plan.offsets, plan.token_indices, "swiglu"),
                 (x, w_in, plan.offsets, None, "none")):  # fmt: skip
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    def fwd(x, w_in, w_out, plan):
        return mk.expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse,
                             gated=True)  # fmt: skip

    with torch.no_grad():
        eager = fwd(x, w_in, w_out, plan)
        assert torch.equal(torch.compile(fwd, fullgraph=True)(x, w_in, w_out, plan), eager)
