"""``scatter_add_padded_tokens`` against a sequential loop oracle and FBGEMM's test reference, on
the torch reference path (TRITON_INTERPRET=0) and on the Triton plans in the interpreter
(TRITON_INTERPRET=1), plus sm_90a compiles of the GPU launches (no GPU needed).

The interpreter truncates fp32 -> bf16 casts instead of rounding to nearest even, so bf16 outputs
get one ulp per add of slack there; everything else is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels import _dispatch
from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.padded_tokens import scatter_add_padded_tokens
from moe_kernels.testing import (
    compile_launches,
    oracle_fbgemm_scatter_add_padded,
    oracle_scatter_add_padded,
)

CPU = torch.device("cpu")
KERNEL = use_triton(CPU)  # the interpreter runs the kernels; else the reference
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the kernels run under TRITON_INTERPRET=1")


def assert_matches(actual, expected, roundings=1):
    """Bitwise equal, except bf16 under the interpreter: ``roundings`` bf16 ulps of slack."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if KERNEL and actual.dtype == torch.bfloat16:
        a, e = actual.float(), expected.float()
        ulp = 2.0 ** (torch.floor(torch.log2(e.abs().clamp_min(1e-30))) - 7)
        assert bool(((a - e).abs() <= roundings * ulp + 1e-30).all()), (a - e).abs().max()
    else:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 0.25).to(dtype)


def rand_ints(lo, hi, shape, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def run(in_tokens, counts, indices, out):
    expected = oracle_scatter_add_padded(in_tokens, counts, indices, out)
    scatter_add_padded_tokens(in_tokens, counts, indices, out)
    return expected


# --------------------------------------------------------------------------------------------
# semantics


@pytest.mark.parametrize(
    ("out_dtype", "in_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize(
    ("num_ranks", "num_positions", "dim", "num_experts", "num_rows"),
    [
        (1, 9, 5, 1, 9),  # EP = 1, one expert
        (2, 16, 33, 6, 16),  # E = 6: not a power of two
        (4, 20, 8, 12, 7),  # fewer output rows than positions: duplicates
        (3, 12, 130, 3, 30),  # more output rows than positions
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_oracle(
    out_dtype, in_dtype, num_ranks, num_positions, dim, num_experts, num_rows, index_dtype
):
    in_tokens = rand((num_ranks, num_positions, dim), in_dtype, num_positions)
    counts = rand_ints(0, 5, (num_experts,), dim, index_dtype)
    indices = rand_ints(-1, num_rows + 2, (num_positions,), num_rows, index_dtype)
    out = rand((num_rows, dim), out_dtype, 3)
    expected = run(in_tokens, counts, indices, out)
    assert_matches(out, expected, roundings=num_positions)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_fbgemm_call_form(num_ranks, balanced):
    """FBGEMM's test: in (EP, T, D) bf16, out (T, D) bf16, randperm int32 indices; balanced
    int32 counts or bincount int64 counts over E = 16. One contribution per row: exact."""
    num_tokens, num_experts, dim = 64, 16, 5120
    in_tokens = rand((num_ranks, num_tokens, dim), torch.bfloat16, 4)
    out = rand((num_tokens, dim), torch.bfloat16, 5)
    if balanced:
        counts = torch.full((num_experts,), num_tokens // num_experts, dtype=torch.int32)
    else:
        counts = torch.bincount(rand_ints(0, num_experts, (num_tokens,), 6), minlength=num_experts)
    indices = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(7)).int()
    want = oracle_fbgemm_scatter_add_padded(in_tokens, counts, indices, out)
    expected = run(in_tokens, counts, indices, out)
    assert torch.equal(expected, want)
    assert_matches(out, want)


def test_order_is_ascending_position():
    # fp32 is not associative: ((0 + 1e8) + 1) - 1e8 + 3 = 3 (the 1 is lost next to 1e8), while
    # adding the 1 after the cancellation would give 4. Positions spread over both ranks.
    in_tokens = torch.zeros(2, 5, 1)
    in_tokens[0, 0], in_tokens[0, 1], in_tokens[1, 2], in_tokens[1, 3], in_tokens[1, 4] = (
        1e8, 1.0, -1e8, 1.0, 3.0,
    )  # fmt: skip
    counts = torch.tensor([1, 1, 3, 0])  # experts 0, 1 on rank 0; 2, 3 on rank 1
    out = torch.zeros(2, 1)
    scatter_add_padded_tokens(in_tokens, counts, torch.tensor([0, 0, 0, 1, 0]), out)
    assert out[0, 0].item() == 3.0 and out[1, 0].item() == 1.0


@pytest.mark.parametrize("top_k", [1, 4])
def test_ep_combine_shape(top_k):
    """The EP combine: T tokens, each at top_k positions spread over the ranks."""
    num_tokens, num_ranks, num_experts, dim = 12, 4, 8, 24
    num_positions = num_tokens * top_k
    g = torch.Generator().manual_seed(8)
    indices = torch.randperm(num_positions, generator=g) % num_tokens
    counts = torch.bincount(rand_ints(0, num_experts, (num_positions,), 9), minlength=num_experts)
    in_tokens = rand((num_ranks, num_positions, dim), torch.float32, 10)
    out = torch.zeros(num_tokens, dim)
    expected = run(in_tokens, counts, indices, out)
    assert torch.equal(out, expected) and out.ne(0).all()


@pytest.mark.parametrize(
    ("out_dtype", "in_dtype"), [(torch.int32, torch.int32), (torch.int64, torch.int32)]
)
def test_integer_tokens_are_exact(out_dtype, in_dtype):
    in_tokens = rand_ints(-(2**30), 2**30, (2, 10, 6), 11, in_dtype)
    counts = torch.tensor([3, 2, 4, 1])
    indices = rand_ints(0, 4, (10,), 12)
    out = rand_ints(-(2**30), 2**30, (4, 6), 13, out_dtype)
    expected = run(in_tokens, counts, indices, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "counts",
    [
        torch.tensor([3, 0, 9, 4]),  # 16 positions for 10: past T_K
        torch.tensor([2, -3, 1, 2]),  # negative: as 0
        torch.tensor([0, 0, 0, 0]),  # all zero: nothing added
        torch.tensor([0, 0, 5, 1], dtype=torch.int32),  # rank 0 empty
        torch.tensor([2**40, 1, 1, 1]),  # absurd
    ],
)
def test_counts_and_indices_breaking_the_contract_are_skipped(counts):
    in_tokens = rand((2, 10, 5), torch.float32, 14)
    indices = torch.tensor([0, 5, -1, 2, 100, 3, -7, 1, 0, 4], dtype=torch.int32)
    out = rand((6, 5), torch.float32, 15)
    expected = run(in_tokens, counts, indices, out)
    assert torch.equal(out, expected)


def test_empty_problems_leave_out_untouched():
    out = rand((4, 3), torch.float32, 16)
    before = out.clone()
    counts = torch.tensor([1, 1])
    scatter_add_padded_tokens(torch.empty(2, 0, 3), counts, torch.empty(0, dtype=torch.int32), out)
    scatter_add_padded_tokens(torch.ones(1, 2, 3), torch.empty(0, dtype=torch.int32),
                              torch.tensor([0, 1]), out)  # fmt: skip
    scatter_add_padded_tokens(torch.ones(2, 2, 3), counts * 0, torch.tensor([0, 1]), out)
    assert torch.equal(out, before)
    scatter_add_padded_tokens(torch.ones(2, 2, 3), counts, torch.tensor([0, 1]), torch.empty(0, 3))
    scatter_add_padded_tokens(torch.ones(2, 2, 0), counts, torch.tensor([0, 1]), torch.empty(4, 0))


def test_strided_tensors_and_determinism():
    full = rand((3, 14, 40), torch.bfloat16, 17)
    in_tokens = full[:, 2:12, 1::2]  # strided by rank, position and column
    counts = torch.tensor([4, 0, 9, 1, 2, 3, 5, 7, 0, 1, 2, 6])[::2]  # (6,), strided
    indices = rand_ints(0, 8, (20,), 18)[::2]
    results = []
    for _ in range(2):
        base = rand((8, 40), torch.float32, 19)
        out = base[:, 0::2]  # an in-place update through a strided view
        untouched = base[:, 1::2].clone()
        expected = run(in_tokens, counts, indices, out)
        assert torch.equal(out, expected)
        assert torch.equal(base[:, 1::2], untouched)
        results.append(base)
    assert torch.equal(results[0], results[1])


def test_not_differentiable():
    in_tokens = rand((2, 4, 3), torch.float32, 20).requires_grad_()
    out = torch.zeros(4, 3)
    counts, indices = torch.tensor([2, 2]), torch.arange(4)
    with pytest.raises(RuntimeError, match="in_tokens requires grad"):
        scatter_add_padded_tokens(in_tokens, counts, indices, out)
    with pytest.raises(RuntimeError, match="out_tokens requires grad"):
        scatter_add_padded_tokens(in_tokens.detach(), counts, indices, out.requires_grad_())
    with torch.no_grad():
        scatter_add_padded_tokens(in_tokens, counts, indices, out)
    assert out.ne(0).any()


# --------------------------------------------------------------------------------------------
# both Triton plans, forced through their config (the interpreter runs them)


@needs_kernel
@pytest.mark.parametrize(
    "cfg",
    [
        ("scan", 1, 16, 16, 4),  # several position blocks: order across blocks
        ("scan", 4, 32, 16, 4),  # several rows a program, two column programs
        ("scan", 16, 64, 64, 4),
        ("sorted", 1, 64, 0, 4),  # the dense scatter-add's kernel through the row map
        ("sorted", 4, 16, 0, 4),
    ],
    ids=str,
)
def test_plans(cfg):
    from moe_kernels._triton import padded_tokens as tri

    config = tri.ScatterConfig(*cfg)
    full = rand((3, 40, 50), torch.bfloat16, 21)
    in_tokens = full[:, :36]  # strided by rank: the sorted plan copies it
    counts = rand_ints(0, 7, (6,), 22, torch.int32)
    indices = rand_ints(-1, 11, (36,), 23, torch.int32)
    for out_dtype in (torch.float32, torch.int32):
        src = in_tokens if out_dtype.is_floating_point else (in_tokens * 100).int()
        out = rand((10, 50), torch.float32, 24).to(out_dtype)
        expected = oracle_scatter_add_padded(src, counts, indices, out)
        tri.scatter_add_padded(out, src, counts, indices, config=config)
        assert torch.equal(out, expected)


def test_default_plan_by_size():
    pytest.importorskip("triton")
    from moe_kernels._triton import padded_tokens as tri

    assert tri.pick_config(256, 256, 5120).path == "scan"  # FBGEMM's test shapes
    assert tri.pick_config(65536, 65536 * 8, 2048).path == "sorted"


# --------------------------------------------------------------------------------------------
# custom op: opcheck, torch.compile, the eager fast path


def test_opcheck():
    in_tokens = rand((2, 12, 10), torch.bfloat16, 25)
    counts = torch.tensor([3, 1, 4, 2])
    indices = rand_ints(-1, 7, (12,), 26, torch.int32)
    op = torch.ops.moe_kernels.scatter_add_padded_tokens.default
    torch.library.opcheck(op, (in_tokens, counts, indices, torch.zeros(6, 10)))
    torch.library.opcheck(op, (in_tokens.float(), counts.int(), indices.long(), torch.zeros(6, 10)))


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    in_tokens = rand((2, 16, 8), torch.float32, 27)
    counts = torch.tensor([5, 3, 0, 6])
    indices = rand_ints(0, 8, (16,), 28)

    def step(in_tokens, counts, indices, out):
        scatter_add_padded_tokens(in_tokens * 2, counts, indices, out)  # in place, then read
        return out * 3

    out_e, out_c = torch.zeros(8, 8), torch.zeros(8, 8)
    eager = step(in_tokens, counts, indices, out_e)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got = compiled(in_tokens, counts, indices, out_c)
    assert torch.equal(out_e, out_c) and out_c.ne(0).any()
    assert torch.equal(eager, got)


def test_direct_eager_path_matches_custom_op(monkeypatch):

    in_tokens = rand((2, 9, 6), torch.bfloat16, 29)
    counts, indices = torch.tensor([4, 5]), rand_ints(0, 5, (9,), 30)
    out_op = torch.zeros(5, 6)
    scatter_add_padded_tokens(in_tokens, counts, indices, out_op)
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    out = torch.zeros(5, 6)
    version = out._version
    scatter_add_padded_tokens(in_tokens, counts, indices, out)
    assert out._version > version  # in-place update visible to autograd's checks
    assert torch.equal(out, out_op) and out.ne(0).any()


# --------------------------------------------------------------------------------------------
# bad input: a clear error naming the argument, before anything runs; out_tokens untouched


def _bad_cases():
    x = torch.rand(2, 6, 4)
    c = torch.tensor([2, 1, 3, 0])
    i = torch.arange(6, dtype=torch.int32)
    o = torch.rand(6, 4)
    return o, [
        ("in_tokens", TypeError, lambda: scatter_add_padded_tokens(x.int(), c, i, o)),
        ("in_tokens", TypeError, lambda: scatter_add_padded_tokens(None, c, i, o)),
        ("in_tokens", ValueError, lambda: scatter_add_padded_tokens(x[0], c, i, o)),
        ("in_tokens", ValueError, lambda: scatter_add_padded_tokens(x[:, :, :3], c, i, o)),
        ("in_tokens", ValueError, lambda: scatter_add_padded_tokens(x[:0], c[:0], i, o)),
        ("in_tokens", ValueError, lambda: scatter_add_padded_tokens(x.to("meta"), c, i, o)),
        ("in_tokens", TypeError, lambda: scatter_add_padded_tokens(x, c, i, o.long())),
        ("token_counts", TypeError, lambda: scatter_add_padded_tokens(x, c.float(), i, o)),
        ("token_counts", ValueError, lambda: scatter_add_padded_tokens(x, c[None], i, o)),
        ("token_counts", ValueError, lambda: scatter_add_padded_tokens(x, c[:3], i, o)),
        ("token_counts", ValueError, lambda: scatter_add_padded_tokens(x, c.to("meta"), i, o)),
        ("token_indices", TypeError, lambda: scatter_add_padded_tokens(x, c, i.float(), o)),
        ("token_indices", ValueError, lambda: scatter_add_padded_tokens(x, c, i[:5], o)),
        ("token_indices", ValueError, lambda: scatter_add_padded_tokens(x, c, i[None], o)),
        ("token_indices", ValueError, lambda: scatter_add_padded_tokens(x, c, i.to("meta"), o)),
        ("out_tokens", TypeError, lambda: scatter_add_padded_tokens(x, c, i, o.short())),
        ("out_tokens", ValueError, lambda: scatter_add_padded_tokens(x, c, i, o[0])),
        ("out_tokens", TypeError, lambda: scatter_add_padded_tokens(x, c, i, o.numpy())),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases()[1])))
def test_bad_input_raises_naming_argument(case, monkeypatch):
    from moe_kernels import padded_tokens

    def never(*args, **kwargs):
        raise AssertionError("ran before the arguments were checked")

    monkeypatch.setattr(padded_tokens.scatter_add_padded_tokens_op, "call", never)
    out, cases = _bad_cases()
    before = out.clone()
    name, exc, fn = cases[case]
    with pytest.raises(exc, match=name):
        fn()
    assert torch.equal(out, before)


# --------------------------------------------------------------------------------------------
# sm_90a: every GPU launch the launcher picks compiles, 16-byte vectors where they can be

# (EP, T_K, D, E, T, out dtype, in dtype, index dtype): FBGEMM's test shapes, odd D, E not a
# power of two, more positions than rows (top-k), integer tokens, the big shape (sorted plan)
GPU_SHAPES = [
    (2, 64, 5120, 16, 64, torch.bfloat16, torch.bfloat16, torch.int32),
    (16, 256, 5120, 128, 256, torch.bfloat16, torch.bfloat16, torch.int32),
    (8, 128, 5120, 128, 128, torch.bfloat16, torch.bfloat16, torch.int64),
    (8, 2048, 2048, 320, 256, torch.float32, torch.bfloat16, torch.int32),
    (4, 1000, 130, 96, 1000, torch.float16, torch.float32, torch.int64),
    (8, 256, 4096, 16, 256, torch.int64, torch.int32, torch.int32),
    (8, 65536 * 8, 2048, 128, 65536, torch.bfloat16, torch.bfloat16, torch.int32),
]


@pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without the interpreter")
def test_launches_compile_for_sm90(monkeypatch):
    pytest.importorskip("triton")
    import re

    from moe_kernels._triton import padded_tokens as tri
    from moe_kernels._triton import tokens as tok

    calls = []
    for ep, tk, d, e, t, out_dtype, in_dtype, idx_dtype in GPU_SHAPES:
        args = (
            torch.empty(t, d, dtype=out_dtype, device="meta"),
            torch.empty(ep, tk, d, dtype=in_dtype, device="meta"),
            torch.empty(e, dtype=torch.int32, device="meta"),
            torch.empty(tk, dtype=idx_dtype, device="meta"),
        )
        calls.append(lambda a=args: tri.scatter_add_padded(*a))
    compiled = compile_launches([tri._scatter_scan, tok._scatter_add], calls, monkeypatch)
    assert len(compiled) == len(GPU_SHAPES)
    assert sum("BLOCK_P" in cx for cx, _, _ in compiled) == len(GPU_SHAPES) - 1  # one sorted
    for cx, args, ptx in compiled:
        row_bytes = args["D"] * args["in_ptr"].element_size()
        if "BLOCK_P" in cx and cx.get("stride_id") == 1 and row_bytes % 16 == 0:
            assert re.search(r"ld\.global[\w.:]*\.v4\.b32", ptx), cx
        assert "atom.global.add.f" not in ptx and "red.global.add.f" not in ptx  # no float atomics
