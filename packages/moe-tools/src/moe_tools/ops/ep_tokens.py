"""Registry entries of FBGEMM's expert-parallel token ops: ``combine_shuffling``,
``split_shuffling``, ``scatter_add_padded_tokens``.

The shuffles' oracles walk the (rank, expert) chunks in Python and copy rows bit for bit; the
padded scatter's sums every contribution in float64 within a bound of the kernel's roundings,
then replays the contract's order of adds (a loop over the positions) bit for bit.
"""

from __future__ import annotations

import random
from functools import partial

import torch

from moe_kernels.testing import (
    oracle_scatter_add_padded,
    oracle_shuffle,
    oracle_shuffle_counts,
)
from moe_tools.ops.fp8_rows import fbgemm_fn
from moe_tools.ops.spec import (
    BF16_ULP,
    CheckFailed,
    OpSpec,
    Problem,
    Sizes,
    bits,
    expect_equal,
    expect_within,
    interpreted,
    ulps,
)

DTYPES = ("bfloat16", "float32")


def _dtype(s: Sizes, key: str, default: str) -> torch.dtype:
    return getattr(torch, s.get(key, default))


def _values(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype):
    """Normal values drawn in ``dtype`` where ``gen`` lives (no float32 copy of the big
    buffers), then moved."""
    return torch.randn(shape, generator=gen, device=gen.device, dtype=dtype).to(device)


def _random_int(high: int, gen: torch.Generator) -> int:
    """A random integer in [0, high], drawn with ``gen``."""
    return int(torch.randint(0, high + 1, (1,), generator=gen, device=gen.device))


def _split_rows(total: int, cells: int, gen: torch.Generator) -> torch.Tensor:
    """(cells,) int64 on ``gen``'s device: a random split of ``total`` rows (FBGEMM's test counts:
    sorted random cuts, many small and zero parts)."""
    cuts = torch.randint(0, total + 1, (cells - 1,), generator=gen, device=gen.device)
    edges = torch.cat([cuts.new_zeros(1), cuts.sort().values, cuts.new_full((1,), total)])
    return edges.diff()


# ----------------------------------------------------------------------------------------------
# combine_shuffling and split_shuffling


def _draw_shuffle(rng: random.Random, large: bool) -> Sizes:
    EP = rng.choice([1, 2, 4, 8])
    E = rng.choice([8, 16, 96, 128] if large else [8, 16, 96])
    padded, sparse = rng.choice([False, True]), rng.choice([False, True])
    cols = E if sparse else E // EP
    start = rng.randint(0, cols - 1) if sparse else 0
    blocks = rng.randint(1, (16384 if large else 300) // EP)
    return dict(
        T=EP * blocks if padded else rng.randint(1, 16384 if large else 300),
        D=rng.choice([64, 2048, 2050] if large else [1, 33, 130]),
        EP=EP,
        E=E,
        sparse=sparse,
        padded=padded,
        start=start,
        end=rng.randint(start, cols) if sparse else cols,
        tail=rng.random() < 0.5,
        dtype=rng.choice(DTYPES),
        counts_dtype=rng.choice(["int32", "int64"]),
    )


def _make_shuffle(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    """tokens (T, D) and counts (EP, cols): cols = E // EP local experts [0, cols), or with
    ``sparse`` all E experts and the local range [start, end) (default: the second rank's E // EP
    experts). Counts: a random split of T rows over every (rank, column) chunk, or with ``padded``
    of each rank's T // EP rows over its columns; ``tail``: short of it by up to a quarter."""
    T, D, EP, E = s["T"], s["D"], s["EP"], s["E"]
    sparse, padded = s.get("sparse", False), s.get("padded", False)
    cols = E if sparse else E // EP
    start = s.get("start", E // EP * min(1, EP - 1) if sparse else 0)
    end = s.get("end", start + E // EP)
    groups, rows = (EP, T // EP) if padded else (1, T)
    parts = []
    for _ in range(groups):
        tail = _random_int(rows // 4, gen) if s.get("tail") else 0
        parts.append(_split_rows(rows - tail, EP * cols // groups, gen))
    counts = torch.cat(parts).view(EP, cols).to(device, _dtype(s, "counts_dtype", "int32"))
    tokens = _values((T, D), gen, device, _dtype(s, "dtype", "bfloat16"))
    label = f"T={T} D={D} E={E} counts=({EP},{cols})[{start},{end}){' padded' if padded else ''}"
    label += f" {str(tokens.dtype)[6:]} {str(counts.dtype)[6:]}"
    if s.get("unwritten"):  # FBGEMM's contract: the rows no chunk holds left unwritten
        label += " zero_unowned=False"
        return Problem(label, s, (tokens, counts, start, end, padded), {"zero_unowned": False})
    return Problem(label, s, (tokens, counts, start, end, padded))


def _shuffle_oracle(combine: bool):
    def oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
        """Each chunk's rows copied bit for bit, every other row zero (``oracle_shuffle`` of the
        tokens' bits); combine's counts: the sum over ranks per local expert, then the total, in
        the counts' dtype (``oracle_shuffle_counts``)."""
        tokens, counts, start, end, padded = p.args
        got = out[0]
        if got.dtype != tokens.dtype:
            raise CheckFailed(f"tokens dtype {got.dtype} != {tokens.dtype}")
        c = counts.cpu()
        want = oracle_shuffle(bits(tokens.cpu()), c, start, end, padded, combine)
        got = bits(got.cpu())
        if p.kwargs.get("zero_unowned") is False:  # only the rows some chunk holds are defined
            ones = torch.ones(tokens.shape[0], 1, dtype=torch.int32)
            owned = oracle_shuffle(ones, c, start, end, padded, combine)[:, 0] == 1
            got, want = got[owned], want[owned]
        expect_equal("tokens vs oracle", got, want)
        if combine:
            if out[1].dtype != counts.dtype:
                raise CheckFailed(f"counts dtype {out[1].dtype} != {counts.dtype}")
            expect_equal("counts vs oracle", out[1].cpu(), oracle_shuffle_counts(c, start, end))
        return 0.0

    return oracle


def _ref_shuffling():
    from moe_kernels.reference import shuffling

    return shuffling


def _combine_reference(tokens, token_counts, expert_start, expert_end, is_padded):
    return _ref_shuffling().combine_shuffling(
        tokens, token_counts, expert_start, expert_end, is_padded
    )


def _split_reference(tokens, token_counts, expert_start, expert_end, is_padded):
    return _ref_shuffling().split_shuffling(
        tokens, token_counts, expert_start, expert_end, is_padded
    )


def _shuffle_bytes(p: Problem) -> int:
    """The local chunks' rows read, every row written (zeros past them; only the local rows
    with ``zero_unowned=False``), the counts."""
    tokens, counts, start, end, _ = p.args
    live = int(counts[:, start:end].long().clamp(min=0).sum())
    written = live if p.kwargs.get("zero_unowned") is False else tokens.shape[0]
    return (live + written) * tokens.shape[1] * tokens.element_size() + (
        counts.numel() + end - start + 1
    ) * counts.element_size()


SHUFFLE_SIZES = {
    "quick": [dict(T=2048, D=256, EP=4, E=32)],
    "full": [
        dict(T=524288, D=2048, EP=8, E=128),
        dict(T=524288, D=2048, EP=8, E=128, padded=True),
        dict(T=524288, D=2048, EP=8, E=128, sparse=True),
        dict(T=524288, D=2048, EP=8, E=128, sparse=True, unwritten=True),
    ],
}

COMBINE_SHUFFLING = OpSpec(
    name="combine_shuffling",
    sizes=SHUFFLE_SIZES,
    draw=_draw_shuffle,
    make=_make_shuffle,
    reference=_combine_reference,
    oracle=_shuffle_oracle(combine=True),
    bytes_moved=_shuffle_bytes,
    # the reference: an index_select by the row permutation searchsorted from the counts on the
    # device (no host sync)
    native=lambda p: partial(_combine_reference, *p.args),
    fbgemm=lambda ops, p: partial(fbgemm_fn("combine_shuffling"), *p.args),
)

SPLIT_SHUFFLING = OpSpec(
    name="split_shuffling",
    sizes=SHUFFLE_SIZES,
    draw=_draw_shuffle,
    make=_make_shuffle,
    reference=_split_reference,
    oracle=_shuffle_oracle(combine=False),
    bytes_moved=_shuffle_bytes,
    native=lambda p: partial(_split_reference, *p.args),
    fbgemm=lambda ops, p: partial(fbgemm_fn("split_shuffling"), *p.args),
)


# ----------------------------------------------------------------------------------------------
# scatter_add_padded_tokens


def _draw_padded(rng: random.Random, large: bool) -> Sizes:
    EP = rng.choice([1, 2, 4, 8])
    return dict(
        EP=EP,
        T=rng.randint(1, 2048 if large else 64),
        k=rng.choice([1, 2, 4]),
        D=rng.choice([64, 2048, 2050] if large else [1, 33, 130]),
        E=rng.choice([8, 16, 96, 128] if large else [8, 16, 96]),
        tail=rng.random() < 0.5,
        in_dtype=rng.choice(DTYPES),
        out_dtype=rng.choice(DTYPES),
        counts_dtype=rng.choice(["int32", "int64"]),
        index_dtype=rng.choice(["int32", "int64"]),
    )


def _make_padded(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    """FBGEMM's form: T_K = T * k positions, each token's k rows at random positions (a random
    permutation mod T); counts (E,) a random split of T_K positions (``tail``: short by up to a
    quarter, the rest padding); in_tokens (EP, T_K, D), out_tokens (T, D)."""
    EP, T, k, D, E = s["EP"], s["T"], s["k"], s["D"], s["E"]
    out_dtype = _dtype(s, "out_dtype", "bfloat16")
    if out_dtype == torch.bfloat16 and interpreted(torch.empty(0, device=device)):
        # the interpreter truncates each bf16 add (the reference rounds): one ulp per add apart,
        # beyond verify's one-ulp slack when a row gets several; one contribution per row there
        k = 1
    positions = T * k
    tail = _random_int(positions // 4, gen) if s.get("tail") else 0
    counts = _split_rows(positions - tail, E, gen)
    perm = torch.randperm(positions, generator=gen, device=gen.device) % T
    in_tokens = _values((EP, positions, D), gen, device, _dtype(s, "in_dtype", "bfloat16"))
    out_tokens = _values((T, D), gen, device, out_dtype)
    counts = counts.to(device, _dtype(s, "counts_dtype", "int32"))
    indices = perm.to(device, _dtype(s, "index_dtype", "int32"))
    label = f"EP={EP} T_K={positions} T={T} D={D} E={E} "
    label += f"{str(in_tokens.dtype)[6:]}->{str(out_tokens.dtype)[6:]}"
    return Problem(label, s, (in_tokens, counts, indices, out_tokens))


def _padded_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """Live positions p < sum(counts), each in rank e // (E // EP) of its expert e (a loop over
    the experts). (a) out[idx[p]] += in[rank, p] summed in float64: each of the kernel's adds
    rounds once to out's dtype, so a row is within one ulp of its sum of magnitudes per add
    (rows without contributions bitwise unchanged); (b) the contract's exact order replayed
    (``oracle_scatter_add_padded``: a loop over p ascending, each add in fp32 rounded to out's
    dtype): bitwise (one bf16 ulp in the interpreter, whose stores truncate; one add per bf16
    row there, see ``_make_padded``)."""
    in_tokens, counts, indices, base = p.args
    (got,) = out
    EP, positions, D = in_tokens.shape
    c = counts.cpu().tolist()
    per_rank = len(c) // EP
    ranks: list[int] = []
    for e, n in enumerate(c):
        ranks += [e // per_rank] * n
    live = min(len(ranks), positions)
    rank_of = torch.tensor(ranks[:live], dtype=torch.long)
    rows = in_tokens.cpu()[rank_of, torch.arange(live)]
    dst = indices.cpu().long()[:live]
    want = base.cpu().double().index_add(0, dst, rows.double())
    mag = base.cpu().double().abs().index_add(0, dst, rows.double().abs())
    adds = torch.zeros(base.shape[0], dtype=torch.float64).index_add(
        0, dst, torch.ones(live, dtype=torch.float64)
    )
    bound = adds[:, None] * ulps(mag, base.dtype) * (1 + 2.0**-8)
    worst = expect_within("vs oracle", got, want, bound)
    seq = oracle_scatter_add_padded(in_tokens.cpu(), counts.cpu(), indices.cpu(), base.cpu())
    rel = BF16_ULP if got.dtype == torch.bfloat16 and interpreted(got) else 0.0
    expect_equal("vs the sequential adds", got, seq, rel=rel)
    return worst


def _padded_native(p: Problem):
    """Each live position's row (gathered on the device), then ``index_add_`` (atomics, any
    order: not deterministic)."""
    from moe_kernels.reference.padded_tokens import position_rows

    in_tokens, counts, indices, out = p.args
    EP, positions, D = in_tokens.shape
    flat = in_tokens.reshape(EP * positions, D)
    dst = indices.long()

    def index_add() -> torch.Tensor:
        rows, total = position_rows(counts, EP, positions, positions)
        live = torch.arange(positions, device=flat.device) < total
        src = torch.where(live[:, None], flat.index_select(0, rows), 0).to(out.dtype)
        return out.index_add_(0, dst, src)

    return index_add


def _padded_reference(in_tokens, token_counts, token_indices, out_tokens):
    from moe_kernels.reference import padded_tokens

    padded_tokens.scatter_add_padded_tokens(in_tokens, token_counts, token_indices, out_tokens)


def _padded_bytes(p: Problem) -> int:
    """The live positions' rows read, out read and written, the indices and counts."""
    in_tokens, counts, indices, out = p.args
    live = min(int(counts.long().clamp(min=0).sum()), in_tokens.shape[1])
    return (
        live * in_tokens.shape[2] * in_tokens.element_size()
        + 2 * out.numel() * out.element_size()
        + indices.numel() * indices.element_size()
        + counts.numel() * counts.element_size()
    )


SCATTER_ADD_PADDED_TOKENS = OpSpec(
    name="scatter_add_padded_tokens",
    sizes={
        "quick": [dict(EP=4, T=256, k=2, D=256, E=16)],
        "full": [dict(EP=8, T=65536, k=8, D=2048, E=128)],
    },
    draw=_draw_padded,
    make=_make_padded,
    reference=_padded_reference,
    oracle=_padded_oracle,
    bytes_moved=_padded_bytes,
    native=_padded_native,
    fbgemm=lambda ops, p: partial(fbgemm_fn("scatter_add_padded_tokens"), *p.args),
    mutates=(3,),
)

ENTRIES = (COMBINE_SHUFFLING, SPLIT_SHUFFLING, SCATTER_ADD_PADDED_TOKENS)
