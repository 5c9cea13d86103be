"""The GPU launch plans of the routing, router and scatter-add kernels compile for sm_90a
(Hopper), on a machine without a GPU.

The interpreter runs the kernels' semantics but not Triton's GPU compiler, whose passes can reject
a kernel for one specialisation only (triton 3.6-3.8's ``TritonGPUOptimizeThreadLocality`` failed
on C's counting placement with a (tokens, 1) count tensor, an expert range of <= 4 experts; found
on an H200). So every launch plan the GPU launchers pick for a spread of shapes is compiled to a
cubin (Triton's bundled ptxas): here the launches only eager calls make (the cooperative one) and
the forced variants, in ``test_inductor_graph.py`` the separate launches of every plan of
``ROUTING_PLANS`` and ``SELECTION_PLANS`` (moe_kernels.testing) as Inductor writes them.
Skipped under ``TRITON_INTERPRET=1`` (the launchers pick interpreter plans there) and where
Triton cannot compile for CUDA at all.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # compiles with Triton: nothing to test without it

from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import ROUTING_PLANS, SELECTION_PLANS, written_arguments

pytestmark = pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without the interpreter")


def _compile(kern, sig: dict, consts: dict, num_warps: int, num_stages: int = 3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs={})
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


@pytest.fixture(scope="module")
def can_compile():
    from moe_kernels.testing import sm90_compiler_missing

    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)


# ROUTING_PLANS, SELECTION_PLANS (moe_kernels.testing): (T, E, top_k, start, end, scores dtype
# kind: 0 fp32 / 1 bf16 / 2 fp16, renormalize[, bias, n_groups, topk_groups, scaled])


@pytest.mark.parametrize("plan", ROUTING_PLANS, ids=str)
@pytest.mark.parametrize("route", [False, True], ids=["index_shuffling", "route"])
def test_routing_plans_cooperative_launch_compiles(can_compile, plan, route):
    """The launch eager calls make of A and C joined by a grid barrier, where the plan has it.
    Every plan's separate launches (what compiled calls make) are compiled as Inductor writes
    them: ``test_inductor_graph.py``."""
    _compile_plan(plan, route, None, separate=False)


def test_grid_sync_compiles_to_gpu_scoped_atomics_around_cta_barriers(can_compile):
    """The barrier's PTX: its atomics at GPU scope with acquire/release semantics, done by one
    thread (the scalar atomics' broadcast), CTA barriers on both sides."""
    import triton
    import triton.language as tl

    from moe_kernels._triton.grid_sync import grid_sync

    @triton.jit
    def _probe(x_ptr, bar_ptr, n_programs):
        tl.store(x_ptr + tl.program_id(0), 1)
        grid_sync(bar_ptr, n_programs)
        tl.store(x_ptr + n_programs + tl.program_id(0), tl.load(x_ptr + n_programs - 1))

    k = _compile(_probe, {"x_ptr": "*i32", "bar_ptr": "*i32", "n_programs": "i32"}, {}, 4, 1)
    ptx = k.asm["ptx"]
    # the barrier words' accesses (an atomic add of 0 may compile to an atomic load)
    ops = [line.strip() for line in ptx.splitlines() if ".global.gpu." in line]
    assert any(".gpu.acq_rel.add" in op for op in ops), ops  # arrive
    assert any(".gpu.release.exch" in op for op in ops), ops  # the next generation
    assert any(".gpu.acquire" in op for op in ops), ops  # the spin
    assert all(op.startswith("@") for op in ops), ops  # predicated: one thread
    assert ptx.count("bar.sync") >= 2


def test_columns_plan_with_c_writing_the_pairs_compiles(can_compile):
    """The columns plan at a size whose default has D: with the scan in C, C writes the pairs."""
    from moe_kernels._triton.routing.plan import Constraints

    p = _compile_plan((1 << 20, 128, 8, 0, 128, 1, False), True, Constraints(scan_in_c=True))
    assert p.placement == "columns" and not p.expert_runs


@pytest.mark.parametrize("plan", SELECTION_PLANS, ids=str)
def test_selection_plans_take_kernel_a_grouped(plan):
    """(Their launches compile in ``test_inductor_graph.py``.)"""
    assert _plan_of(plan, True, None)[1].topk.startswith("grouped")


def test_selection_tile_plan_compiles(can_compile):
    """The rounds-over-a-tile variant, where Constraints.block_t asks for it."""
    from moe_kernels._triton.routing.plan import Constraints

    plan = (65536, 256, 8, 0, 256, 1, True, True, 8, 4, True)
    assert _compile_plan(plan, True, Constraints(block_t=4, sub=8)).topk == "grouped"


def _plan_of(args, route, constraints):
    import torch

    from moe_kernels._triton.routing import plan as P

    T, E, k, start, end, kind, renorm, *sel = args
    dtype = (torch.float32, torch.bfloat16, torch.float16)[kind]
    # words: the scores' rows as 4-byte aligned pairs (contiguous 16-bit scores)
    prob = P.Problem(T, E, k, start, end, dtype, route, renorm and route, True, kind != 0, *sel)
    return prob, P.choose_plan(prob, P.Device(sm_count=132), constraints)  # an H200's SMs


def _compile_plan(args, route, constraints, separate=True):
    """Compile the plan's launches: A, B, C and D (``separate``), and the cooperative one."""
    from moe_kernels._triton.routing import launch as L

    kind = args[5]
    prob, plan = _plan_of(args, route, constraints)
    p = L.launches(prob, plan)
    x_t = "*fp32" if kind == 0 else "*i16"
    ints = dict.fromkeys(["T", "E", "start", "end", "n_programs"], "i32")
    a_sig = dict(x_ptr=x_t, stride_t="i32", stride_e="i32", stride_w="i32", vtc_ptr="*i32",
                 pack_ptr="*i32", scr_w_ptr="*fp32", hist_ptr="*i32", **ints)  # fmt: skip
    kern_a = L.topk_columns_kernel if plan.placement == "columns" else L.topk_rows_kernel
    if plan.topk.startswith("grouped"):
        kern_a, a_sig = L.topk_grouped_kernel, dict(a_sig, bias_ptr="*fp32", scale="fp32")
    if separate:
        _compile_separate(L, plan, p, kern_a, a_sig)
    if plan.cooperative:  # eager calls launch A and C as one kernel
        f_sig = dict(a_sig, a_w_ptr=a_sig["scr_w_ptr"], scr_w_ptr="*fp32", inverse_ptr="*i32",
                     counts_ptr="*i32", expert_ptr="*i32", token_ptr="*i32",
                     weight_ptr="*fp32", offsets_ptr="*i32", tcpe_ptr="*i32", L="i32",
                     bar_ptr="*i32")  # fmt: skip
        f_sig = {name: f_sig[name] for name in L.fused_kernel.arg_names if name in f_sig}
        consts, _ = L._fused_launch(p)
        _compile(L.fused_kernel, f_sig, consts, p.a_warps)
    return plan


def _compile_separate(L, plan, p, kern_a, a_sig):
    _compile(kern_a, a_sig, dict(p.a), p.a_warps)
    if p.scan is not None:
        _, consts, warps = p.scan
        sig = dict(hist_ptr="*i32", counts_ptr="*i32", L="i32", n_programs="i32")
        _compile(L.scan_kernel, sig, dict(consts), warps)
    c_sig = dict(pack_ptr="*i32", scr_w_ptr="*fp32", inverse_ptr="*i32", hist_ptr="*i32",
                 counts_ptr="*i32", expert_ptr="*i32", token_ptr="*i32", weight_ptr="*fp32",
                 offsets_ptr="*i32", tcpe_ptr="*i32", T="i32", E="i32", L="i32", start="i32",
                 n_programs="i32")  # fmt: skip
    _compile(L.place_kernel, c_sig, dict(p.c), p.c_warps)
    if p.runs is not None:
        _, consts, warps = p.runs
        sig = dict(pack_ptr="*i32", hist_ptr="*i32", counts_ptr="*i32", expert_ptr="*i32",
                   token_ptr="*i32", weight_ptr="*fp32", L="i32", start="i32",
                   n_programs="i32")  # fmt: skip
        _compile(L.expert_runs_kernel, sig, dict(consts), warps)


@pytest.mark.parametrize("num_tokens", [512, 2048, 16384])
@pytest.mark.parametrize("num_experts", [16, 128, 1000])
def test_router_default_configs_compile(can_compile, num_tokens, num_experts):
    from moe_kernels._triton import router as tri

    cfg = tri.pick_config(num_tokens, 2048, num_experts)
    sig = dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32")
    sig.update(dict.fromkeys(["T", "D", "E", "stride_xt", "stride_xd", "stride_we", "stride_wd"],
                             "i32"))  # fmt: skip
    consts = dict(SIGMOID=False, BLOCK_T=cfg.block_t, BLOCK_E=tri.block_e(num_experts),
                  BLOCK_D=cfg.block_d, EVEN_D=True, USE_DOT=cfg.dot, ACC3=cfg.acc3,
                  PREFETCH=cfg.prefetch, WHILE_LOOPS=False)  # fmt: skip
    _compile(tri._router_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize(
    ("out", "inp"), [("fp32", "bf16"), ("bf16", "bf16"), ("i32", "i32"), ("i64", "i32")]
)
def test_scatter_add_compiles_for_float_and_integer_tokens(can_compile, out, inp):
    """The integer scatter-add (INT_ADD) type-checks in Triton's compiler, which checks both
    branches of a constexpr test (the interpreter runs only the one taken)."""
    from moe_kernels._triton import tokens as tri

    sig = dict(out_ptr=f"*{out}", in_ptr=f"*{inp}", src_ptr="*i64", bounds_ptr="*i64")
    sig.update(dict.fromkeys(["T", "D", "stride_ot", "stride_od", "stride_in", "stride_id"],
                             "i32"))  # fmt: skip
    consts = dict(BLOCK_N=1, BLOCK_D=1024, WHILE_LOOPS=False, INT_ADD=out.startswith("i"))
    _compile(tri._scatter_add_kernel, sig, consts, 4)


def _rope_specialisation(dtype: str, head_dim: int, num_slots: int):
    """The signature and constexprs of ``qk_norm_rope``'s kernel at the seed shape (N=512,
    contiguous heads: Triton specialises the unit column strides), scales in bf16 (the engine
    casts them), fp32 angles."""
    from moe_kernels._triton import rope as tri
    from moe_kernels._triton.blocks import next_pow2

    cfg = tri.pick_config(512, head_dim)
    sig = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", qw_ptr="*bf16",
               kw_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", slots_ptr="*i64",
               q_out_ptr=f"*{dtype}", k_cache_ptr=f"*{dtype}", v_cache_ptr=f"*{dtype}")  # fmt: skip
    sig.update(dict.fromkeys(["N", "HQ", "KV", "S", "layer"], "i32"))
    sig.update(dict.fromkeys(["stride_qn", "stride_kn", "stride_vn", "stride_cn", "stride_sn"],
                             "i32"))  # fmt: skip
    consts = dict(stride_qc=1, stride_kc=1, stride_vc=1, stride_cp=1, stride_sp=1,
                  HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, BLOCK_D=next_pow2(head_dim),
                  NUM_SLOTS=num_slots, EXACT_MUL=True, EPS=1e-6)  # fmt: skip
    return tri, cfg, sig, consts


@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_slots"),
    [
        ("bf16", 64, 1),
        ("bf16", 64, 2),
        ("fp16", 64, 2),
        ("fp32", 64, 2),
        ("bf16", 128, 1),
        ("bf16", 48, 2),
    ],  # fmt: skip
)
def test_rope_kernel_compiles_without_contracted_products(can_compile, dtype, head_dim, num_slots):
    """QK-norm + RoPE + KV write: its products stay ``mul.rn.f32`` (no FMA contraction)."""
    tri, cfg, sig, consts = _rope_specialisation(dtype, head_dim, num_slots)
    k = _compile(tri._qk_norm_rope_kernel, sig, consts, cfg.num_warps)
    ptx = k.asm["ptx"]
    assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx


def test_rope_kernel_mutation_analysis_sees_only_its_outputs(monkeypatch):
    """Inductor's TTIR analysis (what decides which kernel arguments a compiled graph copies
    before the launch) counts q_out and the two caches as written, nothing else. Run on this
    CPU machine with a stand-in driver that names an sm_90 target."""
    import torch

    tri, _, _, consts = _rope_specialisation("bf16", 64, 2)
    N, H, K, D, L, S = 512, 32, 16, 64, 2, 17
    bf = torch.bfloat16
    qkv = torch.empty(N, (H + 2 * K) * D, dtype=bf)
    q, k, v = qkv[:, : H * D], qkv[:, H * D : (H + K) * D], qkv[:, (H + K) * D :]
    cos = torch.empty(N, D // 2)
    kc = torch.empty(L, K, S, N, D, dtype=bf)
    tensors = [q, k, v, torch.empty(D, dtype=bf), torch.empty(D, dtype=bf), cos, cos.clone(),
               torch.zeros(2, dtype=torch.int64), torch.empty(H, N, D, dtype=bf), kc,
               torch.empty_like(kc)]  # fmt: skip
    ints = [N, H, K, S, 1, q.stride(0), 1, k.stride(0), 1, v.stride(0), 1, D // 2, 1,
            D // 2, 1]  # fmt: skip
    kern = tri._qk_norm_rope_kernel
    written = written_arguments(kern, [*tensors, *ints], consts, monkeypatch)
    assert written == ["k_cache_ptr", "q_out_ptr", "v_cache_ptr"]


@pytest.mark.parametrize("layout", ["nk", "kn", "fp8"])
def test_persistent_grouped_mm_default_config_compiles_to_wgmma_and_tma(can_compile, layout):
    """The persistent grouped GEMM's GPU config (128 x 256 x 64, flattened, A and B through TMA
    descriptors; its scaled e4m3 form 128 x 256 x 128) compiles for sm_90a to wgmma and bulk
    tensor copies, within the shared memory of one multiprocessor (227 KiB)."""
    from moe_kernels._gemm_plan import persistent_config
    from moe_kernels._triton.persistent_grouped_mm import _persistent_grouped_mm_kernel as kern

    fp8 = layout == "fp8"
    cfg = persistent_config(65536, 2048, 1536, 128, interpret=False)
    if fp8:
        cfg = cfg._replace(block_k=128)
    t = "fp8e4nv" if fp8 else "bf16"
    b_block = [cfg.block_k, cfg.block_n] if layout == "kn" else [cfg.block_n, cfg.block_k]
    sig = {
        "a_ptr": f"*{t}", "b_ptr": f"*{t}", "offs_ptr": "*i32", "c_ptr": "*bf16",
        "as_ptr": "*fp32", "bs_ptr": "*fp32",
        "a_desc": f"tensordesc<{t}[{cfg.block_m}, {cfg.block_k}]>",
        "b_desc": f"tensordesc<{t}{b_block}>",  # e.g. tensordesc<bf16[256, 64]>
        **dict.fromkeys(("P", "N", "K", "E", "NUM_PROGS", "stride_am", "stride_be",
                         "stride_bn", "stride_bk"), "i32"),
    }  # fmt: skip
    consts = dict(B_KN=layout == "kn", BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                  BLOCK_E=128, EVEN_K=True, A_TMA=True, B_TMA=True, UPCAST=False, IEEE=False,
                  WHILE_LOOPS=False, FLATTEN=cfg.flatten, SCALED=fp8)  # fmt: skip
    k = _compile(kern, sig, consts, cfg.num_warps, cfg.num_stages)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("tma", ["none", "x", "both"])
def test_weight_grad_default_config_compiles_to_pipelined_wgmma(can_compile, tma):
    """The weight-gradient kernel's GPU config (128 x 256 x 64, 8 warps, 3 stages) compiles for
    sm_90a to wgmma, its loads software-pipelined across the hand-flattened tile loop (bulk
    tensor copies of the ragged descriptors, or cp.async, into 3 buffers of each operand), within
    one multiprocessor's shared memory (227 KiB)."""
    from moe_kernels._gemm_plan import WgradConfig, wgrad_config
    from moe_kernels._triton.grouped_weight_grad import _grouped_weight_grad_kernel as kern

    cfg = wgrad_config(1536, 2048, interpret=False)._replace(tma=tma)
    assert cfg == WgradConfig(tma=tma)
    dy_tma, x_tma = tma == "both", tma != "none"
    sig = {
        "dy_ptr": "*bf16", "x_ptr": "*bf16", "offs_ptr": "*i32", "ridx_ptr": "*i32",
        "out_ptr": "*bf16",
        # ragged descriptors: two leading unit dimensions (triton.tools.ragged_tma)
        "dy_desc": f"tensordesc<bf16[1, 1, {cfg.block_k}, {cfg.block_n}]>" if dy_tma else "cst",
        "x_desc": f"tensordesc<bf16[1, 1, {cfg.block_k}, {cfg.block_d}]>" if x_tma else "cst",
        **dict.fromkeys(("T", "P", "N", "D", "E", "NUM_PROGS", "stride_dyp", "stride_xt"), "i32"),
    }  # fmt: skip
    consts = dict(stride_dyn=1, stride_xd=1, HAS_RIDX=False, BN=cfg.block_n, BD=cfg.block_d,
                  BK=cfg.block_k, BLOCK_E=128, TMA_DY=dy_tma, TMA_X=x_tma, UPCAST=False,
                  IEEE=False, WHILE_LOOPS=False)  # fmt: skip
    consts.update({name: None for name, t in sig.items() if t == "cst"})
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {
        (kern.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in ("dy_ptr", "x_ptr", "out_ptr", "N", "D", "stride_dyp", "stride_xt")
    }
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == x_tma and ("cp.async.cg" in ptx) == (tma != "both")
    stage = cfg.block_k * (cfg.block_n + cfg.block_d) * 2
    assert 3 * stage <= k.metadata.shared <= 227 * 1024


# The portable plan (GPUs without TMA or CUTLASS grouped GEMMs: RTX 4090 sm_89, RTX 5090 sm_120,
# ~99 KiB of shared memory per block; MOE_KERNELS_BACKEND=portable forces it on a Hopper).
CONSUMER_SMEM = 99 * 1024


def _compile_for(kern, sig, consts, attrs, cfg, arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


@pytest.mark.parametrize("arch", [89, 120])
@pytest.mark.parametrize("n,d", [(2048, 2048), (1024, 2048), (2048, 1024), (96, 48)])
def test_gather_grouped_mm_portable_config_fits_consumer_gpus(can_compile, arch, n, d):
    """The gathering grouped GEMM's launch config for a GPU of ~99 KiB of shared memory and no
    TMA (``pick_config``'s stage rule) compiles for sm_89 and sm_120 with pointer loads and MMAs
    from ``tl.dot``, within that shared memory."""
    from moe_kernels._triton.grouped_mm import _gather_grouped_mm_kernel as kern
    from moe_kernels._triton.grouped_mm import pick_config

    cfg = pick_config(8192, n, d, 16, 2, smem=CONSUMER_SMEM, hopper=False)
    assert not cfg.tma
    sig = {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "offs_ptr": "*i32", "ridx_ptr": "*i32",
        "y_ptr": "*bf16", "a_desc": "cst", "b_desc": "cst",
        **dict.fromkeys(("T", "P", "N", "D", "E", "stride_xt", "stride_we", "stride_wn"), "i32"),
    }  # fmt: skip
    consts = dict(a_desc=None, b_desc=None, stride_xd=1, stride_wd=1, HAS_RIDX=True,
                  ACTIVATION="silu", BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                  GROUP_M=cfg.group_m, BLOCK_E=16, EVEN_K=d % cfg.block_k == 0, A_TMA=False,
                  B_TMA=False, UPCAST=False, IEEE=False, WHILE_LOOPS=False)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    k = _compile_for(kern, sig, consts, {}, cfg, arch)
    ptx = k.asm["ptx"]
    assert "mma.sync" in ptx and "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    assert k.metadata.shared <= CONSUMER_SMEM


@pytest.mark.parametrize("arch", [89, 120])
def test_weight_grad_portable_config_fits_consumer_gpus(can_compile, arch):
    """The weight-gradient kernel's GPU config with pointer loads (what a GPU without TMA gets:
    ``tma_ok`` is False there) compiles for sm_89 and sm_120 within ~99 KiB of shared memory."""
    from moe_kernels._gemm_plan import wgrad_config
    from moe_kernels._triton.grouped_weight_grad import _grouped_weight_grad_kernel as kern

    cfg = wgrad_config(1536, 2048, interpret=False)
    sig = {
        "dy_ptr": "*bf16", "x_ptr": "*bf16", "offs_ptr": "*i32", "ridx_ptr": "*i32",
        "out_ptr": "*bf16", "dy_desc": "cst", "x_desc": "cst",
        **dict.fromkeys(("T", "P", "N", "D", "E", "NUM_PROGS", "stride_dyp", "stride_xt"), "i32"),
    }  # fmt: skip
    consts = dict(dy_desc=None, x_desc=None, stride_dyn=1, stride_xd=1, HAS_RIDX=False,
                  BN=cfg.block_n, BD=cfg.block_d, BK=cfg.block_k, BLOCK_E=128, TMA_DY=False,
                  TMA_X=False, UPCAST=False, IEEE=False, WHILE_LOOPS=False)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {
        (kern.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in ("dy_ptr", "x_ptr", "out_ptr", "N", "D", "stride_dyp", "stride_xt")
    }
    k = _compile_for(kern, sig, consts, attrs, cfg, arch)
    ptx = k.asm["ptx"]
    assert "mma.sync" in ptx and "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    assert k.metadata.shared <= CONSUMER_SMEM


@pytest.mark.parametrize("block, idx", [(16, "*i32"), (4096, "*i64")])
def test_plan_from_choices_kernel_compiles(can_compile, block, idx):
    """The one-program plan of given choices (a sort, a histogram, a prefix sum) at its smallest
    and largest block."""
    from moe_kernels._triton import choices_plan as cp

    sig = dict(idx_ptr=idx, w_ptr="*bf16", counts_ptr="*i32", offsets_ptr="*i32",
               expert_ptr="*i32", token_ptr="*i32", weight_ptr="*fp32", inverse_ptr="*i32",
               order_ptr="*i32", P="i32", lo="i32", L="i32")  # fmt: skip
    _compile(cp._plan_kernel, sig, dict(K=8, BLOCK=block, L_PAD=256), 4 if block <= 1024 else 8)


@pytest.mark.parametrize("cap", [80, 86])
def test_fp8_grouped_mm_decoded_kernel_compiles_before_sm89(can_compile, cap):
    """On GPUs without the e4m3 type (A100 sm_80, RTX 30xx sm_86) the GEMM plan's
    "triton_fp8_decoded" launch compiles: the operands' bytes decoded to bf16 for mma.sync (the
    e4m3 kernel itself does not: "type fp8e4nv not supported in this architecture")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_kernels._triton import fp8_grouped_mm as fm

    cfg = fm.fp8_config(4096, 1024, 2048, False, True)
    sig = dict(x_ptr="*u8", xs_ptr="*fp32", w_ptr="*u8", ws_ptr="*fp32", offs_ptr="*i32",
               ridx_ptr="*i32", y_ptr="*bf16", T="i32", P="i32", N="i32", D="i32", E="i32",
               stride_xt="i32", stride_we="i64", stride_wn="i32", stride_se="i32",
               stride_sn="i32", stride_sk="i32")  # fmt: skip
    consts = dict(a_desc=None, b_desc=None, HAS_RIDX=True, BLOCK_SCALES=False, BM=cfg.block_m,
                  BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, BLOCK_E=256, EVEN_K=True,
                  A_TMA=False, B_TMA=False, UPCAST=False, WHILE_LOOPS=False, FAST_ACCUM=False,
                  DECODE=True)  # fmt: skip
    src = ASTSource(fn=fm._fp8_grouped_mm_kernel, signature={**sig, **dict.fromkeys(consts,
                    "constexpr")}, constexprs=consts, attrs={})  # fmt: skip
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)
    assert "mma.sync" in kernel.asm["ptx"] and "e4m3" not in kernel.asm["ptx"]


@pytest.mark.parametrize("op", ["gather_quant", "silu_mul_quant"])
def test_fp8_row_quantisers_compile_before_sm89(can_compile, op):
    """The row-wise FP8 quantisers at sm_80 (A100) with the integer e4m3 rounding their launchers
    pick there (``_dispatch.e4m3_native``): no e4m3 type in the kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_kernels._triton import gather_quant as gq
    from moe_kernels._triton import swiglu as sw

    ints = ("N", "D", "T", "E", "stride_xt", "stride_xd", "stride_st", "stride_se")
    if op == "gather_quant":
        kern = gq._gather_quant_kernel
        sig = dict(q_ptr="*u8", scale_ptr="*fp32", x_ptr="*bf16", tok_ptr="*i32",
                   exp_ptr="*i32", scores_ptr="*fp32", ub_ptr="*fp32", vtc_ptr="*i32",
                   **dict.fromkeys(ints, "i32"))  # fmt: skip
    else:
        kern = sw._silu_mul_quant_kernel
        ints = ("T", "D", "stride_0t", "stride_0d", "stride_1t", "stride_1d")
        sig = dict(q_ptr="*u8", scale_ptr="*fp32", x0_ptr="*bf16", x1_ptr="*bf16",
                   ub_ptr="*fp32", vtc_ptr="*i32", **dict.fromkeys(ints, "i32"))  # fmt: skip
    consts = dict(HAS_UB=False, HAS_VTC=False, IEEE_DIV=False, NATIVE_CAST=False, BLOCK_T=4,
                  BLOCK_D=2048, NUM_CHUNKS=1, COL64=False)  # fmt: skip
    src = ASTSource(fn=kern, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                    constexprs=consts, attrs={})  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=dict(num_warps=4))
    assert "e4m3" not in kernel.asm["ptx"]


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "sorted"])
@pytest.mark.parametrize("block_scales", [False, True], ids=["channel", "block"])
def test_fp8_grouped_mm_kernel_compiles_to_wgmma(can_compile, gathered, block_scales):
    """The FP8 grouped GEMM's GPU launch (B, and sorted A, through TMA; e4m3 wgmma) at its
    default configs, without register spills (356-732 bytes a thread before the output
    pointers moved after the K loop and gathered rows took 64-row tiles)."""
    from moe_kernels._triton import fp8_grouped_mm as fm
    from moe_kernels.testing import register_use

    cfg = fm.fp8_config(4096, 1024, 2048, block_scales, gathered)
    a_desc = f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>"
    sig = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
               offs_ptr="*i32", ridx_ptr="*i32", y_ptr="*bf16",
               b_desc=f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>", T="i32", P="i32",
               N="i32", D="i32", E="i32", stride_xt="i32", stride_we="i64", stride_wn="i32",
               stride_se="i32", stride_sn="i32", stride_sk="i32")  # fmt: skip
    consts = dict(HAS_RIDX=gathered, BLOCK_SCALES=block_scales, BM=cfg.block_m, BN=cfg.block_n,
                  BK=cfg.block_k, GROUP_M=cfg.group_m, BLOCK_E=256, EVEN_K=True,
                  A_TMA=not gathered, B_TMA=True, UPCAST=False, WHILE_LOOPS=False,
                  FAST_ACCUM=cfg.fast_accum, DECODE=False)  # fmt: skip
    if gathered:
        consts["a_desc"] = None
    else:
        sig["a_desc"] = a_desc
    kernel = _compile(fm._fp8_grouped_mm_kernel, sig, consts, cfg.num_warps, cfg.num_stages)
    assert "wgmma" in kernel.asm["ptx"]
    assert register_use(kernel).spill_bytes == 0, register_use(kernel)
