"""gather_grouped_mm against a naive per-row oracle (Python loops over rows, float64 dots).

Runs on the torch reference path (TRITON_INTERPRET=0) and on the Triton kernels in the interpreter
(TRITON_INTERPRET=1): the op's plan (the grouped GEMV at these few rows) and the tile GEMM's
launcher. Results are compared with a tolerance: one rounding to the output dtype
(two bf16 ulps under the interpreter, which truncates) plus fp32 accumulation error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels._dispatch import triton_kernels, use_triton
from moe_kernels.grouped_mm import gather_grouped_mm
from moe_kernels.testing import ULP, oracle_gather_grouped_mm

CPU = torch.device("cpu")
TRITON = use_triton(CPU)


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) + 0.25) * scale).to(dtype)


def make_offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def assert_close(actual: torch.Tensor, expected64: torch.Tensor, dim: int) -> None:
    """Within one rounding to actual's dtype (two ulps: the interpreter truncates) plus the fp32
    accumulation error of a D-long dot of O(1) values; zeros stay exactly zero."""
    assert actual.dtype in ULP and actual.shape == expected64.shape
    a = actual.double()
    tol = 2 * ULP[actual.dtype] * expected64.abs() + dim * 2.0**-22 + 1e-6
    err = (a - expected64).abs()
    assert bool((err <= tol).all()), f"max err {float(err.max())}, at {int(err.argmax())}"
    assert bool((a[expected64 == 0] == 0).all())


def tile_gemm(x, w, offsets, rows, activation):
    """The tile GEMM's launcher (``_triton/grouped_mm.py``), whatever the plan."""
    tri = triton_kernels("grouped_mm")
    return tri.gather_grouped_mm(x, w, offsets, rows, tri.ACT_SILU if activation else tri.ACT_NONE)


CASES = [
    # (T, D, N, counts, P) ; P = len(rows); counts may be empty groups; tail = P - sum(counts)
    (24, 32, 48, [24], 24),
    (20, 48, 40, [5, 0, 17, 0, 6], 36),
    (16, 96, 32, [0, 0, 9], 16),
    (33, 40, 72, [13, 20], 40),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gathered_matches_oracle(dtype, case, activation):
    num_tokens, dim, n, counts, num_rows = case
    x = rand((num_tokens, dim), dtype, 1, 0.3)
    w = rand((len(counts), n, dim), dtype, 2, 0.3)
    offsets = make_offsets(counts)
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, num_tokens, (num_rows,), generator=g, dtype=torch.int32)
    rows[int(offsets[-1]) :] = -1  # the tail of a routing plan
    y = gather_grouped_mm(x, w, offsets, rows, activation=activation)
    assert y.shape == (num_rows, n) and y.dtype == dtype
    expected = oracle_gather_grouped_mm(x, w, offsets, rows, activation)
    assert_close(y, expected, dim)
    if TRITON:  # the tile GEMM too: at these few rows the op's plan runs the grouped GEMV
        assert_close(tile_gemm(x, w, offsets, rows, activation), expected, dim)


@settings(max_examples=12, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    tail=st.integers(0, 5),
    num_tokens=st.integers(1, 12),
    dim=st.sampled_from([16, 24]),
    n=st.sampled_from([16, 20]),
    gathered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_groups(counts, tail, num_tokens, dim, n, gathered, seed):
    """Random group sizes (empty ones too), tails, gathered or sorted rows, odd N."""
    offsets = make_offsets(counts)
    num_rows = int(offsets[-1]) + tail
    if not gathered:
        num_tokens = num_rows
        if num_tokens == 0:
            return
    x = rand((num_tokens, dim), torch.float32, seed, 0.3)
    w = rand((len(counts), n, dim), torch.float32, seed + 1, 0.3)
    rows = None
    if gathered:
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, num_tokens, (num_rows,), generator=g, dtype=torch.int32)
        rows[int(offsets[-1]) :] = -1
    y = gather_grouped_mm(x, w, offsets, rows, activation="silu")
    expected = oracle_gather_grouped_mm(x, w, offsets, rows, "silu")
    assert_close(y, expected, dim)
    if TRITON:
        assert_close(tile_gemm(x, w, offsets, rows, "silu"), expected, dim)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_sorted_rows_none_with_tail(activation):
    """row_indices None: A rows are x's rows (P = T); rows past offsets[E] are zero."""
    x = rand((30, 64), torch.bfloat16, 4, 0.3)
    w = rand((3, 24, 64), torch.bfloat16, 5, 0.3)
    offsets = make_offsets([7, 0, 15])
    y = gather_grouped_mm(x, w, offsets, None, activation=activation)
    assert bool((y[22:] == 0).all())
    assert_close(y, oracle_gather_grouped_mm(x, w, offsets, None, activation), 64)


def test_bad_row_inside_group_is_zero_and_strided_int64_inputs():
    """Rows whose index is -1 (or >= T) inside a group give zero rows; strided x (a column slice)
    and w (a .mT view of (E, D, N)), int64 offsets and indices."""
    x_big = rand((20, 80), torch.bfloat16, 6, 0.3)
    x = x_big[:, 8:56]  # (20, 48), row stride 80
    w = rand((2, 48, 40), torch.bfloat16, 7, 0.3).mT  # (2, 40, 48), strides (1920, 1, 40)
    offsets = make_offsets([10, 14]).long()
    rows = torch.randint(0, 20, (24,), generator=torch.Generator().manual_seed(8))
    rows[3], rows[15] = -1, 20
    y = gather_grouped_mm(x, w, offsets, rows, activation="silu")
    assert bool((y[3] == 0).all()) and bool((y[15] == 0).all())
    assert_close(y, oracle_gather_grouped_mm(x, w, offsets, rows, "silu"), 48)


def test_deterministic_and_matches_route_dispatch():
    """With a real routing plan: equals dispatch then a per-group matmul (both in fp32), and two
    calls are bitwise identical."""
    from moe_kernels.routing import route
    from moe_kernels.tokens import dispatch

    num_tokens, dim, n, num_experts, k = 16, 32, 32, 4, 2
    scores = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(9))
    plan = route(scores.softmax(-1), k)
    x = rand((num_tokens, dim), torch.float32, 10, 0.3)
    w = rand((num_experts, n, dim), torch.float32, 11, 0.3)
    y1 = gather_grouped_mm(x, w, plan.offsets, plan.token_indices, activation="silu")
    y2 = gather_grouped_mm(x, w, plan.offsets, plan.token_indices, activation="silu")
    assert torch.equal(y1, y2)
    xs = dispatch(x, plan)
    expected = torch.zeros_like(y1, dtype=torch.float64)
    for e in range(num_experts):
        s, t = int(plan.offsets[e]), int(plan.offsets[e + 1])
        expected[s:t] = torch.nn.functional.silu(xs[s:t].double() @ w[e].double().T)
    assert_close(y1, expected, dim)


@pytest.mark.skipif(not TRITON, reason="launch configs exist on the Triton path only")
@pytest.mark.parametrize(
    "block_m,group_m,tma,sorted_rows",
    [(16, 1, False, False), (16, 3, True, False), (32, 2, False, True), (16, 2, True, True)],
    ids=["bm16-g1", "bm16-g3-tma", "bm32-g2-sorted", "bm16-g2-tma-sorted"],
)
def test_tile_configs_agree(block_m, group_m, tma, sorted_rows):
    """Many m-tiles per group, grouped tile orders, spare programs of the static grid, TMA
    descriptors for B (and for A when the rows are sorted; BN 16 < N = 40 so the last n-tile
    reads past the expert): the explicit config and the default both match the oracle."""
    from moe_kernels._triton import grouped_mm as tri

    x = rand((60, 64), torch.float32, 12, 0.3)
    w = rand((3, 40, 64), torch.float32, 13, 0.3)
    offsets = make_offsets([33, 0, 20])
    rows = torch.randint(0, 60, (60,), generator=torch.Generator().manual_seed(14)).int()
    rows[53:] = -1
    rows = None if sorted_rows else rows
    expected = oracle_gather_grouped_mm(x, w, offsets, rows, "silu")
    base = tri.gather_grouped_mm(x, w, offsets, rows, tri.ACT_SILU)
    cfg = tri.GemmConfig(block_m, 16, 32, group_m, 4, 1, tma)
    y = tri.gather_grouped_mm(x, w, offsets, rows, tri.ACT_SILU, config=cfg)
    assert_close(y, expected, 64)
    assert_close(base, expected, 64)


def test_empty_shapes():
    x = rand((6, 16), torch.bfloat16, 15)
    w = rand((2, 16, 16), torch.bfloat16, 16)
    offs = make_offsets([0, 0])
    assert gather_grouped_mm(x, w, offs, torch.zeros(0, dtype=torch.int32)).shape == (0, 16)
    assert bool((gather_grouped_mm(x, w, offs, None) == 0).all())
    assert gather_grouped_mm(x, w[:, :0], make_offsets([3, 3])).shape == (6, 0)
    y = gather_grouped_mm(x[:0], w, make_offsets([0, 0]), torch.full((5,), -1))
    assert y.shape == (5, 16) and bool((y == 0).all())
    y = gather_grouped_mm(x[:, :0], w[:, :, :0], make_offsets([2, 4]), None, activation="silu")
    assert y.shape == (6, 16) and bool((y == 0).all())


def _bad_cases():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(2, 6, 8, dtype=torch.bfloat16)
    offs = make_offsets([2, 2])
    rows = torch.zeros(4, dtype=torch.int32)
    return [
        ("x_TD", TypeError, ([1.0], w, offs, rows), {}),
        ("x_TD", TypeError, (x.int(), w, offs, rows), {}),
        ("x_TD", ValueError, (x[0], w, offs, rows), {}),
        ("w_END", ValueError, (x, w[0], offs, rows), {}),
        ("w_END", TypeError, (x, w.float(), offs, rows), {}),
        ("w_END", ValueError, (x, w[:, :, :4], offs, rows), {}),
        ("offsets", TypeError, (x, w, offs.float(), rows), {}),
        ("offsets", ValueError, (x, w, offs[:2], rows), {}),
        ("offsets", ValueError, (x, w, offs[None], rows), {}),
        ("row_indices", TypeError, (x, w, offs, rows.float()), {}),
        ("row_indices", ValueError, (x, w, offs, rows[None]), {}),
        ("activation", ValueError, (x, w, offs, rows), {"activation": "gelu"}),
        ("activation", TypeError, (x, w, offs, rows), {"activation": 1}),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: f"{c[0]}-{c[1].__name__}")
def test_bad_input_raises_naming_argument(case):
    name, exc, args, kwargs = case
    with pytest.raises(exc, match=name):
        gather_grouped_mm(*args, **kwargs)


def test_opcheck():
    x = rand((12, 32), torch.bfloat16, 17, 0.3)
    w = rand((2, 16, 32), torch.bfloat16, 18, 0.3)
    offs = make_offsets([5, 6])
    rows = torch.randint(0, 12, (14,), generator=torch.Generator().manual_seed(19)).int()
    op = torch.ops.moe_kernels.gather_grouped_mm.default
    for args in ((x, w, offs, rows, "silu"), (x, w, offs, None, "none")):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph_matches_eager():
    x = rand((12, 32), torch.bfloat16, 20, 0.3)
    w1 = rand((2, 16, 32), torch.bfloat16, 21, 0.3)
    w2 = rand((2, 32, 16), torch.bfloat16, 22, 0.3)
    offs = make_offsets([5, 6])
    rows = torch.randint(0, 12, (14,), generator=torch.Generator().manual_seed(23)).int()
    rows[11:] = -1

    def mlp(x, w1, w2, offs, rows):
        h = gather_grouped_mm(x, w1, offs, rows, activation="silu")
        return gather_grouped_mm(h, w2, offs)

    eager = mlp(x, w1, w2, offs, rows)
    compiled = torch.compile(mlp, fullgraph=True, backend="inductor")(x, w1, w2, offs, rows)
    assert torch.equal(eager, compiled)
    assert bool((eager[11:] == 0).all())


# --------------------------------------------------------------------------------------------
# CUDA only (skipped on CPU): the compiled kernel against the reference, no host syncs, CUDA
# graphs, torch.compile.


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tma", [False, True])
def test_cuda_matches_reference_no_sync_graph_compile(tma):
    from moe_kernels._triton import grouped_mm as tri
    from moe_kernels.reference import grouped_mm as ref

    dev = torch.device("cuda")
    num_tokens, dim, n, counts = 96, 256, 192, [100, 0, 37, 130]
    offsets = make_offsets(counts).to(dev)
    num_rows = int(offsets[-1]) + 21
    g = torch.Generator().manual_seed(30)
    rows = torch.randint(0, num_tokens, (num_rows,), generator=g, dtype=torch.int32)
    rows[int(offsets[-1]) :] = -1
    rows = rows.to(dev)
    x = rand((num_tokens, dim), torch.bfloat16, 31, 0.5).to(dev)
    w = rand((len(counts), n, dim), torch.bfloat16, 32, 0.1).to(dev)
    cfg = tri.GemmConfig(64, 64, 64, 4, 4, 3, tma)
    expected = ref.gather_grouped_mm(x, w, offsets, rows, "silu").float()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = tri.gather_grouped_mm(x, w, offsets, rows, tri.ACT_SILU, config=cfg)
        y_pub = gather_grouped_mm(x, w, offsets, rows, activation="silu")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in (y, y_pub):
        err = (out.float() - expected).abs()
        assert bool((err <= 2.0**-7 * expected.abs() + 1e-2).all()), float(err.max())
        assert bool((out[int(offsets[-1]) :] == 0).all())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = gather_grouped_mm(x, w, offsets, rows, activation="silu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y_pub)

    compiled = torch.compile(
        lambda a, b, o, r: gather_grouped_mm(a, b, o, r, activation="silu"), fullgraph=True
    )
    assert torch.equal(compiled(x, w, offsets, rows), y_pub)
