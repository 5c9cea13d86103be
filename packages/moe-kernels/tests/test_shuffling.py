"""``combine_shuffling`` / ``split_shuffling`` against chunk-slicing loop oracles (FBGEMM's test
style), on the torch reference path (TRITON_INTERPRET=0) and on the Triton kernel in the
interpreter (TRITON_INTERPRET=1), plus sm_90a compiles of the GPU launches (no GPU needed).

The ops copy bits, so every comparison is exact, interpreter included.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_kernels import _dispatch
from moe_kernels._dispatch import INTERPRET, use_triton
from moe_kernels.shuffling import CombinedTokens, combine_shuffling, split_shuffling
from moe_kernels.testing import (
    compile_launches,
    oracle_fbgemm_combine_shuffling,
    oracle_shuffle,
    oracle_shuffle_chunks,
    oracle_shuffle_counts,
)

CPU = torch.device("cpu")
KERNEL = use_triton(CPU)  # the interpreter runs the kernel; else the reference


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype, seed):
    return (torch.randn(shape, generator=gen(seed)) + 0.25).to(dtype)  # random, almost never zero


def random_counts(num_rows, num_ranks, num_cols, seed, dtype=torch.int32):
    """FBGEMM's test counts: a random split of num_rows into EP x E chunks (many empty)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, num_rows + 1, (num_ranks * num_cols + 1,), generator=g))[0]
    cuts[0], cuts[-1] = 0, num_rows
    return (cuts[1:] - cuts[:-1]).reshape(num_ranks, num_cols).to(dtype)


def padded_counts(block, num_ranks, num_cols, seed, dtype=torch.int32):
    """Each rank's counts a random split of at most ``block`` rows."""
    rows = [
        random_counts(block - (r * 3) % (block + 1), 1, num_cols, seed + r)
        for r in range(num_ranks)
    ]
    return torch.cat(rows).to(dtype)


# --------------------------------------------------------------------------------------------
# the oracles: moe_kernels.testing's oracle_shuffle (python loops over (rank, expert)
# chunks, row by row; the documented rules for counts that break the contract)


def check(tokens, counts, start=None, end=None, padded=False):
    s = 0 if start is None else start
    e = counts.shape[1] if end is None else end
    out, out_counts = combine_shuffling(tokens, counts, start, end, padded)
    assert torch.equal(out, oracle_shuffle(tokens, counts, s, e, padded, True))
    assert torch.equal(out_counts, oracle_shuffle_counts(counts, s, e))
    back = split_shuffling(tokens, counts, start, end, padded)
    assert torch.equal(back, oracle_shuffle(tokens, counts, s, e, padded, False))
    return out, back


# --------------------------------------------------------------------------------------------
# semantics

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_rows", "dim", "num_ranks", "num_cols", "start", "end"),
    [
        (37, 13, 4, 4, 0, 4),  # dense: all columns local, odd D
        (50, 20, 2, 6, 1, 4),  # sparse: experts [1, 4) of 6
        (23, 8, 1, 3, 0, 3),  # EP = 1
        (41, 5, 3, 5, 2, 5),  # E = 5, EP = 3: nothing a power of two
        (30, 16, 4, 7, 6, 7),  # one local expert, the last
    ],
)
@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64])
def test_matches_oracle(dtype, num_rows, dim, num_ranks, num_cols, start, end, counts_dtype):
    tokens = rand((num_rows, dim), dtype, num_rows)
    counts = random_counts(num_rows, num_ranks, num_cols, dim, counts_dtype)
    out, _ = check(tokens, counts, start, end)
    fb = oracle_fbgemm_combine_shuffling(tokens, counts, start, end)
    assert torch.equal(out[: fb.shape[0]], fb)  # FBGEMM's own check: the rows it writes
    assert not out[fb.shape[0] :].any()  # ours: the rest is zero


@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("num_ranks", "num_cols", "start", "end"), [(4, 3, 0, 3), (2, 6, 1, 4)])
def test_padded_matches_oracle(counts_dtype, num_ranks, num_cols, start, end):
    block = 11
    tokens = rand((num_ranks * block, 9), torch.bfloat16, 1)
    counts = padded_counts(block, num_ranks, num_cols, 2, counts_dtype)
    assert (counts.sum(1) <= block).all() and (counts.sum(1) < block).any()
    check(tokens, counts, start, end, padded=True)


def test_split_undoes_combine():
    num_ranks, num_cols, start, end = 4, 8, 1, 3
    counts = random_counts(60, num_ranks, num_cols, 3)
    tokens = rand((60, 12), torch.float32, 4)
    combined, _ = combine_shuffling(tokens, counts, start, end)
    back = split_shuffling(combined, counts, start, end)
    # back: the local chunks of tokens at their rank-first rows, zero elsewhere
    mask = torch.zeros(60, dtype=torch.bool)
    for b, _, n in oracle_shuffle_chunks(counts, start, end, 60, False).values():
        mask[b : b + n] = True
    assert 0 < int(mask.sum()) < 60
    assert torch.equal(back[mask], tokens[mask]) and not back[~mask].any()


@pytest.mark.parametrize(
    "counts",
    [
        torch.zeros(3, 4, dtype=torch.int32),  # all zero
        torch.tensor([[0, 5, 0, 2], [0, 0, 0, 0], [4, 0, 0, 1]]),  # empty experts and an empty rank
        torch.tensor([[3, 1, 2, 0], [2, 2, 0, 3], [0, 0, 0, 0]]),
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_empty_experts_and_ranks(counts, padded):
    tokens = rand((21, 10), torch.bfloat16, 5)
    for start, end in [(0, 4), (1, 3), (2, 2)]:
        check(tokens, counts, start, end, padded)


def test_empty_problems():
    counts = torch.zeros(2, 3, dtype=torch.int64)
    out, c = combine_shuffling(torch.empty(0, 8), counts)
    assert out.shape == (0, 8) and torch.equal(c, torch.zeros(4, dtype=torch.int64))
    assert split_shuffling(torch.empty(0, 8), counts, 1, 2).shape == (0, 8)
    tokens = rand((6, 0), torch.float32, 6)
    counts = torch.tensor([[2, 1], [0, 3]])
    out, c = combine_shuffling(tokens, counts, 0, 1)
    assert out.shape == (6, 0) and c.tolist() == [2, 2]
    out, c = combine_shuffling(rand((5, 3), torch.float32, 7), torch.empty(2, 0, dtype=torch.int32))
    assert not out.any() and c.tolist() == [0]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
        torch.int64,
        torch.uint8,
        torch.complex64,
    ],
)
def test_any_dtype_is_copied_bit_for_bit(dtype):
    """Random bytes (NaNs with any payload and sign included) come out as they went in."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (19, 7 * size), generator=gen(8), dtype=torch.uint8)
    raw[:, size - 1 :: size] |= 0x7F  # top bytes: many NaN / inf patterns in float dtypes
    counts = random_counts(19, 2, 3, 9)
    for padded in (False, True):
        out = combine_shuffling(raw[:18].view(dtype), counts, 1, 3, padded).tokens
        back = split_shuffling(raw[:18].view(dtype), counts, 1, 3, padded)
        assert torch.equal(
            out.view(torch.uint8), oracle_shuffle(raw[:18], counts, 1, 3, padded, True)
        )
        assert torch.equal(
            back.view(torch.uint8), oracle_shuffle(raw[:18], counts, 1, 3, padded, False)
        )


def test_bool_tokens():
    tokens = rand((19, 5), torch.float32, 31) > 0.3
    check(tokens, random_counts(19, 2, 3, 32), 0, 2)


def test_strided_tokens_and_counts():
    base = rand((40, 30), torch.bfloat16, 10)
    tokens = base[:, 3::2]  # strided rows and columns
    counts = random_counts(40, 3, 4, 11).t().contiguous().t()  # column-major counts
    assert not tokens.is_contiguous() and not counts.is_contiguous()
    out, back = check(tokens, counts, 1, 4)
    ref_out, _ = combine_shuffling(tokens.contiguous(), counts.contiguous(), 1, 4)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("padded", [False, True])
def test_counts_breaking_the_contract_are_memory_safe(padded):
    """Undefined by contract, but clamped: counts summing past T, negative counts, ranks
    overflowing their padded block. The result follows the documented clipping rules (the oracle)
    and is the same on every backend."""
    tokens = rand((24, 6), torch.float32, 12)
    for counts in (
        torch.tensor([[9, 4, 7], [8, 6, 5]]),  # 39 rows for 24
        torch.tensor([[-3, 4, 7], [2, -1, 5]]),
        torch.tensor([[2**30, 1, 1], [1, 2**30, 3]], dtype=torch.int64),
    ):
        check(tokens, counts, 0, 3, padded)
        check(tokens, counts, 1, 2, padded)


def test_fbgemm_call_forms():
    """The forms of FBGEMM's shuffling_test: dense (EP, E // EP) counts over [0, E // EP), and
    sparse (EP, E) counts with experts [1, 1 + E // EP); positional and keyword arguments."""
    num_experts, num_ranks, num_tokens = 16, 4, 123
    tokens = rand((num_tokens, 40), torch.bfloat16, 13)
    dense = random_counts(num_tokens, num_ranks, num_experts // num_ranks, 14)
    out, counts = combine_shuffling(tokens, dense, expert_start=0, expert_end=4)
    assert torch.equal(out[:num_tokens], oracle_fbgemm_combine_shuffling(tokens, dense, 0, 4))
    assert torch.equal(counts[:-1], dense.sum(0).int()) and counts[-1] == num_tokens
    assert torch.equal(split_shuffling(out, dense, expert_start=0, expert_end=4), tokens)
    sparse_tokens = rand((num_tokens * num_ranks, 40), torch.bfloat16, 15)
    sparse = random_counts(num_tokens * num_ranks, num_ranks, num_experts, 16)
    out, counts = combine_shuffling(sparse_tokens, sparse, 1, 1 + num_experts // num_ranks, False)
    n = int(counts[-1])
    assert torch.equal(out[:n], oracle_fbgemm_combine_shuffling(sparse_tokens, sparse, 1, 5))
    back = split_shuffling(sparse_tokens, sparse, 1, 5, False, True)  # init_with_zeros
    assert torch.equal(back, split_shuffling(sparse_tokens, sparse, 1, 5))
    # FBGEMM's sparse split check: re-slicing the output rank-major gives back the input rows
    assert torch.equal(oracle_fbgemm_combine_shuffling(back, sparse, 1, 5), sparse_tokens[:n])


def test_named_result_and_is_balanced_alias():
    tokens = rand((16, 4), torch.float32, 17)
    counts = torch.full((4, 2), 2, dtype=torch.int32)  # balanced: every rank holds T // EP
    res = combine_shuffling(tokens, counts)
    assert isinstance(res, CombinedTokens) and isinstance(res, tuple)
    t, c = res
    assert t is res.tokens and c is res.token_counts
    for flag in (True, False):  # balanced counts: padded and unpadded layouts coincide
        bal = combine_shuffling(tokens, counts, is_balanced=flag)
        assert torch.equal(bal.tokens, res.tokens)
        assert torch.equal(
            split_shuffling(tokens, counts, is_balanced=flag), split_shuffling(tokens, counts)
        )
    uneven = torch.tensor([[1, 2], [3, 0], [0, 0], [2, 2]])
    assert torch.equal(
        combine_shuffling(tokens, uneven, is_balanced=True).tokens,
        combine_shuffling(tokens, uneven, is_padded=True).tokens,
    )


def test_deterministic_and_inputs_untouched():
    tokens = rand((64, 24), torch.bfloat16, 18)
    counts = random_counts(64, 4, 6, 19)
    before = (tokens.clone(), counts.clone())
    first = combine_shuffling(tokens, counts, 1, 5)
    second = combine_shuffling(tokens, counts, 1, 5)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(split_shuffling(tokens, counts, 1, 5), split_shuffling(tokens, counts, 1, 5))
    assert torch.equal(tokens, before[0]) and torch.equal(counts, before[1])


def test_not_differentiable():
    tokens = rand((8, 4), torch.float32, 20).requires_grad_()
    counts = torch.tensor([[2, 2], [1, 3]])
    out = combine_shuffling(tokens, counts).tokens
    with pytest.raises(RuntimeError, match="combine_shuffling"):
        out.sum().backward()


# --------------------------------------------------------------------------------------------
# kernel launch configs (the interpreter runs them; the reference path checks the tables)


CONFIGS = [(4, 16, 1, 1, 4), (2, 16, 2, 2, 4), (8, 32, 1, 4, 4), (1, 16, 3, 8, 2)]
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the kernel runs under TRITON_INTERPRET=1")


def owned_rows(tokens, counts, start, end, padded, combine):
    """(T,) bool: the output rows some chunk holds (the oracle run on all-ones tokens)."""
    ones = torch.ones(tokens.shape[0], 1, dtype=torch.int32)
    return oracle_shuffle(ones, counts, start, end, padded, combine)[:, 0] == 1


def check_kernel(tokens, counts, start, end, padded, config=None):
    from moe_kernels._triton import shuffling as tri

    for combine in (True, False):
        out, c = tri.shuffle(tokens, counts, start, end, padded, combine, config=config)
        want = oracle_shuffle(tokens, counts, start, end, padded, combine)
        assert torch.equal(out, want)
        if combine:
            assert torch.equal(c, oracle_shuffle_counts(counts, start, end))
        # FBGEMM's contract: the owned rows alone, the others left as torch.empty made them
        out, c = tri.shuffle(tokens, counts, start, end, padded, combine, config, zero=False)
        owned = owned_rows(tokens, counts, start, end, padded, combine)
        assert torch.equal(out[owned], want[owned])
        if combine:
            assert torch.equal(c, oracle_shuffle_counts(counts, start, end))


@needs_kernel
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_configs(cfg, padded):
    """Row tiles, column splits (d_iters < column chunks, a last program past D), local experts
    BLOCK_G at a time (the carries across blocks); padded ranks overflowing their block."""
    from moe_kernels._triton import shuffling as tri

    tokens = rand((20, 40), torch.bfloat16, 21)
    check_kernel(tokens, random_counts(18, 4, 7, 22), 1, 6, padded, tri.ShuffleConfig(*cfg))


@needs_kernel
def test_kernel_many_ranks():
    """EP = 64: the rank-first pass over the (EP, E) counts takes several column blocks."""
    tokens = rand((64, 3), torch.int32, 23)
    for padded in (False, True):
        check_kernel(tokens, random_counts(60, 64, 40, 24), 5, 30, padded)


# --------------------------------------------------------------------------------------------
# custom ops: opcheck, torch.compile, the eager fast path


def test_opcheck():
    tokens = rand((20, 12), torch.bfloat16, 25)
    counts = random_counts(20, 2, 4, 26)
    ops = torch.ops.moe_kernels
    # (zeroing the rows no chunk holds: opcheck compares whole outputs, and without zeroing the
    # kernel leaves those rows as torch.empty made them)
    for args in ((tokens, counts, 1, 3, False, True), (tokens, counts.long(), 0, 4, True, True)):
        torch.library.opcheck(ops.combine_shuffling.default, args)
        torch.library.opcheck(ops.split_shuffling.default, args)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])],
)  # fmt: skip
def test_compile_fullgraph_matches_eager(device):
    """Compiled == eager bit for bit. On CUDA Inductor emits the kernel in its own code (the
    comparison can fail there); on CPU the op stays opaque, so this checks that the step traces
    whole (``fullgraph``) around it."""
    torch._dynamo.reset()
    tokens = rand((32, 16), torch.float32, 27).to(device)
    counts = random_counts(32, 4, 4, 28).to(device)

    def step(tokens, counts):
        grouped, per_expert = combine_shuffling(tokens, counts, expert_start=1, expert_end=3)
        back = split_shuffling(grouped * 2, counts, 1, 3)
        return grouped, per_expert, back + 1, combine_shuffling(tokens, counts, is_padded=True)[0]

    eager = step(tokens, counts)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(tokens, counts)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


@pytest.mark.parametrize("padded", [False, True])
def test_unowned_rows_left_unwritten_on_request(padded):
    """``zero_unowned=False`` (FBGEMM's contract): the owned rows as always; the others are
    unspecified (zero on the reference path, untouched by the kernel); ``init_with_zeros``
    zeroes them anyway; a program past the owned rows stops early without losing counts."""
    tokens = rand((48, 24), torch.bfloat16, 41)
    counts = padded_counts(12, 4, 6, 42) if padded else random_counts(30, 4, 6, 42)
    for start, end in ((0, 6), (2, 3), (5, 5)):
        out, c = combine_shuffling(tokens, counts, start, end, padded, zero_unowned=False)
        owned = owned_rows(tokens, counts, start, end, padded, True)
        want = oracle_shuffle(tokens, counts, start, end, padded, True)
        assert torch.equal(out[owned], want[owned])
        assert torch.equal(c, oracle_shuffle_counts(counts, start, end))
        back = split_shuffling(tokens, counts, start, end, padded, zero_unowned=False)
        owned = owned_rows(tokens, counts, start, end, padded, False)
        want = oracle_shuffle(tokens, counts, start, end, padded, False)
        assert torch.equal(back[owned], want[owned])
        zeroed = split_shuffling(tokens, counts, start, end, padded, True, zero_unowned=False)
        assert torch.equal(zeroed, want)
    with pytest.raises(TypeError, match="zero_unowned"):
        combine_shuffling(tokens, counts, zero_unowned=0)
    with pytest.raises(TypeError, match="zero_unowned"):
        split_shuffling(tokens, counts, zero_unowned=None)


def test_direct_eager_path_matches_custom_op(monkeypatch):

    tokens = rand((18, 6), torch.bfloat16, 29)
    counts = random_counts(18, 3, 3, 30)
    expected = (combine_shuffling(tokens, counts, 0, 2), split_shuffling(tokens, counts, 1, 3))
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    got = (combine_shuffling(tokens, counts, 0, 2), split_shuffling(tokens, counts, 1, 3))
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0], strict=True))
    assert torch.equal(expected[1], got[1])


# --------------------------------------------------------------------------------------------
# bad input: a clear error naming the argument, before anything runs


def _bad_cases():
    x = torch.rand(12, 8)
    c = torch.tensor([[2, 1, 3], [1, 2, 3]], dtype=torch.int32)
    return [
        ("tokens", TypeError, lambda: combine_shuffling(x.tolist(), c)),
        ("tokens", ValueError, lambda: combine_shuffling(x[0], c)),
        ("tokens", ValueError, lambda: split_shuffling(x[None], c)),
        ("tokens", TypeError, lambda: combine_shuffling(x.to(torch.complex128), c)),
        ("tokens", ValueError, lambda: combine_shuffling(x[:11], c, is_padded=True)),
        ("token_counts", TypeError, lambda: combine_shuffling(x, c.float())),
        ("token_counts", TypeError, lambda: split_shuffling(x, c.short())),
        ("token_counts", ValueError, lambda: combine_shuffling(x, c[0])),
        ("token_counts", ValueError, lambda: combine_shuffling(x, c[:0])),
        ("token_counts", ValueError, lambda: combine_shuffling(x, c.to("meta"))),
        ("token_counts", TypeError, lambda: combine_shuffling(x, None)),
        ("expert_start", ValueError, lambda: combine_shuffling(x, c, expert_start=-1)),
        ("expert_start", ValueError, lambda: split_shuffling(x, c, 4, 4)),
        ("expert_start", TypeError, lambda: combine_shuffling(x, c, expert_start=1.0)),
        ("expert_end", ValueError, lambda: combine_shuffling(x, c, expert_end=4)),
        ("expert_end", ValueError, lambda: split_shuffling(x, c, 2, 1)),
        ("expert_end", TypeError, lambda: combine_shuffling(x, c, 0, True)),
        ("is_padded", TypeError, lambda: combine_shuffling(x, c, is_padded=1)),
        ("is_balanced", TypeError, lambda: split_shuffling(x, c, is_balanced="yes")),
        ("is_balanced", ValueError, lambda: combine_shuffling(x, c, 0, 3, True, is_balanced=False)),
        ("init_with_zeros", TypeError, lambda: split_shuffling(x, c, init_with_zeros=None)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_argument(case, monkeypatch):
    from moe_kernels import shuffling

    def never(*args, **kwargs):
        raise AssertionError("ran before the arguments were checked")

    monkeypatch.setattr(shuffling, "_run", never)
    name, exc, fn = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        fn()


# --------------------------------------------------------------------------------------------
# sm_90a: every GPU launch the launcher picks compiles, 16-byte vectors where they can be


# (T, D, dtype, EP, counts columns, start, end, padded): FBGEMM's test shapes, the big EP shape,
# odd D, E not a power of two, many ranks, every element size
GPU_SHAPES = [
    (123, 5120, torch.bfloat16, 8, 16, 0, 16, False),
    # FBGEMM's E 80 / dp 16 / mp 1 padded case, the last rank: one local expert of 16 ranks (a
    # one-element scan tile failed Triton 3.5's and 3.6's compilers)
    (32, 5120, torch.bfloat16, 16, 16, 15, 16, True),
    # one local expert of 80 at 16 ranks, and two beside 8 ranks (Triton 3.6: ScanOpToLLVM)
    (64, 2048, torch.bfloat16, 16, 80, 5, 6, True),
    (64, 2048, torch.bfloat16, 8, 16, 2, 4, False),
    (16384 * 8, 5120, torch.bfloat16, 8, 128, 1, 17, False),
    (65536 * 8, 2048, torch.bfloat16, 8, 16, 0, 16, False),
    (65536 * 8, 2048, torch.bfloat16, 8, 128, 16, 32, True),
    (1, 5120, torch.bfloat16, 4, 4, 0, 4, False),
    (3000, 130, torch.float32, 8, 320, 40, 80, True),
    (4096, 2048, torch.float16, 8, 96, 0, 96, False),
    (777, 7168, torch.float8_e4m3fn, 64, 320, 0, 320, False),
    (512, 1024, torch.float64, 2, 3, 1, 2, True),
]


@pytest.mark.skipif(INTERPRET, reason="GPU launch plans only without the interpreter")
def test_launches_compile_for_sm90(monkeypatch):
    pytest.importorskip("triton")
    from moe_kernels._triton import shuffling as tri

    calls = []
    for t, d, dtype, ep, cols, start, end, padded in GPU_SHAPES:
        tokens = torch.empty(t, d, dtype=dtype, device="meta")
        for counts_dtype, combine in ((torch.int32, True), (torch.int64, False)):
            counts = torch.empty(ep, cols, dtype=counts_dtype, device="meta")
            calls.append(lambda a=(tokens, counts, start, end, padded, combine): tri.shuffle(*a))
            calls.append(lambda a=(tokens, counts, start, end, padded, combine): tri.shuffle(
                *a, zero=False))  # fmt: skip
    strided = torch.empty(300, 2 * 2048, dtype=torch.bfloat16, device="meta")[:, ::2]
    counts = torch.empty(4, 8, dtype=torch.int32, device="meta")
    calls.append(lambda: tri.shuffle(strided, counts, 0, 8, False, True))
    compiled = compile_launches([tri._shuffle], calls, monkeypatch)
    assert len(compiled) >= len(GPU_SHAPES)
    assert len({(cx["BLOCK_T"], cx["BLOCK_D"], cx["D_ITERS"]) for cx, _, _ in compiled}) >= 4
    vectors = 0
    for cx, args, ptx in compiled:
        row_bytes = args["D"] * args["in_ptr"].element_size()
        if cx.get("stride_id") == 1 and row_bytes % 16 == 0 and cx["BLOCK_D"] >= 16:
            # rows of 16-byte multiples, contiguous: 16-byte vectors both ways
            assert re.search(r"ld\.global[\w.:]*\.(v4\.b32|v2\.b64)", ptx), cx
            assert re.search(r"st\.global[\w.:]*\.(v4\.b32|v2\.b64)", ptx), cx
            vectors += 1
    assert vectors >= len(GPU_SHAPES) - 1
