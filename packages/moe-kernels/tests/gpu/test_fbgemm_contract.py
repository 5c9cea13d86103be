"""FBGEMM gen_ai's MoE test contract, checked against our drop-in ops on the GPU (issue 44).

FBGEMM's tests (``fbgemm_gpu/experimental/gen_ai/test/moe/`` in pytorch/FBGEMM: shuffling,
gather-scatter and activation tests; MSLK's ``test/moe/`` holds copies) define what a drop-in
must do. This module checks the same properties at the same shapes, eager and under
``torch.compile(fullgraph=True)``, with partial ranges, against plain-torch oracles written here
(``docs/fbgemm-contract.md`` maps their cases to ours). Each test checks, in order:

1. FBGEMM's contract: what their test asserts (their tolerances, their tie freedom: the pairs
   of one expert in any order, any top-k choice among tied scores);
2. ours, where the docstrings promise more: exact (expert, token) order with ties to the lower
   expert, bitwise results on the GPU, zero rows where FBGEMM leaves memory unwritten,
   sequential fp32 scatter-add order.

A failure message starts with ``FBGEMM:`` or ``ours:`` accordingly.

FBGEMM samples its grids with hypothesis (100 examples a test); this module takes a fixed,
seeded sample of each grid in which every value of every axis appears: 288 cases, under four
minutes on one H100 with a cold Triton cache (mostly Triton compiling index_shuffling's plans).

On the GPU: ``pytest -m gpu packages/moe-kernels/tests/gpu/test_fbgemm_contract.py``.
Without a GPU, ``MOE_CONTRACT_CPU=1`` runs a small subset at reduced sizes on the CPU, through
the Triton kernels in the interpreter (``TRITON_INTERPRET=1``, set here when unset: run this
file alone, since the interpreter must be chosen before ``moe_kernels`` is first imported). The
interpreter truncates fp32 -> bf16 casts, so bitwise bf16 checks allow one bf16 ulp there.
"""

from __future__ import annotations

import os

CPU_SMOKE = os.environ.get("MOE_CONTRACT_CPU", "") not in ("", "0")
if CPU_SMOKE:  # before moe_kernels (and triton) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import moe_kernels as mk  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CPU_SMOKE and not torch.cuda.is_available(),
        reason="needs a CUDA device (MOE_CONTRACT_CPU=1 runs a CPU smoke subset)",
    ),
]

DEV = torch.device("cpu" if CPU_SMOKE or not torch.cuda.is_available() else "cuda")
ON_GPU = DEV.type == "cuda"
BF16, FP32, INT32 = torch.bfloat16, torch.float32, torch.int32
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# On the CPU the sizes shrink to these caps (the interpreter runs every program in numpy).
CPU_CAPS = {"T": 24, "D": 40, "batch": 6}
# In the CPU smoke run each test keeps this many eager cases and one compiled case.
CPU_EAGER_CASES = 2


def _size(name: str, value: int) -> int:
    return value if ON_GPU else min(value, CPU_CAPS[name])


# ---------------------------------------------------------------------------------------------
# case grids


def spread(axes: dict[str, list], count: int, seed: int) -> list[dict]:
    """``count`` distinct combinations of the axes' values (a seeded sample of their product) in
    which every value of every axis appears; the whole product when it is not larger."""
    product = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    if count >= len(product):
        return product
    rng = random.Random(seed)
    for _ in range(1000):
        picks = rng.sample(product, count)
        if all({repr(c[a]) for c in picks} == {repr(v) for v in vals} for a, vals in axes.items()):
            return picks
    raise AssertionError(f"no sample of {count} covers every value of {list(axes)}")


def _fmt(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def params(cases: list[dict]) -> list:
    """pytest params with readable ids; on the CPU, the first few eager cases and one compiled
    case."""
    if not ON_GPU:
        eager = [c for c in cases if not c.get("compiled")][:CPU_EAGER_CASES]
        compiled = [c for c in cases if c.get("compiled")][:1]
        cases = eager + compiled
    return [pytest.param(c, id="-".join(f"{k}={_fmt(v)}" for k, v in c.items())) for c in cases]


def with_compiled(eager: list[dict], compiled: list[dict]) -> list[dict]:
    return [{**c, "compiled": False} for c in eager] + [{**c, "compiled": True} for c in compiled]


# ---------------------------------------------------------------------------------------------
# compiling


@contextlib.contextmanager
def _recompiles_allowed():
    """Many shapes and constants through one compiled function: raise dynamo's recompile limit,
    and fail rather than fall back to eager when it is hit (a silent eager run would not test
    the compiled path)."""
    cfg = torch._dynamo.config
    patch = {"recompile_limit": 256, "accumulated_recompile_limit": 4096}
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    with cfg.patch(**patch):
        yield


_COMPILED: dict = {}


def maybe_compiled(fn, compiled: bool, dynamic: bool | None = None):
    """``fn`` itself, or ``torch.compile(fn, fullgraph=True)`` (one compiled wrapper per fn)."""
    if not compiled:
        return fn
    key = (fn, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=True, dynamic=dynamic)

    def run(*args, **kwargs):
        with _recompiles_allowed():
            return _COMPILED[key](*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# comparisons


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (7 stored mantissa bits), as fp32."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126))) - 7)


def assert_within_bf16_ulps(actual, expected, ulps: int, who: str, magnitude=None) -> None:
    """|actual - expected| <= ulps bf16 ulps of ``magnitude`` (default: of expected)."""
    a, e = actual.float(), expected.float()
    bad = (a - e).abs() > ulps * bf16_ulp(e if magnitude is None else magnitude)
    assert not bool(bad.any()), (
        f"{who}: {int(bad.sum())} elements off by more than {ulps} bf16 ulp, "
        f"max error {float((a - e).abs().max())}"
    )


def assert_bits(actual, expected, who: str = "ours", roundings: int = 1, magnitude=None) -> None:
    """Bit for bit on the GPU; on the CPU interpreter bf16 within one ulp per rounding (the
    interpreter truncates fp32 -> bf16 casts), of ``magnitude`` where sums may cancel."""
    assert actual.shape == expected.shape, f"{who}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{who}: dtype {actual.dtype} != {expected.dtype}"
    if not ON_GPU and actual.dtype == BF16:
        assert_within_bf16_ulps(actual, expected, roundings, who, magnitude)
        if roundings == 1:
            assert bool(((actual == 0) == (expected == 0)).all()), f"{who}: zeros differ"
        return
    if actual.dtype == FP8:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    same = torch.equal(actual, expected)
    if not same and actual.is_floating_point():
        diff = (actual.float() - expected.float()).abs()
        raise AssertionError(f"{who}: not bitwise equal, {int((diff > 0).sum())} differ, max "
                             f"{float(diff.nan_to_num(float('inf')).max())}")  # fmt: skip
    assert same, f"{who}: not equal"


def assert_zero_rows(t: torch.Tensor, start: int, who: str = "ours") -> None:
    rest = t[start:]
    if rest.dtype == FP8:
        rest = rest.view(torch.uint8)
    assert not bool(rest.ne(0).any()), f"{who}: rows from {start} on must be zero"


def fp8_step(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing at |x| (3 mantissa bits, subnormal spacing 2^-9), as fp32."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-6))) - 3)


# ---------------------------------------------------------------------------------------------
# plain-torch oracles


def oracle_topk(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """(T, k) experts: descending score, NaN as -inf, ties to the lower expert (our rule)."""
    s = scores_TE.float()
    s = torch.where(s.isnan(), float("-inf"), s)
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]


def pair_keys(experts_TK: torch.Tensor, start: int, end: int, num_rows: int) -> torch.Tensor:
    """Sorted keys (expert - start) * num_rows + token of the choices in [start, end)."""
    e = experts_TK.reshape(-1)
    t = torch.arange(experts_TK.shape[0], device=e.device).repeat_interleave(experts_TK.shape[1])
    keep = (e >= start) & (e < end)
    return ((e[keep] - start) * num_rows + t[keep]).sort().values


@functools.cache
def _triton_division():
    """A Triton kernel computing s = 448 / m and 1 / s with Triton's ``/`` (div.full.f32 on the
    GPU, within 2 ulp of IEEE), as FBGEMM's row quantiser (``triton_quantize_fp8_row``) does."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide(m_ptr, s_ptr, inv_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        s = 448.0 / tl.load(m_ptr + i, mask=mask, other=1.0)
        tl.store(s_ptr + i, s, mask=mask)
        tl.store(inv_ptr + i, 1.0 / s, mask=mask)

    return divide


def fbgemm_divisions(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(448 / m, 1 / (448 / m)) divided as FBGEMM divides: on the GPU Triton's approximate
    division, which differs from IEEE in the last bits (and so moves the e4m3 rounding of values
    at exact ties, frequent with bf16 inputs); on the CPU IEEE, as the interpreter divides."""
    if not ON_GPU or m.numel() == 0:
        s = torch.full_like(m, FP8_MAX) / m
        return s, torch.ones_like(s) / s
    s, inv = torch.empty_like(m), torch.empty_like(m)
    _triton_division()[(_cdiv(m.numel(), 1024),)](m, s, inv, m.numel(), BLOCK=1024)
    return s, inv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def oracle_quantize_rows(v: torch.Tensor, scale_ub: torch.Tensor | None):
    """FBGEMM's row-wise e4m3 quantisation of fp32 rows: (q, 1 / s), s = 448 / m with
    m = clamp(amax, 1e-12) (bounded by scale_ub), q = e4m3(clamp(v * s, +-448)) rounded to
    nearest even (torch's cast), the divisions as FBGEMM's (``fbgemm_divisions``)."""
    amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    m = amax.clamp_min(1e-12)
    if scale_ub is not None:
        m = torch.minimum(m, scale_ub.float().reshape(()).clamp_min(1e-12))
    s, inv = fbgemm_divisions(m.contiguous())
    q = (v * s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, inv


def oracle_sequential_scatter(out, rows, tok, num_live: int) -> torch.Tensor:
    """``out`` after ``out[tok[i]] += rows[i]`` for i < num_live, tok[i] >= 0, in ascending i,
    each add in fp32 rounded to out's dtype (integers: exact)."""
    res = out.clone()
    i = torch.arange(rows.shape[0], device=rows.device)
    live = (tok.long() >= 0) & (i < num_live)
    src = i[live]
    dst = tok.long()[live]
    if src.numel() == 0:
        return res
    if not res.dtype.is_floating_point:
        res.index_add_(0, dst, rows[src].to(res.dtype))
        return res
    order = torch.sort(dst, stable=True).indices  # ascending i inside a destination
    dst, src = dst[order], src[order]
    rank = torch.arange(dst.numel(), device=dst.device) - torch.searchsorted(dst, dst)
    for r in range(int(rank.max()) + 1):
        sel = rank == r
        d = dst[sel]
        res[d] = (res[d].float() + rows[src[sel]].float()).to(res.dtype)
    return res


# ---------------------------------------------------------------------------------------------
# index_shuffling (shuffling_test.py: test_topk_index_shuffling, ..._tile_size_boundaries)

SHUFFLE_T = [1, 3, 123, 128, 1234, 2048, 4567, 4096, 8192, 16384]


def tie_free_scores(T: int, E: int, dtype, gen) -> torch.Tensor:
    """(T, E) scores with no tie in any row, exact in bf16: a random permutation of E
    consecutive integers, shifted per row (|value| <= 256) and scaled by a power of two."""
    perm = torch.rand(T, E, generator=gen, device=DEV).argsort(dim=1)
    reach = 256 - max(E - E // 2, E // 2)
    shift = torch.randint(-reach, reach + 1, (T, 1), generator=gen, device=DEV)
    power = torch.randint(0, 9, (T, 1), generator=gen, device=DEV)
    return ((perm - E // 2 + shift).float() * torch.exp2(-power.float())).to(dtype)


def _shuffle_inputs(case: dict, ties: bool = False):
    T, E = _size("T", case["T"]), case["E"]
    padded = case.get("padded", False)
    total = 2 * T if padded else T
    gen = torch.Generator(device=DEV).manual_seed(1000 * T + E)
    if ties:
        scores = (torch.randint(-2, 3, (total, E), generator=gen, device=DEV) * 0.5).to(
            case["dtype"]
        )
        special = torch.rand(total, E, generator=gen, device=DEV)
        scores[special < 0.05] = float("nan")
        scores[special > 0.95] = float("-inf")
        scores[0] = float("-inf")  # a row of -inf still picks top_k distinct experts: 0..k-1
        if total > 1:
            scores[1] = float("nan")  # NaN counts as -inf
    else:
        scores = tie_free_scores(total, E, case["dtype"], gen)
    if not case.get("rowmajor", True):
        scores = scores.t().contiguous().t()  # column-major, as FBGEMM's rowmajor=False
    local = case.get("local")
    start, end = (0, E) if local is None else (1, 1 + local)
    vtc = torch.tensor([T], device=DEV) if padded else None  # int64, as FBGEMM's test
    return scores, T, total, start, end, vtc


def _call_index_shuffling(case, scores, start, end, vtc):
    op = maybe_compiled(mk.index_shuffling, case["compiled"])
    if case.get("local") is None and vtc is None:
        return op(scores, top_k=case["k"])  # FBGEMM's two call forms
    return op(scores, start, end, vtc, case["k"])


def check_fbgemm_shuffle(scores, nv, k, start, end, counts, exp, tok) -> tuple[int, torch.Tensor]:
    """FBGEMM's assertions (tie-free scores): counts, shapes, index ranges, and each expert's
    (expert, token) pairs as a set. Returns (n, the pairs' keys in our order)."""
    total, E = scores.shape
    chosen = torch.topk(scores[:nv].float(), k, dim=1).indices  # FBGEMM's oracle: torch.topk
    ref_counts = torch.bincount(chosen.reshape(-1), minlength=E)
    assert counts.shape == (E + 2,), f"FBGEMM: counts shape {tuple(counts.shape)}"
    assert counts.dtype == INT32, f"FBGEMM: counts dtype {counts.dtype}"
    assert torch.equal(counts[start:end].long(), ref_counts[start:end]), "FBGEMM: counts"
    assert int(counts[E]) == total, f"FBGEMM: counts[E] = {int(counts[E])}, want T = {total}"
    n = int(ref_counts[start:end].sum())
    assert int(counts[E + 1]) == n, f"FBGEMM: counts[E+1] = {int(counts[E + 1])}, want {n}"
    assert exp.shape == (total * k,) and tok.shape == (total * k,), "FBGEMM: index shapes"
    e, t = exp[:n].long(), tok[:n].long()
    assert bool(((e >= 0) & (e < E)).all()), "FBGEMM: expert index out of range"
    assert bool(((t >= 0) & (t < total)).all()), "FBGEMM: token index out of range"
    segment = torch.repeat_interleave(
        torch.arange(end - start, device=e.device), counts[start:end].long()
    )
    assert torch.equal(e, segment), "FBGEMM: expert_indices (local, start-based) by segment"
    keys = segment * total + t
    ref_keys = pair_keys(chosen, start, end, total)
    assert torch.equal(keys.sort().values, ref_keys), "FBGEMM: an expert's token set differs"
    return n, keys


def check_our_shuffle(scores, nv, k, start, end, counts, exp, tok) -> None:
    """Our rule: exactly the oracle's pairs in (expert, token) order, counts 0 outside the
    range, -1 tails."""
    total, E = scores.shape
    chosen = oracle_topk(scores[:nv], k)
    ref_keys = pair_keys(chosen, start, end, total)
    n = ref_keys.numel()
    ref_counts = torch.bincount(chosen.reshape(-1), minlength=E)
    ref_counts[:start] = 0
    ref_counts[end:] = 0
    assert torch.equal(counts[:E].long(), ref_counts), "ours: counts (0 outside the range)"
    assert int(counts[E]) == total and int(counts[E + 1]) == n, "ours: counts[E], counts[E+1]"
    assert torch.equal(exp[:n].long(), ref_keys // total), "ours: expert order"
    assert torch.equal(tok[:n].long(), ref_keys % total), "ours: (expert, token) order"
    assert bool((exp[n:] == -1).all()) and bool((tok[n:] == -1).all()), "ours: -1 tails"


INDEX_EAGER = spread(
    {
        "T": SHUFFLE_T,
        "E": [16, 32, 128, 320],
        "k": [1, 2, 4, 8],
        "dtype": [FP32, BF16],
        "local": [None, 8],
        "padded": [False, True],
        "rowmajor": [True, False],
    },
    40,
    seed=44,
)
INDEX_COMPILED = spread(
    {
        "T": [3, 123, 1234, 4567],
        "E": [16, 128, 320],
        "k": [1, 4],
        "dtype": [FP32, BF16],
        "local": [None, 8],
        "padded": [False, True],
        "rowmajor": [True, False],
    },
    6,
    seed=45,
)


@pytest.mark.parametrize("case", params(with_compiled(INDEX_EAGER, INDEX_COMPILED)))
def test_index_shuffling(case):
    scores, nv, total, start, end, vtc = _shuffle_inputs(case)
    counts, exp, tok = _call_index_shuffling(case, scores, start, end, vtc)
    check_fbgemm_shuffle(scores, nv, case["k"], start, end, counts, exp, tok)
    check_our_shuffle(scores, nv, case["k"], start, end, counts, exp, tok)


def _tile_boundary_cases() -> list[dict]:
    """FBGEMM's kernel changes its tile at storage factors E * top_k of 128, 256, 512: for each
    E, the smallest supported top_k reaching each threshold; T = 2049, fp32, eager."""
    cases = []
    for E in (16, 32, 128, 320):
        for threshold in (128, 256, 512):
            ks = [k for k in (1, 2, 4, 8) if k * E >= threshold]
            if ks and {"E": E, "k": ks[0]} not in [{"E": c["E"], "k": c["k"]} for c in cases]:
                cases.append({"T": 2049, "E": E, "k": ks[0], "dtype": FP32})
    return cases


@pytest.mark.parametrize("case", params(with_compiled(_tile_boundary_cases(), [])))
def test_index_shuffling_tile_boundaries(case):
    scores, nv, total, start, end, vtc = _shuffle_inputs(case)
    counts, exp, tok = _call_index_shuffling(case, scores, start, end, vtc)
    check_fbgemm_shuffle(scores, nv, case["k"], start, end, counts, exp, tok)
    check_our_shuffle(scores, nv, case["k"], start, end, counts, exp, tok)


TIE_CASES = spread(
    {
        "T": [123, 2048],
        "E": [16, 128, 320],
        "k": [1, 2, 8],
        "dtype": [FP32, BF16],
        "padded": [False, True],
        "rowmajor": [True, False],
    },
    8,
    seed=46,
)
TIE_COMPILED = [{"T": 123, "E": 32, "k": 4, "dtype": BF16, "padded": True, "rowmajor": True}]


@pytest.mark.parametrize("case", params(with_compiled(TIE_CASES, TIE_COMPILED)))
def test_index_shuffling_ties(case):
    """Scores full of ties (and NaN, -inf). FBGEMM's test avoids ties (any choice among tied
    scores is right); here any valid top-k is FBGEMM's contract and ties to the lower expert
    (NaN as -inf) ours."""
    scores, nv, total, _, _, vtc = _shuffle_inputs(case, ties=True)
    k, E = case["k"], scores.shape[1]
    counts, exp, tok = _call_index_shuffling({**case, "local": None}, scores, 0, E, vtc)
    n = nv * k
    assert int(counts[E + 1]) == n and int(counts[:E].sum()) == n, "FBGEMM: every token routed"
    # FBGEMM: each valid token gets k distinct experts whose scores are a top-k multiset
    order = torch.sort(tok[:n].long(), stable=True).indices
    t_sorted = tok[:n].long()[order]
    assert torch.equal(t_sorted, torch.arange(nv, device=DEV).repeat_interleave(k)), (
        "FBGEMM: each valid token exactly k times"
    )
    picked = exp[:n].long()[order].view(nv, k)
    assert bool((picked.sort(dim=1).values.diff(dim=1) > 0).all()), "FBGEMM: k distinct experts"
    s = scores[:nv].float()
    s = torch.where(s.isnan(), float("-inf"), s)
    got = s.gather(1, picked).sort(dim=1, descending=True).values
    want = s.sort(dim=1, descending=True).values[:, :k]
    assert torch.equal(got, want), "FBGEMM: the chosen scores are not a top-k"
    check_our_shuffle(scores, nv, k, 0, E, counts, exp, tok)


# ---------------------------------------------------------------------------------------------
# gather_scale_dense_tokens, gather_scale_quant_dense_tokens (gather_scatter_test.py)


def _gather_inputs(case: dict, quant: bool):
    """FBGEMM's inputs: x (T, D) bf16 (|randn| for the plain gather), expert indices int64
    randint, token indices an int32 permutation, scores made (E, T) and transposed (a column-major
    view unless rowmajor). partial: "fbgemm" (-1 indices past T // 2 and the count T // 2),
    "count" (the count alone)."""
    T, D, E = _size("T", case["T"]), _size("D", case["D"]), case["E"]
    gen = torch.Generator(device=DEV).manual_seed(7 * T + D + E)
    x = torch.randn(T, D, generator=gen, device=DEV, dtype=BF16)
    if not quant:
        x = x.abs()
    exp = torch.randint(0, E, (T,), generator=gen, device=DEV)
    tok = torch.randperm(T, generator=gen, device=DEV).to(INT32)
    if quant:
        scores_ET = torch.randn(E, T, generator=gen, device=DEV, dtype=BF16)
    else:
        scores_ET = torch.rand(E, T, generator=gen, device=DEV, dtype=BF16)
    scores = scores_ET.t()
    if case["rowmajor"]:
        scores = scores.contiguous()
    nv, vtc = T, None
    if case["partial"] != "none":
        nv = T // 2
        vtc = torch.tensor([nv], dtype=INT32, device=DEV)
    if case["partial"] == "fbgemm":
        live = torch.arange(T, device=DEV) < nv
        exp, tok = torch.where(live, exp, -1), torch.where(live, tok, -1)
    return x, tok, exp, scores, vtc, nv


def _oracle_products(x, tok, exp, scores) -> torch.Tensor:
    """(N, D) fp32: x[tok[i]] * scores[tok[i], exp[i]] (row 0's values where an index is -1)."""
    t, e = tok.long().clamp_min(0), exp.long().clamp_min(0)
    if x.shape[0] == 0:
        return x.new_zeros((tok.shape[0], x.shape[1]), dtype=FP32)
    return x.float()[t] * scores.float()[t, e][:, None]


def _gather_grid(ts: list[int]) -> list[dict]:
    # FBGEMM skips T = 16384 unless E = 2 and D = 5120 (memory)
    return [
        {"E": E, "T": T, "D": D}
        for E, T, D in itertools.product([2, 4, 8], ts, [5120, 7168])
        if T != 16384 or (E == 2 and D == 5120)
    ]


def _gather_cases(ts: list[int], compiled: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    partials = ["none", "fbgemm", "count"]
    eager = [
        {**c, "partial": partials[i % 3], "rowmajor": rng.random() < 0.5}
        for i, c in enumerate(_gather_grid(ts))
    ]
    small = [c for c in eager if c["T"] <= 2048]
    picks = rng.sample(small, compiled)
    return with_compiled(eager, picks)


GATHER_CASES = _gather_cases([0, 1, 128, 2048, 4096, 16384], compiled=6, seed=47)
GATHER_QUANT_CASES = _gather_cases([1, 128, 2048, 4096, 16384], compiled=4, seed=48)


@pytest.mark.parametrize("case", params(GATHER_CASES))
def test_gather_scale_dense_tokens(case):
    x, tok, exp, scores, vtc, nv = _gather_inputs(case, quant=False)
    op = maybe_compiled(mk.gather_scale_dense_tokens, case["compiled"])
    out = op(x, tok, exp, scores, vtc)
    want = _oracle_products(x, tok, exp, scores).to(BF16)
    assert out.shape == (x.shape[0], x.shape[1]) and out.dtype == BF16, "FBGEMM: shape, dtype"
    torch.testing.assert_close(out[:nv], want[:nv], msg=lambda m: f"FBGEMM: {m}")
    assert_bits(out[:nv], want[:nv])  # one fp32 product, rounded once
    assert_zero_rows(out, nv)


@pytest.mark.parametrize("case", params(GATHER_QUANT_CASES))
def test_gather_scale_quant_dense_tokens(case):
    x, tok, exp, scores, vtc, nv = _gather_inputs(case, quant=True)
    ub = torch.tensor([1200.0], device=DEV)
    op = maybe_compiled(mk.gather_scale_quant_dense_tokens, case["compiled"])
    q, scale = op(x, tok, exp, scores, ub, vtc)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (x.shape[0],), "FBGEMM: shapes"
    q_ref, s_ref = oracle_quantize_rows(_oracle_products(x, tok, exp, scores), ub)
    deq, deq_ref = q.float() * scale[:, None], q_ref.float() * s_ref[:, None]
    torch.testing.assert_close(
        deq[:nv], deq_ref[:nv], atol=1e-3, rtol=1.6e-2, msg=lambda m: f"FBGEMM: {m}"
    )
    # ours: FBGEMM's arithmetic bit for bit (exact product, FBGEMM's divisions, RNE cast)
    assert_bits(scale[:nv], s_ref[:nv])
    assert_bits(q[:nv], q_ref[:nv])
    assert_zero_rows(q, nv)
    assert_zero_rows(scale, nv)


# ---------------------------------------------------------------------------------------------
# scatter_add_dense_tokens (gather_scatter_test.py: test_scatter_add_dense_tokens)


def _scatter_inputs(case: dict):
    """FBGEMM's inputs: in (T * k, D), out (T, D): bf16 for k = 1, int32 (randn truncated) for
    k > 1 unless case["dtype"] says; partial: a random count nv < T of valid tokens, the count
    nv * k; indices[: nv * k] = a permutation of nv * k modulo nv (each token k times), -1 after."""
    T, D, k = _size("T", case["T"]), _size("D", case["D"]), case["k"]
    dtype = case.get("dtype") or (BF16 if k == 1 else INT32)
    gen = torch.Generator(device=DEV).manual_seed(11 * T + D + k)
    rows = torch.randn(T * k, D, generator=gen, device=DEV).to(dtype)
    out = torch.randn(T, D, generator=gen, device=DEV).to(dtype)
    nv, vtc = T, None
    if case["partial"]:
        nv = random.Random(T + D).randint(0, T - 1)
        vtc = torch.tensor([nv * k], dtype=INT32, device=DEV)
    tok = torch.full((T * k,), -1, dtype=INT32, device=DEV)
    if nv > 0:
        tok[: nv * k] = (torch.randperm(nv * k, generator=gen, device=DEV) % nv).to(INT32)
    return out, rows, tok, vtc, nv


SCATTER_EAGER = [
    c
    for c in spread(
        {"T": [0, 1, 128, 2048, 4096, 16384], "D": [1280, 5120], "k": [1, 4], "partial": [0, 1]},
        24,
        seed=49,
    )
    if not (c["T"] == 0 and c["partial"])  # FBGEMM returns early there
]
SCATTER_COMPILED = [
    {"T": 128, "D": 1280, "k": 1, "partial": 1},
    {"T": 2048, "D": 5120, "k": 4, "partial": 0},
    {"T": 1, "D": 5120, "k": 4, "partial": 0},
    {"T": 4096, "D": 1280, "k": 1, "partial": 1},
]
# ours: duplicates in bf16 (FBGEMM uses int32 there, its float atomics having no fixed order)
SCATTER_BF16_DUPLICATES = [
    {"T": 2048, "D": 1280, "k": 4, "partial": 1, "dtype": BF16},
    {"T": 128, "D": 5120, "k": 4, "partial": 0, "dtype": BF16},
]


@pytest.mark.parametrize(
    "case",
    params(with_compiled(SCATTER_EAGER + SCATTER_BF16_DUPLICATES, SCATTER_COMPILED)),
)
def test_scatter_add_dense_tokens(case):
    out, rows, tok, vtc, nv = _scatter_inputs(case)
    k = case["k"]
    before = out.clone()
    op = maybe_compiled(mk.scatter_add_dense_tokens, case["compiled"])
    assert op(out, rows, tok, vtc) is None, "FBGEMM: returns None (in place)"
    ref = before.clone()
    if nv > 0:
        t = tok[: nv * k].long()
        ref.scatter_add_(0, t.view(-1, 1).expand(-1, out.shape[1]), rows[: nv * k])
    if out.dtype == INT32:
        assert torch.equal(out[:nv], ref[:nv]), "FBGEMM: int32 sums"
    elif k == 1:  # FBGEMM's bf16 case: every destination once
        torch.testing.assert_close(
            out[:nv], ref[:nv], atol=1e-3, rtol=1.6e-2, msg=lambda m: f"FBGEMM: {m}"
        )
    want = oracle_sequential_scatter(before, rows, tok, nv * k)
    size = oracle_sequential_scatter(before.float().abs(), rows.float().abs(), tok, nv * k)
    assert_bits(out, want, roundings=k + 1, magnitude=size)
    assert torch.equal(out[nv:], before[nv:]), "ours: rows no index names are untouched"


# ---------------------------------------------------------------------------------------------
# scatter_add_padded_tokens (gather_scatter_test.py: test_scatter_add_padded_tokens, _compiled)


def _padded_inputs(case: dict):
    """FBGEMM's inputs: in (EP, T * k, D), out (T, D), bf16 for k = 1 and int32 for k > 1
    unless case["dtype"] says; counts (E,) int32 (balanced: T * k // E each, else a bincount of
    random choices; "int64": MSLK's uncast bincount); indices a permutation of T * k modulo T."""
    T, D, k, E, EP = _size("T", case["T"]), _size("D", case["D"]), case["k"], case["E"], case["EP"]
    dtype = case.get("dtype") or (BF16 if k == 1 else INT32)
    gen = torch.Generator(device=DEV).manual_seed(13 * T + E + EP + k)
    rows = torch.randn(EP, T * k, D, generator=gen, device=DEV).to(dtype)
    out = torch.randn(T, D, generator=gen, device=DEV).to(dtype)
    if case["balanced"]:
        counts = torch.full((E,), T * k // E, dtype=INT32, device=DEV)
    else:
        choices = torch.randint(0, E, (T * k,), generator=gen, device=DEV)
        counts = torch.bincount(choices, minlength=E)
        if case.get("counts") != "int64":
            counts = counts.to(INT32)
    tok = (torch.randperm(T * k, generator=gen, device=DEV) % T).to(INT32)
    return rows, counts, tok, out


def _padded_rows(rows_RPD, counts_E):
    """(P, D) rows: position p's row of rank e(p) // (E // EP), e(p) the expert whose
    cumulative-count range holds p; and the number of live positions."""
    EP, P, _ = rows_RPD.shape
    ends = counts_E.long().cumsum(0)
    p = torch.arange(P, device=rows_RPD.device)
    expert = torch.searchsorted(ends, p, right=True).clamp_max(counts_E.shape[0] - 1)
    rank = expert // (counts_E.shape[0] // EP)
    return rows_RPD[rank, p], int(ends[-1])


PADDED_EAGER = [
    c
    for c in spread(
        {
            "T": [64, 128, 256],
            "E": [16, 80, 128],
            "EP": [2, 4, 8, 16],
            "D": [5120],
            "balanced": [True, False],
            "k": [1, 2, 4],
        },
        24,
        seed=50,
    )
    if not (c["balanced"] and c["T"] * c["k"] < c["E"])  # FBGEMM returns early there
] + [{"T": 128, "E": 80, "EP": 4, "D": 5120, "balanced": False, "k": 2, "counts": "int64"}]
# FBGEMM's compiled set (there with dynamic=True): T 128, E 128, EP 4, balanced or not, k 1, 2
PADDED_COMPILED = [
    {"T": 128, "E": 128, "EP": 4, "D": 5120, "balanced": b, "k": k}
    for b, k in itertools.product([True, False], [1, 2])
]
PADDED_BF16_DUPLICATES = [
    {"T": 128, "E": 16, "EP": 4, "D": 5120, "balanced": False, "k": 2, "dtype": BF16},
    {"T": 256, "E": 80, "EP": 8, "D": 5120, "balanced": True, "k": 4, "dtype": BF16},
]


@pytest.mark.parametrize(
    "case", params(with_compiled(PADDED_EAGER + PADDED_BF16_DUPLICATES, PADDED_COMPILED))
)
def test_scatter_add_padded_tokens(case):
    rows, counts, tok, out = _padded_inputs(case)
    before = out.clone()
    op = maybe_compiled(mk.scatter_add_padded_tokens, case["compiled"], dynamic=True)
    assert op(rows, counts, tok, out) is None, "FBGEMM: returns None (in place)"
    live_rows, total = _padded_rows(rows, counts)
    ref = before.clone()
    if total:
        idx = tok[:total].long().view(-1, 1).expand(-1, out.shape[1])
        ref.scatter_add_(0, idx, live_rows[:total])
    if out.dtype == INT32:
        assert torch.equal(out, ref), "FBGEMM: int32 sums"
    elif case["k"] == 1:
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1.6e-2, msg=lambda m: f"FBGEMM: {m}")
    want = oracle_sequential_scatter(before, live_rows, tok, total)
    size = oracle_sequential_scatter(before.float().abs(), live_rows.float().abs(), tok, total)
    assert_bits(out, want, roundings=case["k"] + 1, magnitude=size)


# ---------------------------------------------------------------------------------------------
# combine_shuffling, split_shuffling (shuffling_test.py: test_combine_or_split_shuffling)


def _shuffling_layout(case: dict):
    """FBGEMM's setup: EP = dp * 4 // routed_mp ranks, E // EP local experts per rank; tokens
    (dp, batch * k, dim) bf16, one block of rows per dp rank. Padded: counts (dp, local * dp)
    with this rank's experts [local * rank, local * (rank + 1)), each dp rank holding a random
    number of valid rows; unpadded: counts (dp, local) summing to the full block, experts
    [0, local). Rows past the valid ones are NaN (they must never be copied)."""
    E, dp, mp, k, padded = case["E"], case["dp"], case["mp"], case["k"], case["padded"]
    batch, dim = _size("batch", case["batch"]), _size("D", case["D"])
    num_tokens = batch * k
    ep = dp * 4 // mp
    local = E // ep
    group = local * dp
    rng = random.Random(hash((E, dp, mp, k, batch, padded)) & 0xFFFF)
    rank = case["rank"] % dp
    start, end = (local * rank, local * (rank + 1)) if padded else (0, local)
    gen = torch.Generator(device=DEV).manual_seed(rng.randrange(2**31))
    cols = group if padded else local
    per_rank = [
        int(num_tokens * rng.random()) if padded and group != E else num_tokens for _ in range(dp)
    ]
    counts = []
    for n in per_rank:
        cuts = sorted(rng.randrange(n) if n else 0 for _ in range(cols - 1))
        bounds = [0, *cuts, n]
        counts.append([b - a for a, b in itertools.pairwise(bounds)])
    counts_t = torch.tensor(counts, dtype=INT32, device=DEV)
    tokens = torch.randn(dp, num_tokens, dim, generator=gen, device=DEV, dtype=BF16)
    return tokens, counts, counts_t, per_rank, start, end, num_tokens


def _rank_first_starts(counts, padded: bool, block: int) -> list[list[int]]:
    """starts[r][e]: the first row of chunk (r, e) in the rank-first layout over all columns."""
    starts, base = [], 0
    for r, row in enumerate(counts):
        base = r * block if padded else base
        off, mine = base, []
        for c in row:
            mine.append(off)
            off += c
        starts.append(mine)
        base = off
    return starts


def _chunk_pairs(counts, start, end, padded, block):
    """(rank-first row, expert-first row, rows) of each chunk (r, e), e in [start, end), in
    expert-first order (compact from row 0); and the rows they cover in all."""
    starts = _rank_first_starts(counts, padded, block)
    pairs, row = [], 0
    for e in range(start, end):
        for r in range(len(counts)):
            pairs.append((starts[r][e], row, counts[r][e]))
            row += counts[r][e]
    return pairs, starts, row


def oracle_combine(tokens_TD, counts, start, end, padded, block):
    """Rank-first chunks of experts [start, end) regrouped expert-first (compact from row 0,
    zeros after), and the per-expert sums then their total."""
    pairs, _, row = _chunk_pairs(counts, start, end, padded, block)
    out = torch.zeros_like(tokens_TD)
    for src, dst, c in pairs:
        out[dst : dst + c] = tokens_TD[src : src + c]
    sums = [sum(counts[r][e] for r in range(len(counts))) for e in range(start, end)]
    return out, [*sums, sum(sums)], row


def oracle_split(tokens_TD, counts, start, end, padded, block):
    """Expert-first chunks (compact from row 0) put back at their rank-first rows; zeros
    elsewhere. Also the (first row, rows) each rank's local chunks cover."""
    pairs, starts, row = _chunk_pairs(counts, start, end, padded, block)
    out = torch.zeros_like(tokens_TD)
    for dst, src, c in pairs:
        out[dst : dst + c] = tokens_TD[src : src + c]
    spans = [(starts[r][start], sum(counts[r][start:end])) for r in range(len(counts))]
    return out, spans, row


def _shuffling_cases() -> list[dict]:
    combos = [
        (E, dp, mp)
        for E, dp, mp in itertools.product([16, 80, 128], [2, 4, 16], [1, 4, 8])
        if dp * 4 // mp <= E  # FBGEMM returns early when EP > E
    ]
    batches = [1, 8, 123, 128, 1234, 2048, 4096, 4567, 8192, 16384]
    cases = []
    for i, ((E, dp, mp), combine) in enumerate(itertools.product(combos, [True, False])):
        k = [1, 2, 4][i % 3]
        # keep dp * batch * k * dim bf16 under ~256 MiB
        fits = [b for b in batches if dp * b * k * 5120 * 2 <= 2**28]
        batch = fits[(i * 7) % len(fits)]
        padded, rank = (i // 2) % 2 == 0, [0, -1, 1][i % 3]
        cases.append({"batch": batch, "E": E, "dp": dp, "mp": mp, "D": 5120, "k": k,
                      "combine": combine, "padded": padded, "rank": rank})  # fmt: skip
    return cases


SHUFFLING_CASES = _shuffling_cases()
SHUFFLING_COMPILED = [
    {"batch": 123, "E": 128, "dp": 4, "mp": 4, "D": 5120, "k": 2, "combine": True,
     "padded": True, "rank": 1},
    {"batch": 128, "E": 80, "dp": 2, "mp": 1, "D": 5120, "k": 1, "combine": False,
     "padded": True, "rank": -1},
]  # fmt: skip


@pytest.mark.parametrize("case", params(with_compiled(SHUFFLING_CASES, SHUFFLING_COMPILED)))
def test_combine_or_split_shuffling(case):
    tokens, counts, counts_t, per_rank, start, end, block = _shuffling_layout(case)
    dp, _, dim = tokens.shape
    padded = case["padded"]
    if case["combine"]:
        for r in range(dp):
            tokens[r, per_rank[r] :] = float("nan")
        flat = tokens.view(-1, dim)
        op = maybe_compiled(mk.combine_shuffling, case["compiled"])
        out, out_counts = op(flat, counts_t, expert_start=start, expert_end=end, is_padded=padded)
        want, want_counts, n = oracle_combine(flat, counts, start, end, padded, block)
        assert out_counts.shape == (end - start + 1,), "FBGEMM: counts shape (EG + 1,)"
        assert out_counts.tolist() == want_counts, "FBGEMM: per-expert counts, then their sum"
        assert out.shape == flat.shape, "FBGEMM: output shape"
        assert torch.equal(out[:n], want[:n]), "FBGEMM: combined rows"
        assert_zero_rows(out, n)
        return
    flat = tokens.view(-1, dim)
    local_rows = int(counts_t[:, start:end].sum())
    flat[local_rows:] = float("nan")
    op = maybe_compiled(mk.split_shuffling, case["compiled"])
    out = op(flat, counts_t, expert_start=start, expert_end=end, is_padded=padded)
    want, spans, n = oracle_split(flat, counts, start, end, padded, block)
    assert out.shape == flat.shape, "FBGEMM: output shape"
    if padded:  # FBGEMM: each rank's local rows, from the rows of its experts before start
        for r, (first, rows) in enumerate(spans):
            assert torch.equal(out[first : first + rows], want[first : first + rows]), (
                f"FBGEMM: rank {r}'s rows"
            )
    else:
        assert torch.equal(out[:n], want[:n]), "FBGEMM: split rows"
    assert torch.equal(out, want), "ours: every other row zero"


# ---------------------------------------------------------------------------------------------
# silu_mul, silu_mul_quant (activation_test.py)


def _activation_inputs(case: dict, quant: bool):
    """FBGEMM's inputs: x (T, 2D) bf16, x0 / x1 its column halves (strided views, or contiguous
    copies); for the quantised op |x| clamped into [0.01, 2] (sign kept); partial: the count
    T // 2 (int32)."""
    T, D = _size("T", case["T"]), _size("D", case["D"])
    gen = torch.Generator(device=DEV).manual_seed(2025 if quant else 0)
    x = torch.randn(T, 2 * D, generator=gen, device=DEV, dtype=BF16)
    if quant:
        x = torch.sign(x) * torch.clamp(x.abs(), 0.01, 2.0)
    x0, x1 = x[:, :D], x[:, D:]
    if case["contiguous"]:
        x0, x1 = x0.contiguous(), x1.contiguous()
    nv, vtc = T, None
    if case["partial"]:
        nv = T // 2
        vtc = torch.tensor([nv], dtype=INT32, device=DEV)
    return x0, x1, vtc, nv


def _silu_fp32(x0, x1) -> torch.Tensor:
    a = x0.float()
    return a * torch.sigmoid(a) * x1.float()


ACT_T = [0, 1, 128, 2048, 4096, 16384]
SILU_CASES = with_compiled(
    spread({"T": ACT_T, "D": [5120, 7168], "contiguous": [True, False], "partial": [0, 1]}, 20, 51),
    [
        {"T": 128, "D": 5120, "contiguous": False, "partial": 1},
        {"T": 2048, "D": 7168, "contiguous": True, "partial": 0},
        {"T": 0, "D": 5120, "contiguous": True, "partial": 1},
    ],
)
SILU_QUANT_CASES = with_compiled(
    spread(
        {"T": ACT_T, "D": [5120, 7168], "ub": [None, 1200.0], "contiguous": [True, False],
         "partial": [0, 1]},
        20,
        52,
    ),
    [
        {"T": 128, "D": 7168, "ub": 1200.0, "contiguous": False, "partial": 1},
        {"T": 2048, "D": 5120, "ub": None, "contiguous": True, "partial": 0},
        {"T": 1, "D": 5120, "ub": None, "contiguous": False, "partial": 1},
    ],
)  # fmt: skip


@pytest.mark.parametrize("case", params(SILU_CASES))
def test_silu_mul(case):
    x0, x1, vtc, nv = _activation_inputs(case, quant=False)
    y = maybe_compiled(mk.silu_mul, case["compiled"])(x0, x1, vtc)
    want32 = _silu_fp32(x0, x1)
    want = want32.to(BF16)
    assert y.shape == x0.shape and y.dtype == BF16, "FBGEMM: shape, dtype"
    torch.testing.assert_close(
        y[:nv], want[:nv], rtol=1.6e-2, atol=1e-3, msg=lambda m: f"FBGEMM: {m}"
    )
    # ours: the fp32 value within a few fp32 ulps of torch's (GPU exp / division), one rounding
    assert_within_bf16_ulps(y[:nv], want32[:nv], 1, "ours")
    assert_zero_rows(y, nv)


@pytest.mark.parametrize("case", params(SILU_QUANT_CASES))
def test_silu_mul_quant(case):
    if ON_GPU and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FBGEMM runs this test on sm90+ only (e4m3)")
    x0, x1, vtc, nv = _activation_inputs(case, quant=True)
    ub = None if case["ub"] is None else torch.tensor([case["ub"]], device=DEV)
    q, scale = maybe_compiled(mk.silu_mul_quant, case["compiled"])(x0, x1, ub, vtc)
    assert q.dtype == FP8 and q.shape == x0.shape and scale.shape == (x0.shape[0],), "shapes"
    q_ref, s_ref = oracle_quantize_rows(_silu_fp32(x0, x1), ub)
    deq, deq_ref = q.float() * scale[:, None], q_ref.float() * s_ref[:, None]
    torch.testing.assert_close(
        deq[:nv], deq_ref[:nv], rtol=1e-1, atol=1e-3, msg=lambda m: f"FBGEMM: {m}"
    )
    torch.testing.assert_close(
        scale[:nv], s_ref[:nv], rtol=1e-6, atol=0, msg=lambda m: f"ours: {m}"
    )
    step_bad = (q[:nv].float() - q_ref[:nv].float()).abs() > fp8_step(q_ref[:nv])
    assert not bool(step_bad.any()), "ours: data more than one e4m3 step from the oracle"
    assert_zero_rows(q, nv)
    assert_zero_rows(scale, nv)


# ---------------------------------------------------------------------------------------------
# CUDA graphs (FBGEMM times its ops in CUDA graphs, utils.py; ours promise capture safety)


@pytest.mark.parametrize("k", [4])
def test_cuda_graph_pipeline(k):
    """index_shuffling -> gather_scale_dense_tokens -> scatter_add_dense_tokens captured once
    (the valid count a device tensor), replayed with new scores, tokens and counts: equal to the
    eager calls bit for bit, and to the oracles."""
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    T, E, D = 4096, 128, 1280
    gen = torch.Generator(device=DEV).manual_seed(44 + k)
    scores = torch.empty(T, E, device=DEV, dtype=BF16)
    x = torch.empty(T, D, device=DEV, dtype=BF16)
    vtc = torch.empty(1, device=DEV, dtype=INT32)
    out = torch.zeros(T, D, device=DEV, dtype=FP32)

    def step():
        counts, exp, tok = mk.index_shuffling(scores, None, None, vtc, k)
        n = counts[E + 1 : E + 2]
        rows = mk.gather_scale_dense_tokens(x, tok, exp, scores, n)
        out.zero_()
        mk.scatter_add_dense_tokens(out, rows, tok, n)
        return counts, exp, tok, rows

    def refill(nv: int):
        scores.copy_(tie_free_scores(T, E, BF16, gen))
        x.copy_(torch.randn(T, D, generator=gen, device=DEV, dtype=BF16))
        vtc.fill_(nv)

    refill(T)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for nv in (T, T // 3, 0, 1):
        refill(nv)
        graph.replay()
        got = [t.clone() for t in (*captured, out)]
        eager = [t.clone() for t in (*step(), out)]
        for g, e in zip(got, eager, strict=True):
            assert torch.equal(g, e), f"graph replay != eager at valid count {nv}"
        counts, exp, tok, rows = got[:4]
        check_our_shuffle(scores, nv, k, 0, E, counts, exp, tok)
        n = nv * k
        want_rows = _oracle_products(x, tok[:n], exp[:n], scores).to(BF16)
        assert torch.equal(rows[:n], want_rows), "gathered rows"
        assert_zero_rows(rows, n)
        want_out = oracle_sequential_scatter(torch.zeros_like(out), rows, tok, n)
        assert torch.equal(got[4], want_out), "scatter-added rows"
