"""The persistent grouped GEMM over expert-sorted rows (``_triton/persistent_grouped_mm.py``)
against a float64 per-group oracle, both weight layouts, several tile configs, groups that are
empty or span several m-tiles, and a tail of rows past the groups; its choice rule and config
(``_gemm_plan``); on CUDA, its bits against ``torch._grouped_mm`` (CUTLASS), the public
op taking it, no host syncs and CUDA-graph replay.

The kernel tests run in Triton's interpreter (``TRITON_INTERPRET=1``) and on CUDA; the rule
tests everywhere.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels import _gemm_plan as rules
from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import ULP, oracle_gather_grouped_mm

CUDA = torch.cuda.is_available()
needs_kernel = pytest.mark.skipif(not (INTERPRET or CUDA), reason="needs Triton's interpreter")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"


def rand(shape, dtype, seed, scale=0.3, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) + 0.25) * scale).to(dtype).to(device)


def make_offsets(counts, device=DEV):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)  # fmt: skip


def expected64(a, w_nk, counts):
    """float64 on a's device: rows of group e times w[e].T (``oracle_gather_grouped_mm``);
    rows past the groups are not compared."""
    return oracle_gather_grouped_mm(a, w_nk, make_offsets(counts, "cpu")).to(a.device)


def assert_close(c, expected64, k, rows):
    """Group rows within one rounding to c's dtype (two ulps: the interpreter truncates) plus
    the fp32 accumulation error of a k-long dot of O(1) values."""
    got, want = c[:rows].double(), expected64[:rows]
    tol = 2 * ULP[c.dtype] * want.abs() + k * 2.0**-22 + 1e-6
    err = (got - want).abs()
    assert bool((err <= tol).all()), f"max err {float(err.max())}"


CASES = [  # (K, N, counts, tail rows)
    (48, 40, [5, 0, 17, 9], 5),
    (64, 32, [70], 0),  # one group over several m-tiles
    (40, 24, [0, 0, 3], 2),  # K not a multiple of the tile's BK
    (32, 96, [1, 33, 0, 2, 20], 7),
]


def _layouts(w_nk):
    return {"nk": w_nk, "kn": w_nk.mT.contiguous()}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_matches_oracle(dtype, case, layout):
    from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm

    k, n, counts, tail = case
    rows = sum(counts)
    a = rand((rows + tail, k), dtype, 1)
    w = rand((len(counts), n, k), dtype, 2)
    c = persistent_grouped_mm(a, _layouts(w)[layout], make_offsets(counts), layout)
    assert c.shape == (rows + tail, n) and c.dtype == dtype
    assert_close(c, expected64(a, w, counts), k, rows)


@needs_kernel
@pytest.mark.parametrize(
    "cfg",
    [
        rules.PersistentConfig(16, 16, 16, 4, 1, False, 1, False),
        rules.PersistentConfig(32, 32, 32, 4, 1, False, 3, False),  # more programs than tiles
        rules.PersistentConfig(16, 64, 64, 4, 1, False, 1, True),  # flattened; K tail masked
    ],
    ids=["16x16x16", "32x32x32-spare", "16x64x64-flat"],
)
def test_tile_configs_match_oracle(cfg):
    """Explicit configs (the typed override): tiles that straddle groups, a persistent grid with
    fewer programs than tiles and one with spare programs, the flattened loop."""
    from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm

    counts = [33, 0, 20, 1]
    a = rand((60, 48), torch.float32, 3)
    w = rand((4, 40, 48), torch.float32, 4)
    for layout, wl in _layouts(w).items():
        c = persistent_grouped_mm(a, wl, make_offsets(counts), layout, cfg)
        assert_close(c, expected64(a, w, counts), 48, 54)


@needs_kernel
def test_empty_and_degenerate_shapes():
    from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm

    a = rand((6, 16), torch.float32, 5)
    w = rand((2, 8, 16), torch.float32, 6)
    assert persistent_grouped_mm(a[:0], w, make_offsets([0, 0]), "nk").shape == (0, 8)
    assert persistent_grouped_mm(a, w[:, :0], make_offsets([3, 3]), "nk").shape == (6, 0)
    c = persistent_grouped_mm(a[:, :0], w[:, :, :0], make_offsets([2, 4]), "nk")
    assert c.shape == (6, 8) and bool((c == 0).all())
    c = persistent_grouped_mm(a, w, make_offsets([0, 0]), "nk")  # no group rows: nothing written
    assert c.shape == (6, 8)


def test_rule_bounds_rows_per_expert():
    """Persistent only for bf16 on sm90 with TMA-readable operands and at most
    PERSISTENT_MAX_ROWS_PER_EXPERT rows per expert on average."""
    limit = rules.PERSISTENT_MAX_ROWS_PER_EXPERT
    assert rules.use_persistent(128 * limit, 128, True, 9, True)
    assert not rules.use_persistent(128 * limit + 1, 128, True, 9, True)
    assert rules.use_persistent(65536, 128, True, 9, True)  # Qwen3-30B-A3B: 512 per expert
    assert not rules.use_persistent(262144, 128, True, 9, True)  # SonicMoE: 2048 per expert
    assert not rules.use_persistent(1024, 16, False, 9, True)  # fp16 / fp32: not measured
    assert not rules.use_persistent(1024, 16, True, 8, True)  # Ampere: no TMA / wgmma
    assert not rules.use_persistent(1024, 16, True, 10, True)  # Blackwell: not measured
    assert not rules.use_persistent(1024, 16, True, 9, False)  # tracing, strided, unaligned
    assert not rules.use_persistent(0, 0, True, 9, True)


def test_config_rule():
    """GPU: 128 x 256 x 64, 8 warps, 3 stages, flattened, TMA; BN / BK shrink to small N / K
    (powers of two, at least 16). Interpreter: small tiles, one stage, pointer loads."""
    cfg = rules.persistent_config(65536, 2048, 768, 128, interpret=False)
    assert cfg == rules.PersistentConfig(128, 256, 64, 8, 3, True, 1, True)
    assert rules.persistent_config(4096, 96, 40, 8, interpret=False)[1:3] == (128, 64)
    assert rules.persistent_config(4096, 8, 8, 8, interpret=False)[1:3] == (16, 16)
    small = rules.persistent_config(40, 24, 100, 4, interpret=True)
    assert small.tma is False and small.num_stages == 1 and small[:3] == (32, 32, 64)


# --------------------------------------------------------------------------------------------
# CUDA only (skipped on CPU)


@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_cuda_bits_equal_cutlass_no_sync_graph(layout):
    """bf16 on sm90: the persistent kernel (TMA, flattened) gives CUTLASS's bits on the group
    rows (both accumulate K in order in fp32), for every config; the public op takes it (rows
    past the groups zeroed by zero_tail), without host syncs, and replays from a CUDA graph."""
    from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm
    from moe_kernels.grouped_mm import gather_grouped_mm

    if torch.cuda.get_device_capability()[0] != 9 or not hasattr(torch, "_grouped_mm"):
        pytest.skip("sm90 with torch._grouped_mm only")
    dev = "cuda"
    counts = [300, 0, 129, 511, 64, 1]
    rows = sum(counts)
    offsets = make_offsets(counts, dev)
    a = rand((rows + 40, 512), torch.bfloat16, 7, device=dev)
    w = rand((len(counts), 384, 512), torch.bfloat16, 8, 0.05, device=dev)
    wl = _layouts(w)[layout]
    w_end = w if layout == "nk" else wl.mT  # what the op sees: (E, N, K), maybe a .mT view
    cutlass = torch._grouped_mm(a, w_end.mT, offs=offsets[1:])
    for cfg in (None, rules.PersistentConfig(64, 128, 64, 4, 4), rules.PersistentConfig()):
        c = persistent_grouped_mm(a, wl, offsets, layout, cfg)
        assert torch.equal(c[:rows], cutlass[:rows]), cfg
    assert_close(c, expected64(a, w, counts), 512, rows)
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = gather_grouped_mm(a, w_end, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y[:rows], cutlass[:rows]) and bool((y[rows:] == 0).all())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = gather_grouped_mm(a, w_end, offsets)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)
