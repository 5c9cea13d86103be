"""The GPU launch plans of the routing, router and scatter-add kernels compile for sm_90a
(Hopper), on a machine without a GPU.

The interpreter runs the kernels' semantics but not Triton's GPU compiler, whose passes can reject
a kernel for one specialisation only (triton 3.6-3.8's ``TritonGPUOptimizeThreadLocality`` failed
on C's counting placement with a (tokens, 1) count tensor, an expert range of <= 4 experts; found
on an H200). So every launch plan the GPU launchers pick for a spread of shapes is compiled here
to a cubin (Triton's bundled ptxas). Skipped under ``TRITON_INTERPRET=1`` (the launchers pick
interpreter plans there) and where Triton cannot compile for CUDA at all.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # compiles with Triton: nothing to test without it

from moe_kernels._dispatch import INTERPRET

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
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK))

    try:
        _compile(_probe, {"x_ptr": "*i32"}, {"BLOCK": 32}, 1, 1)
    except Exception as exc:  # no CUDA backend / ptxas in this Triton build
        pytest.skip(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200])


# (T, E, top_k, start, end, scores dtype kind: 0 fp32 / 1 bf16 / 2 fp16, renormalize)
PLANS = [
    (4096, 16, 8, 0, 16, 1, False),  # small: ranks in A, scan fused into C
    (4096, 128, 8, 0, 128, 0, True),
    (65536, 128, 8, 0, 128, 1, False),  # sorted placement, PACK_W
    (1 << 20, 128, 8, 0, 128, 1, False),  # scan launch, sort
    (1 << 20, 256, 8, 0, 256, 2, False),
    (1 << 20, 32, 8, 0, 32, 1, False),  # index_shuffling: ranks by one-hot prefix sums
    (100000, 2048, 8, 0, 2048, 0, False),  # 64-bit sort keys
    (1 << 20, 16, 8, 0, 16, 1, False),  # counting placement (route), prefix sums (IS)
    (300000, 16, 4, 0, 16, 0, True),
    (300000, 128, 8, 32, 32, 1, False),  # empty expert range (L = 0)
    (300000, 128, 8, 32, 33, 1, False),  # L = 1
    (300000, 128, 8, 32, 36, 2, False),  # L = 4
    (300000, 128, 8, 32, 40, 1, True),  # L = 8
    (300000, 64, 6, 16, 48, 0, False),  # L = 32
    (300000, 64, 3, 0, 64, 2, False),  # index_shuffling: threshold top-k of 64 fp16 scores
]


# route's token-column plan, D writing the sorted pairs or not: (T, E, top_k, start, end, kind)
COLS_ROUTE = [(1 << 20, 128, 8, 0, 128, 1), (300000, 64, 5, 8, 40, 2)]
# the default, 256-token programs, C writing the sorted pairs (no D)
COLS_ROUTE_CONFIGS = {"default": (), "256-tokens": (("COLS_T", 256),), "no-D": (("RUNS", 0),)}


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("weights", [False, True], ids=["index_shuffling", "route"])
@pytest.mark.parametrize("eager", [False, True], ids=["op", "eager"])
def test_routing_plans_compile(can_compile, plan, weights, eager):
    _compile_plan(plan, weights, eager, None)


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


@pytest.mark.parametrize("plan", COLS_ROUTE, ids=str)
@pytest.mark.parametrize("config", list(COLS_ROUTE_CONFIGS))
def test_route_token_column_plans_compile(can_compile, plan, config):
    p = _compile_plan((*plan, False), True, False, COLS_ROUTE_CONFIGS[config] or None)
    assert p.a["WEIGHTS"] and p.c["COLS"] and (p.runs is not None) == (config != "no-D")


def _compile_plan(plan, weights, eager, config):
    from moe_kernels._triton import routing as tri

    T, E, k, start, end, kind, renorm = plan
    renorm = renorm and weights  # index_shuffling has no weights to renormalize
    args = (T, E, k, start, end, kind, renorm, True, weights, weights, not weights, config)
    # words: the scores' rows as 4-byte aligned pairs (contiguous 16-bit scores)
    p = tri._launch_plan(*args, eager, kind != 0)
    # eager calls launch A and C as one kernel where there is no scan or D launch and the
    # programs fit one per SM (_fusable; 132 on an H200)
    fusable = p.scan is None and p.runs is None and p.c["FUSE_SCAN"] and p.n_prog <= 132
    if eager and p == tri._launch_plan(*args, False, kind != 0) and not fusable:
        pytest.skip("the same plan as the op's")
    x_t = "*fp32" if kind == 0 else "*i16"
    ints = dict.fromkeys(["T", "E", "start", "end", "n_programs"], "i32")
    a_sig = dict(x_ptr=x_t, stride_t="i32", stride_e="i32", stride_w="i32", vtc_ptr="*i32",
                 pack_ptr="*i32", scr_w_ptr="*fp32", hist_ptr="*i32", **ints)  # fmt: skip
    kern_a = tri._topk_cols_kernel if p.c["COLS"] else tri._topk_rank_kernel
    _compile(kern_a, a_sig, dict(p.a), p.a_warps)
    if p.scan is not None:
        _, consts, warps = p.scan
        sig = dict(hist_ptr="*i32", counts_ptr="*i32", L="i32", n_programs="i32")
        _compile(tri._scan_kernel, sig, dict(consts), warps)
    c_sig = dict(pack_ptr="*i32", scr_w_ptr="*fp32", inverse_ptr="*i32", hist_ptr="*i32",
                 counts_ptr="*i32", expert_ptr="*i32", token_ptr="*i32", weight_ptr="*fp32",
                 offsets_ptr="*i32", tcpe_ptr="*i32", T="i32", E="i32", L="i32", start="i32",
                 n_programs="i32")  # fmt: skip
    _compile(tri._place_kernel, c_sig, dict(p.c), p.c_warps)
    if p.runs is not None:
        _, consts, warps = p.runs
        sig = dict(pack_ptr="*i32", hist_ptr="*i32", counts_ptr="*i32", expert_ptr="*i32",
                   token_ptr="*i32", weight_ptr="*fp32", L="i32", start="i32",
                   n_programs="i32")  # fmt: skip
        _compile(tri._expert_runs_kernel, sig, dict(consts), warps)
    if eager and fusable:
        f_sig = dict(a_sig, a_w_ptr=a_sig["scr_w_ptr"], scr_w_ptr="*fp32", inverse_ptr="*i32",
                     counts_ptr="*i32", expert_ptr="*i32", token_ptr="*i32",
                     weight_ptr="*fp32", offsets_ptr="*i32", tcpe_ptr="*i32", L="i32",
                     bar_ptr="*i32")  # fmt: skip
        f_sig = {name: f_sig[name] for name in tri._fused_kernel.arg_names if name in f_sig}
        _compile(tri._fused_kernel, f_sig, tri._fused_constexprs(p), p.a_warps)
    return p


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
