"""The persistent K-grouped weight-gradient GEMM (``_triton/grouped_weight_grad.py``) against a
float64 per-group oracle: empty groups, groups of one row and of many K steps, rows past the
groups, a gather with -1 and out-of-range indices, strided operands, several tile configs and
persistent grids with more tiles than programs; bitwise repeatability; its rule and config
(``_gemm_plan``); on CUDA, every TMA mode against the oracle and CUTLASS, the public op
taking it, no host syncs and CUDA-graph replay.

The kernel tests run in Triton's interpreter (``TRITON_INTERPRET=1``) and on CUDA; the rule
tests everywhere.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels import _gemm_plan as rules
from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import ULP, oracle_grouped_weight_grad

CUDA = torch.cuda.is_available()
needs_kernel = pytest.mark.skipif(not (INTERPRET or CUDA), reason="needs Triton's interpreter")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"


def rand(shape, dtype, seed, scale=0.3, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) + 0.25) * scale).to(dtype).to(device)


def make_offsets(counts, device=DEV):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)  # fmt: skip


def assert_close(out, want, k):
    """Within one rounding to out's dtype (two ulps: the interpreter truncates) plus the fp32
    accumulation error of a k-long sum of O(1) products."""
    got = out.double().cpu()
    tol = 2 * ULP[out.dtype] * want.abs() + k * 2.0**-22 + 1e-6
    err = (got - want).abs()
    assert bool((err <= tol).all()), f"max err {float(err.max())}"


CASES = [  # (N, D, counts, rows past the groups)
    (40, 48, [5, 0, 17, 9], 5),
    (32, 64, [70], 0),  # one group over several K steps
    (24, 40, [0, 0, 3], 2),  # N and D not multiples of the tiles
    (96, 32, [1, 33, 0, 2, 20], 7),
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_oracle(dtype, case):
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad

    n, d, counts, tail = case
    rows = sum(counts)
    dy, x = rand((rows + tail, n), dtype, 1), rand((rows + tail, d), dtype, 2)
    out = grouped_weight_grad(dy, x, make_offsets(counts), None, dtype)
    assert out.shape == (len(counts), n, d) and out.dtype == dtype
    assert_close(out, oracle_grouped_weight_grad(dy, x, make_offsets(counts)), max(counts))
    assert torch.equal(out, grouped_weight_grad(dy, x, make_offsets(counts), None, dtype))


@needs_kernel
def test_gather_and_strided_operands():
    """Rows gathered through row_indices (-1 and indices past T add nothing), dy a transposed
    view and x a column slice (pointer loads), fp32 out from bf16 inputs."""
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad

    counts, num_tokens = [9, 0, 14, 1], 11
    rows = torch.randint(-1, num_tokens + 3, (sum(counts) + 3,), generator=torch.Generator()
                         .manual_seed(3)).int().to(DEV)  # fmt: skip
    dy = rand((24, rows.shape[0]), torch.bfloat16, 4).mT
    x = rand((num_tokens, 56), torch.bfloat16, 5)[:, 8:]
    out = grouped_weight_grad(dy, x, make_offsets(counts), rows, torch.float32)
    assert out.dtype == torch.float32
    assert_close(
        out, oracle_grouped_weight_grad(dy, x, make_offsets(counts), rows.cpu()), max(counts)
    )


@needs_kernel
@pytest.mark.parametrize(
    "cfg",
    [
        rules.WgradConfig(16, 16, 16, 4, 1, "none", 1),
        rules.WgradConfig(32, 16, 32, 4, 1, "none", 3),  # more programs than some tiles need
        rules.WgradConfig(16, 32, 16, 4, 1, "x", 1),  # "x" without TMA's conditions: pointers
    ],
    ids=["16x16x16", "32x16x32-3-per-sm", "16x32x16-x"],
)
def test_tile_configs_match_oracle(cfg):
    """Explicit configs (the typed override): each program walks several tiles of several
    experts, K steps that straddle groups."""
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad

    counts = [33, 0, 20, 1, 16]
    dy, x = rand((75, 40), torch.float32, 6), rand((75, 48), torch.float32, 7)
    out = grouped_weight_grad(dy, x, make_offsets(counts), None, torch.float32, cfg)
    assert_close(out, oracle_grouped_weight_grad(dy, x, make_offsets(counts)), 33)


@needs_kernel
def test_tma_modes_keep_rows_past_a_group_out():
    """bf16 through the ragged TMA descriptors ("x", "both"; the interpreter emulates them)
    gives the pointer loads' bits, and non-finite rows past the groups, or at the first row of
    the group after a K step's end, reach no other group's result."""
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad as kernel

    counts = [5, 0, 17, 9, 1]
    offsets, p = make_offsets(counts), sum(counts)
    dy, x = rand((p + 6, 32), torch.bfloat16, 20), rand((p + 6, 48), torch.bfloat16, 21)
    dy_bad, x_bad = dy.clone(), x.clone()
    dy_bad[p:], x_bad[p:] = float("inf"), float("nan")
    x_bad[5] = float("inf")  # group 2's first row, read past group 0's end
    base = rules.wgrad_config(32, 48, INTERPRET)
    want = kernel(dy, x, offsets, None, torch.float32, base._replace(tma="none"))
    for tma in ("x", "both"):
        cfg = base._replace(tma=tma)
        assert torch.equal(kernel(dy, x, offsets, None, torch.float32, cfg), want), tma
        bad = kernel(dy_bad, x_bad, offsets, None, torch.float32, cfg)
        assert torch.equal(bad[[0, 1, 3, 4]], want[[0, 1, 3, 4]]), tma
        assert not bool(bad[2].isfinite().all()), tma


@needs_kernel
def test_empty_shapes():
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad

    dy, x = rand((6, 8), torch.float32, 8), rand((6, 16), torch.float32, 9)
    out = grouped_weight_grad(dy[:0], x[:0], make_offsets([0, 0]), None, torch.float32)
    assert out.shape == (2, 8, 16) and bool((out == 0).all())
    out = grouped_weight_grad(dy, x, make_offsets([0, 0]), None, torch.float32)
    assert out.shape == (2, 8, 16) and bool((out == 0).all())
    assert grouped_weight_grad(dy, x, make_offsets([]), None, torch.float32).shape == (0, 8, 16)


def test_opcheck_and_compiled_equals_eager():
    """The registered op's schema and fake kernel; ``torch.compile(fullgraph=True)`` of the
    public op gives eager's bits (sorted rows and the gather)."""
    import moe_kernels as mk

    counts = [7, 0, 12]
    offsets = make_offsets(counts)
    dy, x = rand((21, 24), torch.bfloat16, 12), rand((21, 40), torch.bfloat16, 13)
    rows = torch.randint(-1, 21, (21,), generator=torch.Generator().manual_seed(14)).int().to(DEV)
    op = torch.ops.moe_kernels.grouped_weight_grad.default
    for args in ((dy, x, offsets, None, torch.bfloat16), (dy, x, offsets, rows, torch.float32)):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(mk.grouped_weight_grad, fullgraph=True)
    for r in (None, rows):
        assert torch.equal(compiled(dy, x, offsets, r), mk.grouped_weight_grad(dy, x, offsets, r))


def test_rule_bounds_rows_per_expert():
    """The weight gradient runs the persistent kernel for bf16 on sm90 with TMA-readable
    operands and at most WGRAD_MAX_ROWS_PER_EXPERT rows per expert on average."""
    limit = rules.WGRAD_MAX_ROWS_PER_EXPERT
    assert rules.use_persistent(128 * limit, 128, True, 9, True, wgrad=True)
    assert not rules.use_persistent(128 * limit + 1, 128, True, 9, True, wgrad=True)
    assert not rules.use_persistent(1024, 16, True, 9, False, wgrad=True)  # tracing, strided
    assert not rules.use_persistent(1024, 16, False, 9, True, wgrad=True)


def test_config_rule():
    """GPU: 128 x 256 x 64 tiles, 8 warps, 3 stages, x through TMA (fp32: 128 x 128 x 32,
    pointer loads); BN / BD shrink to small N / D. Interpreter: small tiles, one stage, pointer
    loads."""
    assert rules.wgrad_config(1536, 2048, interpret=False) == rules.WgradConfig()
    assert rules.wgrad_config(40, 100, interpret=False)[:2] == (64, 128)
    fp32 = rules.wgrad_config(1536, 2048, interpret=False, fp32=True)
    assert fp32 == rules.WgradConfig(128, 128, 32, tma="none")
    small = rules.wgrad_config(24, 100, interpret=True)
    assert small.tma == "none" and small.num_stages == 1 and small[:3] == (32, 64, 16)


# --------------------------------------------------------------------------------------------
# CUDA only (skipped on CPU)


@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA device")
def test_cuda_tma_modes_cutlass_no_sync_graph():
    """bf16 on sm90: every TMA mode within rounding of the oracle and bitwise repeatable, rows
    past a group (NaN and inf included) reaching no result of it; the default config's bits
    equal CUTLASS's (both sum a group's rows in order in fp32, the last step's missing rows as
    zeros); the public op (the kernel or CUTLASS, as the rule says) runs
    without host syncs and replays from a CUDA graph."""
    from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad as kernel
    from moe_kernels.grouped_mm import grouped_weight_grad

    if torch.cuda.get_device_capability()[0] != 9 or not hasattr(torch, "_grouped_mm"):
        pytest.skip("sm90 with torch._grouped_mm only")
    counts = [300, 0, 129, 511, 64, 1]
    offsets = make_offsets(counts)
    dy = rand((sum(counts) + 40, 384), torch.bfloat16, 10)
    x = rand((sum(counts) + 40, 512), torch.bfloat16, 11)
    want = oracle_grouped_weight_grad(dy, x, make_offsets(counts))
    # Non-finite rows past the groups, and at group 4's first row (the row after group 3's
    # last K step ends), reach no other group's result.
    x_bad, dy_bad = x.clone(), dy.clone()
    x_bad[sum(counts) :], dy_bad[sum(counts) :] = float("nan"), float("inf")
    x_bad[940] = float("inf")
    others = [0, 1, 2, 3, 5]
    for tma in ("none", "x", "both"):
        cfg = rules.WgradConfig(tma=tma)
        out = kernel(dy, x, offsets, None, torch.bfloat16, cfg)
        assert_close(out, want, 511)
        assert torch.equal(out, kernel(dy, x, offsets, None, torch.bfloat16, cfg)), tma
        bad = kernel(dy_bad, x_bad, offsets, None, torch.bfloat16, cfg)
        assert torch.equal(bad[others], out[others]), tma
    cutlass = torch._grouped_mm(dy[: sum(counts)].mT, x[: sum(counts)], offs=offsets[1:])
    assert torch.equal(kernel(dy, x, offsets, None, torch.bfloat16), cutlass)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_weight_grad(dy, x, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, cutlass)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = grouped_weight_grad(dy, x, offsets)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_graph, out)
