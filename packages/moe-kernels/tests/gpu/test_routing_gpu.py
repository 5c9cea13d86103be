"""``route`` and ``index_shuffling`` on the GPU, bit for bit against the reference run on the same
device (``moe_kernels.reference.routing``).

* the shapes take every plan family the chooser keeps by default (ranks / columns / counted /
  prefix / sorted placements, the scan launch, rounds of row maxima past top-8, many experts):
  random non-zero scores, ties, NaN / -inf / -0.0 rows, expert ranges (empty, one expert, a
  few), valid counts, column-major and padded row strides, fp32 / bf16 / fp16; each public call
  twice (the full launch, then the bound relaunch of the eager lane), outputs poisoned;
* no host sync, a CUDA graph replayed on new scores and counts, ``torch.compile`` == eager ==
  reference; one compiled function called over many top_k / ranges / counts;
* eager calls back to back (the cooperative launch: A, grid barrier, C) and on two streams;
* the selection options (bias, groups, scale, renormalize) against the reference.

``MOE_GPU_FULL=1`` adds every case compiled (static and dynamic shapes) and the whole selection
grid. Plans forced through the chooser's constraints are not public API: ``routing_plans.py``
checks each candidate it times.
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference.routing import index_shuffling_reference, route_reference
from moe_kernels.testing import (
    bits_equal,
    compile_fresh,
    forbid_host_sync,
    full_run,
    gpu_test_device,
    poison,
    replay_mismatches,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
FULL = pytest.mark.skipif(not full_run(), reason="large grid: MOE_GPU_FULL=1")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def size(t: int) -> int:
    """t tokens on the GPU, at most 40 in a CPU smoke run."""
    return t if ON_GPU else min(t, 40)


def scores(T, E, dtype, kind="softmax", seed=0, layout="row") -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if kind == "softmax":
        x = torch.randn(T, E, device=DEV, generator=g).softmax(-1)
    elif kind == "ties":
        x = torch.randint(1, 4, (T, E), device=DEV, generator=g).float() * 0.25
    elif kind == "sigmoid":
        x = torch.sigmoid(torch.randn(T, E, device=DEV, generator=g))
    elif kind == "special":  # NaN, -inf, -0.0 and rows of -inf
        x = torch.randn(T, E, device=DEV, generator=g)
        x[torch.rand(T, E, device=DEV, generator=g) < 0.1] = float("nan")
        x[torch.rand(T, E, device=DEV, generator=g) < 0.1] = float("-inf")
        x[torch.rand(T, E, device=DEV, generator=g) < 0.05] = -0.0
        x[:: max(T // 7, 1)] = float("-inf")
    else:  # "inf": NaN, +-inf, a first row of -inf
        x = torch.randn(T, E, device=DEV, generator=g)
        r = torch.rand(T, E, device=DEV, generator=g)
        x = torch.where(r < 0.05, float("nan"), x)
        x = torch.where((r > 0.05) & (r < 0.08), float("-inf"), x)
        x = torch.where((r > 0.08) & (r < 0.1), float("inf"), x)
        x[:1] = float("-inf")
    x = x.to(dtype)
    if layout == "col":
        x = x.t().contiguous().t()
    elif layout in ("pad", "odd"):  # row stride E + 2 (pairs stay 4-byte aligned) or E + 1
        x = torch.empty(T, E + (2 if layout == "pad" else 1), device=DEV, dtype=dtype)[:, :E].copy_(
            x
        )
    return x


def case(T, E, k, dtype, start=None, end=None, valid=None, kind="softmax", layout="row"):
    return pytest.param(
        dict(T=T, E=E, k=k, dtype=dtype, start=start, end=end, valid=valid, kind=kind,
             layout=layout),
        id=f"T{T}-E{E}-k{k}-{str(dtype)[6:]}-{start}:{end}-v{valid}-{kind}-{layout}",
    )  # fmt: skip


# Every plan family the chooser keeps by default (routing_gpu.py's shapes).
CASES = [
    case(4096, 16, 8, BF16),  # ranks in A, scan in C, one cooperative launch
    case(4096, 128, 8, FP32),
    case(65536, 128, 8, BF16, valid=60000),  # token columns
    case(1000, 7, 3, FP16, start=1, end=6, valid=900, layout="col"),
    case(333, 512, 5, FP32, kind="special"),  # many experts
    case(2049, 33, 33, BF16, kind="ties"),  # top_k > 8: rounds of row maxima
    case(100000, 64, 6, FP32, start=16, end=48, kind="ties"),
    case(300000, 128, 8, BF16, start=32, end=32),  # an empty expert range
    case(300000, 16, 8, BF16, kind="ties"),  # C's counting placement, <= 16 local experts
    case(300000, 16, 4, FP32, valid=299000),
    case(300000, 128, 8, BF16, start=32, end=33),  # one local expert
    case(300000, 128, 8, FP16, start=32, end=36),
    case(200000, 32, 8, BF16, start=8, end=16, kind="special"),
    case(300000, 128, 8, BF16, kind="special", layout="pad"),  # columns, padded rows
    case(200000, 64, 5, BF16, kind="special", valid=150000),
    case(200000, 128, 1, BF16, start=5, end=100, kind="ties"),
    case(100000, 128, 3, FP16, kind="special", layout="odd"),  # odd row stride
    case(1, 8, 2, FP16),
    case(5, 1, 1, BF16, kind="special"),
    case(0, 8, 2, BF16),
]


def inputs(c: dict):
    T = size(c["T"])
    x = scores(T, c["E"], c["dtype"], c["kind"], seed=T + c["E"] + c["k"], layout=c["layout"])
    vtc = None if c["valid"] is None else torch.tensor([min(c["valid"], T)], device=DEV)
    s = 0 if c["start"] is None else c["start"]
    e = c["E"] if c["end"] is None else c["end"]
    return x, vtc, s, e


def differing(got, want) -> list[str]:
    return [f for f, a, b in zip(got._fields, got, want, strict=True) if not bits_equal(a, b)]


# The default run keeps one case of each plan family; MOE_GPU_FULL=1 all of them.
DEFAULT_CASES = (0, 2, 3, 4, 5, 8, 11, 13, 16, 17, 18, 19)


@pytest.mark.parametrize(
    "c", [p if i in DEFAULT_CASES else pytest.param(*p.values, marks=FULL, id=p.id)
          for i, p in enumerate(CASES)],
)  # fmt: skip
def test_route_and_index_shuffling_match_the_reference(c):
    x, vtc, s, e = inputs(c)
    k = c["k"]
    opts = dict(valid_token_count=vtc, expert_index_start=c["start"], expert_index_end=c["end"])
    for renorm in (False, True):
        want = route_reference(x, k, vtc, s, e, renorm)
        for launch in ("full", "bound"):  # the second eager call relaunches the bound handles
            poison(x.shape[0] * k * 16 + 4096, device=DEV)
            got = mk.route(x, k, renormalize=renorm, **opts)
            assert not differing(got, want), (renorm, launch, differing(got, want))
    want = index_shuffling_reference(x, s, e, vtc, k)
    for launch in ("full", "bound"):
        poison(x.shape[0] * k * 16 + 4096, device=DEV)
        got = mk.index_shuffling(x, c["start"], c["end"], vtc, k)
        assert not differing(got, want), (launch, differing(got, want))


def _both(k, renorm, E):
    def fn(x, vtc):
        p = mk.route(x, k, valid_token_count=vtc, expert_index_start=8, expert_index_end=24,
                     renormalize=renorm)  # fmt: skip
        return (*p, *mk.index_shuffling(x, 0, E, vtc, k))

    def ref(x, vtc):
        return (*route_reference(x, k, vtc, 8, 24, renorm),
                *index_shuffling_reference(x, 0, E, vtc, k))  # fmt: skip

    return fn, ref


@pytest.mark.parametrize("T,E,k,renorm", [(4096, 128, 8, True), (65536, 128, 8, False)])
def test_no_host_sync_graph_replay_and_compile(T, E, k, renorm):
    """A small renormalised shape, and one that takes the token-column plans (T k > 32768
    pairs, 16-bit scores, 128 experts)."""
    T = size(T)
    x = scores(T, E, BF16, seed=1)
    vtc = torch.tensor([T - 5], device=DEV)
    fn, ref = _both(k, renorm, E)
    assert bits_equal(fn(x, vtc), ref(x, vtc))
    if ON_GPU:
        torch.cuda.synchronize()
        with forbid_host_sync():
            fn(x, vtc)
        sx, sv = x.clone(), vtc.clone()

        def refill(seed):
            return lambda: (sx.copy_(scores(T, E, BF16, seed=seed)), sv.fill_(T - seed * 100))

        bad = replay_mismatches(lambda: fn(sx, sv), [refill(7), refill(8)], lambda: ref(sx, sv))
        assert not bad, f"graph replays {bad} differ from the reference"
    got = compile_fresh(fn)(x, vtc)
    assert bits_equal(got, fn(x, vtc)) and bits_equal(got, ref(x, vtc))


@pytest.mark.parametrize("T,E,k,dtype", [(4096, 16, 8, BF16), (8192, 128, 8, FP16),
                                         (77, 64, 5, BF16)])  # fmt: skip
def test_back_to_back_calls_and_two_streams(T, E, k, dtype):
    """Hundreds of eager calls back to back on rotating inputs, no sync between them (most take
    the cooperative launch), then calls on two streams at once: every kept result exact."""
    T = size(T)
    xs = [scores(T, E, dtype, kind="ties" if s % 2 else "softmax", seed=s) for s in range(5)]
    vtc = torch.tensor([T - 7], device=DEV, dtype=torch.int32)
    wants = [(route_reference(x, k, None, 0, E, False),
              index_shuffling_reference(x, 0, E, vtc, k)) for x in xs]  # fmt: skip
    kept: list = []
    for i in range(400 if ON_GPU else 8):
        j = i % len(xs)
        kept.append((j, mk.route(xs[j], k), mk.index_shuffling(xs[j], None, None, vtc, k)))
        kept = kept[-2 * len(xs) :]
    for j, r, s in kept:
        assert bits_equal(r, wants[j][0]) and bits_equal(s, wants[j][1]), j
    if not ON_GPU:
        return
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    outs: list = [None, None]
    for _ in range(100):
        for w, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[w] = mk.route(xs[w], k)
    torch.cuda.synchronize()
    assert all(bits_equal(outs[w], wants[w][0]) for w in range(2))


SEVERAL = [(1, 0, 128, None), (2, 0, 128, 5), (8, 0, 128, None), (4, 32, 64, None),
           (8, 16, 80, 3), (6, 0, 16, None), (1, 127, 128, 1), (8, 0, 128, 64)]  # fmt: skip


@pytest.mark.parametrize("op", ["route", pytest.param("index_shuffling", marks=FULL)])
@pytest.mark.parametrize("dtype", [BF16, pytest.param(FP32, marks=FULL)])
def test_one_compiled_function_over_many_calls(op, dtype):
    """One compiled function, never reset, called over top_k / ranges / valid counts, as FBGEMM's
    tests and users call it (recompiles and automatic dynamic ints included)."""

    def fn(s, k, a, b, c):
        if op == "route":
            return tuple(mk.route(s, k, valid_token_count=c, expert_index_start=a,
                                  expert_index_end=b))  # fmt: skip
        return tuple(mk.index_shuffling(s, a, b, c, k))

    x = scores(64, 128, dtype, seed=7)
    compiled = compile_fresh(fn)
    for k, a, b, valid in SEVERAL:
        vtc = None if valid is None else torch.tensor([valid], device=DEV)
        assert bits_equal(compiled(x, k, a, b, vtc), fn(x, k, a, b, vtc)), (k, a, b, valid)


@FULL
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("c", CASES)
def test_compiled_plans_equal_eager(c, dynamic):
    """Every case compiled, static and dynamic shapes (the default run compiles the token-column
    shape in ``test_no_host_sync_graph_replay_and_compile``)."""
    x, vtc, s, e = inputs(c)
    k = c["k"]

    def fn(x, vtc):
        p = mk.route(x, k, valid_token_count=vtc, expert_index_start=c["start"],
                     expert_index_end=c["end"], renormalize=True)  # fmt: skip
        return (*p, *mk.index_shuffling(x, c["start"], c["end"], vtc, k))

    assert bits_equal(compile_fresh(fn, dynamic=dynamic)(x, vtc), fn(x, vtc))


# ------------------------------------------------------------------------- selection options

SELECT_SHAPES = [(4096, 256, 8, 8, 4), (300, 64, 6, 8, 3), (20000, 16, 2, 4, 2), (777, 96, 4, 3, 1),
                 (64, 256, 8, 8, 4), (5000, 8, 2, 8, 2), (1000, 1024, 8, 16, 4),
                 (2048, 60, 4, 12, 3)]  # fmt: skip
SELECT_DEFAULT = {(FP32, SELECT_SHAPES[0]), (FP32, SELECT_SHAPES[6]), (FP32, SELECT_SHAPES[7]),
                  (BF16, SELECT_SHAPES[1]), (FP16, SELECT_SHAPES[3])}  # fmt: skip
SELECT_CASES = [
    pytest.param(dt, shape, id=f"{str(dt)[6:]}-{shape}",
                 marks=() if (dt, shape) in SELECT_DEFAULT else FULL)
    for dt in (FP32, BF16, FP16) for shape in SELECT_SHAPES
]  # fmt: skip


@pytest.mark.parametrize("dtype,shape", SELECT_CASES)
def test_selection_options_match_the_reference(dtype, shape):
    """bias (fp32 and the scores' dtype), groups, scale, renormalize, ranges and counts over
    sigmoid scores, ties and special values (NaN, +-inf)."""
    T, E, k, G, TG = shape
    T = size(T)
    for i, kind in enumerate(("sigmoid", "ties", "inf")):
        x = scores(T, E, dtype, kind, seed=i + E)
        g = torch.Generator(device=DEV).manual_seed(100 + i)
        bias = torch.randn(E, device=DEV, generator=g) * 0.1
        if kind == "ties":
            bias = torch.randint(-1, 2, (E,), device=DEV, generator=g).float() * 0.25
        variants = [
            dict(bias=bias, n_groups=G, topk_groups=TG, scale=2.5, renormalize=True),
            dict(bias=bias, n_groups=G, topk_groups=TG),
            dict(bias=bias.to(dtype)),
            dict(n_groups=G, topk_groups=TG, scale=0.5),
            dict(bias=bias, n_groups=G, topk_groups=TG, renormalize=True,
                 expert_index_start=E // 4, expert_index_end=E // 2,
                 valid_token_count=torch.tensor([max(T - 3, 0)], device=DEV)),
        ]  # fmt: skip
        for v in variants:
            got = mk.route(x, k, **v)
            want = route_reference(
                x, k, v.get("valid_token_count"), v.get("expert_index_start", 0),
                v.get("expert_index_end", E), v.get("renormalize", False), v.get("bias"),
                v.get("n_groups", 1), v.get("topk_groups") or v.get("n_groups", 1),
                v.get("scale", 1.0),
            )  # fmt: skip
            assert not differing(got, want), (kind, sorted(v), differing(got, want))


def test_selection_no_host_sync_and_graph_replay():
    T, E, k = size(65536), 256, 8
    x = scores(T, E, FP32, "sigmoid", 0)
    bias = torch.randn(E, device=DEV) * 0.1
    kw = dict(bias=bias, n_groups=8, topk_groups=4, scale=2.5, renormalize=True)
    want = route_reference(x, k, None, 0, E, True, bias, 8, 4, 2.5)
    assert bits_equal(mk.route(x, k, **kw), want)
    if not ON_GPU:
        return
    with forbid_host_sync():
        mk.route(x, k, **kw)
    sx = x.clone()
    refills = [lambda s=s: sx.copy_(scores(T, E, FP32, "sigmoid", s)) for s in (1, 2)]
    expected = lambda: route_reference(sx, k, None, 0, E, True, bias, 8, 4, 2.5)  # noqa: E731
    assert not replay_mismatches(lambda: mk.route(sx, k, **kw), refills, expected)
