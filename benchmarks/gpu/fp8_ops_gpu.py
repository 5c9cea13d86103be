"""GPU check and timing of ``silu_mul``, ``silu_mul_quant`` and ``gather_scale_quant_dense_tokens``
(one H200 run, ~5 min; most of it timing).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/fp8_ops_gpu.py             # H200
    python3 benchmarks/gpu/fp8_ops_gpu.py --no-sweep  # skip the size and config sweeps
    python3 benchmarks/gpu/fp8_ops_gpu.py --configs-only  # the RowConfig sweep alone
    python3 benchmarks/gpu/fp8_ops_gpu.py --dry-run   # CPU, TRITON_INTERPRET=1, tiny shapes

Checks (outputs poisoned with NaN through the caching allocator first, op calls under
``set_sync_debug_mode("error")``), against the torch reference run on the CPU:
  * gather_scale_quant_dense_tokens with ``ieee_div=True`` bit for bit (fp32 products, IEEE
    divisions, RNE e4m3), the public op (FBGEMM's division) within 1 e4m3 step / 8 ulp, over
    dtypes, int32/int64 indices, dead rows (-1), row- and column-major scores, strided x, odd D,
    scale_ub None/[1200]/small, valid_token_count None/partial/0 as int32 and int64;
  * silu_mul within 1 ulp (bf16/fp16) and a few fp32 ulps (the GPU's exp is ex2.approx and its
    sigmoid a div.full, as in FBGEMM), the max printed; rows past the count exactly +0;
  * silu_mul_quant (``ieee_div=True``) bit for bit against the reference quantiser on the GPU's fp32
    SiLU values (``silu_mul`` of fp32 inputs: the same expression), and within one e4m3 step /
    a few ulps of scale of the full CPU reference;
  * the special-value rows of the tests (NaN, +-inf, zero rows, huge, tiny, every kind of bound)
    bit for bit, SiLU rows chosen where the SiLU is exact on every backend;
  * determinism (two calls, same bits), a captured CUDA graph replayed after x, scale_ub and
    valid_token_count changed in place (equal to eager calls on the new values), and
    ``torch.compile(fullgraph=True)`` equal to eager bit for bit;
  * with ``fbgemm_gpu.experimental.gen_ai.moe`` importable, every call of FBGEMM's test forms:
    silu_mul, silu_mul_quant and the gather (FBGEMM's div.full.f32) bit for bit, and the
    launchers with ``ieee_div=True`` with the number of rows whose scale differs (by an ulp or
    two) and of differing data bytes printed; only rows
    below valid_token_count are compared (FBGEMM leaves the others unwritten).
Timings (``graph``: device time per call, 10 calls in a CUDA graph; ``bench``: do_bench median
with the L2 flushed) at T=65536, D=2048 bf16 (the gather: k=8, N=524288 rows from T tokens) and
at FBGEMM's test shapes, beside a clone of the same bytes, the torch formula (eager and
``torch.compile``'d) and FBGEMM; then a sweep over sizes (cliffs) and over ``RowConfig``s.
Variants only through the launchers' ``config=`` / ``ieee_div=`` overrides.
"""

from __future__ import annotations

import os
import sys
import traceback

DRY = "--dry-run" in sys.argv
SWEEP = "--no-sweep" not in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from common import (  # noqa: E402
    FAILS,
    bench_us,
    capture,
    check,
    clone_of,
    forbid_host_sync,
    graph_us,
    poison,
    same_bits,
)

from moe_kernels._triton import fp8_rowwise as rows  # noqa: E402
from moe_kernels._triton import gather_quant as tri_g  # noqa: E402
from moe_kernels._triton import swiglu as tri_s  # noqa: E402
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens  # noqa: E402
from moe_kernels.reference import fp8_rowwise as ref_q  # noqa: E402
from moe_kernels.reference import gather_quant as ref_g  # noqa: E402
from moe_kernels.reference import swiglu as ref_s  # noqa: E402
from moe_kernels.swiglu import silu_mul, silu_mul_quant  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN, INF = float("nan"), float("inf")
SILU_ULPS = {BF16: 1, FP16: 1, FP32: 64}  # fp32: a few ulps expected; the max is printed
SCALE_ULPS_FBGEMM = 8  # div.full twice: FBGEMM's scale within a few ulps of the IEEE one
# the torch baselines are compiled once a shape (automatic dynamic shapes after the first)
torch._dynamo.config.cache_size_limit = 64
try:
    import fbgemm_gpu.experimental.gen_ai.moe as fb

    if DRY:
        fb = None
except Exception as exc:  # noqa: BLE001 - the peer is optional
    print("fbgemm_gpu not importable:", repr(exc)[:300])
    fb = None


def rand(shape, dtype, seed, scale=2.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def count(kind, n, dtype=torch.int32):
    """valid_token_count tensor and its value: None, "part" (2n/3 + 1), "zero" or "all"."""
    if kind is None:
        return None, n
    k = {"part": 2 * n // 3 + 1, "zero": 0, "all": n}[kind]
    return torch.tensor([k], dtype=dtype, device=DEV), k


def int_bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).long()


def ulps_apart(a, b):
    """(max code distance between same-signed finite elements, count of other mismatches)."""
    a, b = a.cpu(), b.cpu()
    fa, fb_ = a.float(), b.float()
    same = (int_bits(a) == int_bits(b)) | (fa.isnan() & fb_.isnan())
    comparable = ~same & (fa.signbit() == fb_.signbit()) & fa.isfinite() & fb_.isfinite()
    dist = (int_bits(a) - int_bits(b)).abs()[comparable]
    return int(dist.max()) if dist.numel() else 0, int((~same & ~comparable).sum())


def pair(t, d, dtype, seed, layout):
    if layout == "halves":  # FBGEMM's form: the column halves of one (T, 2D) tensor
        x = rand((t, 2 * d), dtype, seed)
        return x[:, :d], x[:, d:]
    if layout == "contiguous":
        return rand((t, d), dtype, seed), rand((t, d), dtype, seed + 1)
    x = rand((t, 2 * d), dtype, seed)  # every other column
    return x[:, ::2], x[:, 1::2]


def cpu(*ts):
    return [None if t is None else t.cpu() for t in ts]


# ------------------------------------------------------------------------------ correctness


def check_silu(t, d, dtype, layout, vtc_kind, vtc_dtype, ub):
    x0, x1 = pair(t, d, dtype, t + d, layout)
    vtc, k = count(vtc_kind, t, vtc_dtype)
    ub_t = None if ub is None else torch.tensor([ub], device=DEV)
    poison(4 * t * d + 4096, device=DEV)
    with forbid_host_sync(not DRY):
        y = silu_mul(x0, x1, vtc)
        q, s = silu_mul_quant(x0, x1, ub_t, vtc)
        v = silu_mul(x0.float(), x1.float())
    name = f"T={t} D={d} {str(dtype)[6:]} {layout} vtc={vtc_kind}/{str(vtc_dtype)[6:]} ub={ub}"
    want = ref_s.silu_mul(*cpu(x0, x1, vtc))
    dist, other = ulps_apart(y, want)
    ok = dist <= SILU_ULPS[dtype] and other == 0 and y.is_contiguous()
    check(f"silu_mul {name}", ok, f"max {dist} ulp vs CPU reference")
    check(f"  dead rows +0 {name}", bool(int_bits(y[k:]).eq(0).all()))
    live = ref_q.live_rows(t, cpu(vtc)[0], CPU)
    exact = ref_q.quantize_rows(v.cpu(), live, cpu(ub_t)[0])
    ieee = tri_s.silu_mul_quant(x0, x1, ub_t, vtc, ieee_div=True)
    check(f"  silu_mul_quant (IEEE div) = quant(GPU silu) {name}", same_bits(ieee, exact))
    rq, rs = ref_s.silu_mul_quant(*cpu(x0, x1, ub_t, vtc))
    dq, oq = ulps_apart(q, rq)
    ds, os_ = ulps_apart(s, rs)
    check(f"  silu_mul_quant vs CPU reference {name}", dq <= 1 and ds <= 64 and oq + os_ == 0,
          f"q {dq} step, scale {ds} ulp")  # fmt: skip
    y2, (q2, s2) = silu_mul(x0, x1, vtc), silu_mul_quant(x0, x1, ub_t, vtc)
    check(f"  deterministic {name}", same_bits(y, y2) and same_bits((q, s), (q2, s2)))


def gather_problem(t, d, n, e, dtype, seed, index_dtype=torch.int32, dead=True):
    x = rand((t, d), dtype, seed)
    scores = torch.rand(t, e, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    lo = -1 if dead else 0
    tok = torch.randint(lo, t, (n,), device=DEV, generator=g).to(index_dtype)
    exp = torch.randint(lo, e, (n,), device=DEV, generator=g).to(index_dtype)
    return x, tok, exp, scores


def check_gather(t, d, n, e, dtype, sdtype, colmajor, strided, index_dtype, vtc_kind, ub):
    x, tok, exp, scores = gather_problem(t, d, n, e, dtype, t + d + n, index_dtype)
    if strided:
        x = torch.cat([x, x], dim=1)[:, ::2]
    scores = scores.to(sdtype)
    if colmajor:
        scores = scores.t().contiguous().t()
    vtc, _ = count(vtc_kind, n, torch.int64 if vtc_kind == "zero" else torch.int32)
    ub_t = None if ub is None else torch.tensor([ub], device=DEV)
    poison(5 * n * d + 4096, device=DEV)
    with forbid_host_sync(not DRY):
        public = gather_scale_quant_dense_tokens(x, tok, exp, scores, ub_t, vtc)
    got = tri_g.gather_scale_quant(x, tok.contiguous(), exp.contiguous(), scores, ub_t, vtc,
                                   ieee_div=True)  # fmt: skip
    want = ref_g.gather_scale_quant_dense_tokens(*cpu(x, tok, exp, scores, ub_t, vtc))
    name = (f"T={t} D={d} N={n} E={e} {str(dtype)[6:]} scores {str(sdtype)[6:]}"
            f"{' col' if colmajor else ''}{' strided-x' if strided else ''} "
            f"{str(index_dtype)[6:]} vtc={vtc_kind} ub={ub}")  # fmt: skip
    dq, oq = ulps_apart(public[0], want[0])
    ds, os_ = ulps_apart(public[1], want[1])
    ok = dq <= 1 and ds <= 8 and oq + os_ == 0
    check(f"gather quant (FBGEMM's div) vs reference {name}", ok, f"q {dq} step, scale {ds} ulp")
    check(f"gather quant (IEEE div) exact {name}", same_bits(tuple(got), want))


def special_values():
    """The tests' special rows, bit for bit against the reference."""
    rows_ = [[0.0] * 6, [1.0, -2.0, NAN, 3.0, 0.5, -0.0], [1.0, -2.0, INF, 3.0, 0.5, -0.0],
             [1.0, -2.0, -INF, 3.0, 0.5, -0.0], [NAN] * 6, [3e38, -1e38, 2.0, 1e-30, 0.0, 5e37],
             [1e-38, -3e-39, 1e-44, 0.0, 2e-40, 7e-39]]  # fmt: skip
    x = torch.tensor(rows_, device=DEV)
    scores = torch.tensor([[1.0, 2.0]] * len(rows_), device=DEV)
    n = 2 * len(rows_)
    tok = torch.arange(n, device=DEV, dtype=torch.int32) % len(rows_)
    exp = (torch.arange(n, device=DEV) >= len(rows_)).int()
    x0 = torch.tensor([[20.0] * 5, [20.0, 20, 20, -100, 20], [INF, 20, -INF, NAN, 0.0]], device=DEV)
    x1 = torch.tensor([[1e37, -2e36, NAN, 1.0, 1e-30], [0.5, -1.25, 3.0, 2.0, 7e-38],
                       [2.0, 1.0, 1.0, 1.0, 3.0]], device=DEV)  # fmt: skip
    for ub in (None, 100.0, 0.0, -2.0, NAN, INF):
        ub_t = None if ub is None else torch.tensor([ub], device=DEV)
        got = tri_g.gather_scale_quant(x, tok, exp, scores, ub_t, None, ieee_div=True)
        want = ref_g.gather_scale_quant_dense_tokens(*cpu(x, tok, exp, scores, ub_t))
        check(f"special values gather ub={ub}", same_bits(tuple(got), want))
        got = tri_s.silu_mul_quant(x0, x1, ub_t, None, ieee_div=True)
        want = ref_s.silu_mul_quant(*cpu(x0, x1, ub_t))
        check(f"special values silu_mul_quant ub={ub}", same_bits(tuple(got), want))
    check("special values silu_mul", same_bits(silu_mul(x0, x1), ref_s.silu_mul(*cpu(x0, x1))))


def correctness():
    print("correctness")
    shapes = [(1, 7168), (128, 5120), (4096, 2048), (300, 130), (17, 1), (64, 16384)]
    if DRY:
        shapes = [(3, 40), (17, 1), (9, 130)]
    for i, (t, d) in enumerate(shapes):
        for dtype in (BF16, FP16, FP32):
            layout = ("halves", "contiguous", "strided")[(i + dtype.itemsize) % 3]
            vtc = (None, "part", "zero", "all")[i % 4]
            ub = 1.0 if dtype == FP16 else 1200.0  # 1.0 binds: rows' maxima exceed it
            check_silu(t, d, dtype, layout, vtc, (torch.int32, torch.int64)[i % 2], ub)
        check_silu(t, d, BF16, "halves", "part", torch.int64, None)
    small = (24, 40, 70, 4) if DRY else (4096, 2048, 32768, 128)
    odd = (9, 33, 20, 3) if DRY else (300, 130, 2000, 5)
    wide = (5, 2500, 7, 2) if DRY else (64, 16384, 256, 4)
    fbs = [] if DRY else [(2048, 5120, 2048, 8), (128, 7168, 128, 2)]
    for j, (t, d, n, e) in enumerate([small, odd, wide, *fbs]):
        for dtype, sdtype, col, strided, idx, vtc, ub in [
            (BF16, BF16, True, False, torch.int32, None, 1200.0),
            (BF16, FP32, False, True, torch.int64, "part", None),
            (FP32, FP16, True, False, torch.int64, "zero", 0.5),
            (FP16, BF16, False, False, torch.int32, "all", None),
        ][: 4 if j < 3 else 1]:
            check_gather(t, d, n, e, dtype, sdtype, col, strided, idx, vtc, ub)
    special_values()


def graph_and_compile():
    print("cuda graph + compile")
    t, d, n, e = (16, 64, 40, 4) if DRY else (2048, 2048, 16384, 16)
    x0, x1 = pair(t, d, BF16, 1, "halves")
    x, tok, exp, scores = gather_problem(t, d, n, e, BF16, 2)
    ub = torch.tensor([1200.0], device=DEV)
    vtc = torch.tensor([n // 2], device=DEV, dtype=torch.int32)
    vtc_t = torch.tensor([t // 2], device=DEV, dtype=torch.int64)

    def step():
        return (silu_mul(x0, x1, vtc_t), silu_mul_quant(x0, x1, ub, vtc_t),
                gather_scale_quant_dense_tokens(x, tok, exp, scores, ub, vtc))  # fmt: skip

    if not DRY:
        graph, static = capture(step)
        x0.copy_(rand(x0.shape, BF16, 3))
        x.copy_(rand(x.shape, BF16, 4))
        ub.fill_(0.75)
        vtc.fill_(n - 3)
        vtc_t.fill_(t - 1)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        check(
            "graph replay (new x, scale_ub, valid_token_count) == eager", same_bits(static, eager)
        )
    compiled = torch.compile(lambda: step(), fullgraph=True)
    check("torch.compile(fullgraph=True) == eager", same_bits(compiled(), step()))


# ---------------------------------------------------------------------------- FBGEMM parity


def parity():
    if fb is None:
        print("FBGEMM parity: skipped (fbgemm_gpu not importable)")
        return
    print("FBGEMM parity (rows < valid_token_count)")
    stats = {"silu_mul": [0, 0], "silu_mul_quant": [0, 0, 0, 0, 0], "gather": [0, 0, 0, 0, 0]}
    for t in (1, 128, 2048, 4096, 16384):
        for d in (5120, 7168):
            x = rand((t, 2 * d), BF16, t + d)
            for x0, x1 in ((x[:, :d], x[:, d:]), (x[:, :d].contiguous(), x[:, d:].contiguous())):
                for vtc_kind in (None, "part"):
                    vtc, k = count(vtc_kind, t)
                    y = silu_mul(x0, x1, vtc)
                    stats["silu_mul"][0] += 1
                    stats["silu_mul"][1] += not same_bits(y[:k], fb.silu_mul(x0, x1, vtc)[:k])
                    for ub in (torch.tensor([1200.0], device=DEV), None):
                        fq, fs = fb.silu_mul_quant(x0, x1, ub, vtc)
                        tq, ts = tri_s.silu_mul_quant(x0, x1, ub, vtc, ieee_div=True)
                        q, s = silu_mul_quant(x0, x1, ub, vtc)
                        _tally(stats["silu_mul_quant"], (fq[:k], fs[:k]), (q[:k], s[:k]),
                               (tq[:k], ts[:k]))  # fmt: skip
            for e in (2, 4, 8):
                xg = rand((t, d), BF16, t + e)
                tok = torch.randperm(t, device=DEV).int()
                exp = torch.randint(0, e, (t,), device=DEV)
                scores = torch.rand(t, e, device=DEV).softmax(-1).to(BF16)
                for sc in (scores, scores.t().contiguous().t()):
                    for ub in (torch.tensor([1200.0], device=DEV), None):
                        want = fb.gather_scale_quant_dense_tokens(xg, tok, exp, sc, ub)
                        if not isinstance(want, tuple):
                            want = (want, None)
                        ours_ieee = tri_g.gather_scale_quant(
                            xg, tok, exp, sc, ub, None, ieee_div=True
                        )
                        ours = gather_scale_quant_dense_tokens(xg, tok, exp, sc, ub)
                        _tally(stats["gather"], want, tuple(ours), ours_ieee)
    a = stats["silu_mul"]
    check("FBGEMM silu_mul bit for bit", a[1] == 0, f"{a[1]} of {a[0]} calls differ")
    # specials (informational; documented differences: NaN products give 0x7F here, +-448 there)
    xs = torch.tensor([[1.0, -2.0, NAN, 3.0] * 256, [1.0, -2.0, INF, 3.0] * 256], device=DEV)
    xs = xs.to(BF16)
    tok, exp = torch.arange(2, device=DEV, dtype=torch.int32), torch.zeros(2, device=DEV).long()
    ones = torch.ones(2, 1, device=DEV, dtype=BF16)
    fq, fs = fb.gather_scale_quant_dense_tokens(xs, tok, exp, ones)
    q, s = gather_scale_quant_dense_tokens(xs, tok, exp, ones)
    print(f"  specials [x, NaN] / [x, inf], no bound: FBGEMM bytes {fq.view(torch.uint8)[:, 2]}"
          f" scales {fs}; ours {q.view(torch.uint8)[:, 2]} {s}")  # fmt: skip
    for op in ("silu_mul_quant", "gather"):
        c, f, rows_, byts, worst = stats[op]
        check(f"FBGEMM {op}: public op bit for bit", f == 0, f"{f} of {c} calls differ")
        check(f"FBGEMM {op}: ieee_div=True within {SCALE_ULPS_FBGEMM} ulp of scale",
              worst <= SCALE_ULPS_FBGEMM, f"{rows_} scale rows (max {worst} ulp) and {byts} data"
              f" bytes differ over {c} calls")  # fmt: skip


def _tally(acc, want, ours, ours_ieee):
    acc[0] += 1
    (fq, fs), (tq, ts), (q, s) = want, ours, ours_ieee
    acc[1] += not (same_bits(fq, tq) and (fs is None or same_bits(fs, ts)))
    if fs is not None:
        d_s, other = ulps_apart(s, fs)
        acc[2] += int((int_bits(s) != int_bits(fs)).sum())
        acc[4] = max(acc[4], d_s if other == 0 else 1 << 30)
    acc[3] += int((q.view(torch.uint8) != fq.view(torch.uint8)).sum())


# -------------------------------------------------------------------------------- timings

ROWS: list[tuple] = []


def torch_quant(v, ub):
    m = v.abs().amax(dim=1).clamp(min=1e-12)
    if ub is not None:
        m = torch.minimum(m, ub)
    s = torch.full_like(m, 448.0) / m
    q = (v * s[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, torch.ones_like(s) / s


def torch_silu(x0, x1):
    a = x0.float()
    return a * torch.sigmoid(a) * x1.float()


def torch_gather(x, tok, exp, scores):
    t = tok.long()
    return x.index_select(0, t).float() * scores[t, exp.long()].float()[:, None]


def time_row(shape, op, impl, fn, nbytes, clone):
    g = graph_us(fn, 10, 10, DRY) if impl != "clone" or DRY else clone[0]
    b = bench_us(fn, dry=DRY) if impl != "clone" or DRY else clone[1]
    ROWS.append((shape, op, impl, g, b, nbytes / g / 1e3, 100 * clone[0] / g))
    print(f"  {shape} {op} {impl}: graph {g:.1f} us, bench {b:.1f} us", flush=True)
    return g


def time_ops(t, d, k, e, sections=("silu", "quant", "gather"), compiled=True):
    shape = f"T={t},D={d}" + (f",k={k}" if "gather" in sections else "")
    print(f"timing {shape}")
    x = rand((t, 2 * d), BF16, 5)
    x0, x1 = x[:, :d], x[:, d:]
    ub = torch.tensor([1200.0], device=DEV)
    n = t * k
    cases = []
    if "silu" in sections:
        nbytes = 3 * t * d * 2
        cases.append(("silu_mul", nbytes, [
            ("ours", lambda: silu_mul(x0, x1)),
            ("torch", lambda: torch_silu(x0, x1).to(BF16)),
            ("torch.compile", compiled and torch.compile(lambda: torch_silu(x0, x1).to(BF16))),
            ("fbgemm", fb and (lambda: fb.silu_mul(x0, x1)))]))  # fmt: skip
    if "quant" in sections:
        nbytes = 2 * t * d * 2 + t * d + 4 * t
        cases.append(("silu_mul_quant", nbytes, [
            ("ours", lambda: silu_mul_quant(x0, x1, ub)),
            ("torch", lambda: torch_quant(torch_silu(x0, x1), ub)),
            ("torch.compile", compiled
             and torch.compile(lambda: torch_quant(torch_silu(x0, x1), ub))),
            ("fbgemm", fb and (lambda: fb.silu_mul_quant(x0, x1, ub)))]))  # fmt: skip
    if "gather" in sections:
        xg, tok, exp, scores = gather_problem(t, d, n, e, BF16, 6, dead=False)
        tok, exp64 = tok.int(), exp.long()
        nbytes = n * d * 2 + n * d + 4 * n + 12 * n  # rows read, data + scale written, indices
        cases.append(("gather_quant", nbytes, [
            ("ours", lambda: gather_scale_quant_dense_tokens(xg, tok, exp64, scores, ub)),
            ("torch", lambda: torch_quant(torch_gather(xg, tok, exp64, scores), ub)),
            ("torch.compile", compiled and torch.compile(
                lambda: torch_quant(torch_gather(xg, tok, exp64, scores), ub))),
            ("fbgemm", fb and (lambda: fb.gather_scale_quant_dense_tokens(
                xg, tok, exp64, scores, ub)))]))  # fmt: skip
    for op, nbytes, impls in cases:
        cl = clone_of(nbytes, DEV)
        clone = (graph_us(cl, 10, 10, DRY), bench_us(cl, dry=DRY))
        time_row(shape, op, "clone", cl, nbytes, clone)
        for impl, fn in impls:
            if fn:
                try:
                    time_row(shape, op, impl, fn, nbytes, clone)
                except Exception as exc:  # noqa: BLE001 - e.g. FBGEMM rejecting a shape
                    print(f"  {op} {impl}: {type(exc).__name__}: {str(exc)[:160]}")


def sweep_sizes():
    """Sizes around the defaults' switch points (row cap, chunking, tile shapes): cliffs show as
    a drop of the %clone column."""
    dims = [64, 128, 256, 512, 1000, 1024, 2048, 3000, 4096, 7168, 8192, 8200, 12288, 16384]
    for d in dims[:3] if DRY else dims:
        t = max(1, (1 << 25) // d) if not DRY else 8  # 32M elements a tensor
        time_ops(t, d, 1, 8, ("silu", "quant"), compiled=False)
        time_ops(max(1, t // 8), d, 8, 64, ("gather",), compiled=False)
    for t in (1, 16, 132, 1024) if not DRY else (1,):
        time_ops(t, 2048, 8, 64, compiled=False)


def sweep_configs():
    t, d, k = (16, 256, 4) if DRY else (65536, 2048, 8)
    x = rand((t, 2 * d), BF16, 7)
    x0, x1 = x[:, :d], x[:, d:]
    xg, tok, exp, scores = gather_problem(t, d, t * k, 128, BF16, 8, dead=False)
    C = rows.RowConfig
    print(f"config sweep T={t} D={d} k={k}: graph us (defaults: elementwise "
          f"{rows.pick_config('elementwise', t, d)}, quant {rows.pick_config('quant', t, d)},"
          f" gather {rows.pick_config('gather', t * k, d)})")  # fmt: skip
    small = rand((128, 2 * 5120), BF16, 6)
    for cfg in [C(1, 1024, 4), C(2, 1024, 4), C(4, 1024, 4), C(8, 1024, 8), C(8, 256, 4),
                C(4, 512, 4), C(16, 256, 8), C(1, 2048, 4), C(1, 2048, 8), C(2, 2048, 8),
                C(1, 512, 2), C(1, 512, 4)]:  # fmt: skip
        us = graph_us(lambda cfg=cfg: tri_s.silu_mul(x0, x1, None, config=cfg), 10, 10, DRY)
        a, b = small[:, :5120], small[:, 5120:]
        us_small = graph_us(lambda cfg=cfg: tri_s.silu_mul(a, b, None, config=cfg), 10, 10, DRY)
        print(f"  silu_mul {cfg}: {us:.1f}  (T=128, D=5120: {us_small:.1f})", flush=True)
    for cfg in [C(1, 2048, 4), C(1, 2048, 8), C(2, 2048, 4), C(2, 2048, 8), C(4, 2048, 8),
                C(1, 2048, 2), C(1, 1024, 4), C(2, 512, 4)]:  # fmt: skip
        qs = graph_us(lambda cfg=cfg: tri_s.silu_mul_quant(x0, x1, None, None, config=cfg), 10,
                      10, DRY)  # fmt: skip
        gather = tri_g.gather_scale_quant
        gs = graph_us(lambda cfg=cfg: gather(xg, tok, exp, scores, None, None, config=cfg), 10,
                      10, DRY)  # fmt: skip
        print(f"  {cfg}: silu_mul_quant {qs:.1f}  gather {gs:.1f}", flush=True)
    d5 = 64 if DRY else 5120  # FBGEMM's widths (not powers of two): whole padded rows or chunks
    for t5 in (16, 64) if DRY else (4096, 16384):
        x5 = rand((t5, 2 * d5), BF16, 10)
        g5 = gather_problem(t5, d5, t5, 8, BF16, 11, dead=False)
        for cfg in [rows.pick_config("gather", t5, d5), C(1, 1024, 4), C(1, 1024, 8),
                    C(2, 1024, 4), C(1, 2048, 4), C(1, 2048, 8), C(1, 512, 4)]:  # fmt: skip
            gs = graph_us(lambda cfg=cfg: tri_g.gather_scale_quant(*g5, None, None, config=cfg),
                          10, 10, DRY)  # fmt: skip
            a5, b5 = x5[:, :d5], x5[:, d5:]
            qs = graph_us(lambda cfg=cfg: tri_s.silu_mul_quant(a5, b5, None, None, config=cfg),
                          10, 10, DRY)  # fmt: skip
            print(f"  T={t5} D={d5} {cfg}: gather {gs:.1f}  silu_mul_quant {qs:.1f}", flush=True)
        for cfg in [rows.pick_config("elementwise", t5, d5), C(1, 1024, 4), C(2, 1024, 4),
                    C(1, 2048, 8), C(1, 512, 4), C(1, 1024, 8)]:  # fmt: skip
            us = graph_us(lambda cfg=cfg: tri_s.silu_mul(x5[:, :d5], x5[:, d5:], None, config=cfg),
                          10, 10, DRY)  # fmt: skip
            print(f"  T={t5} D={d5} {cfg}: silu_mul {us:.1f}", flush=True)
    wd = 64 if DRY else 7168
    xw = rand((t // 8, 2 * wd), BF16, 9)
    for cfg in [C(1, 8192, 8), C(1, 8192, 16), C(2, 8192, 16), C(1, 4096, 8), C(1, 2048, 4)]:
        qs = graph_us(lambda cfg=cfg: tri_s.silu_mul_quant(xw[:, :wd], xw[:, wd:], None, None,
                                                           config=cfg), 10, 10, DRY)  # fmt: skip
        print(f"  D={wd} {cfg}: silu_mul_quant {qs:.1f}", flush=True)


def print_table():
    print()
    print(f"{'shape':<22} {'op':<15} {'impl':<14} {'graph us':>9} {'bench us':>9} {'GB/s':>6}"
          f" {'%clone':>7} {'vs fbgemm':>9}")  # fmt: skip
    fbg = {(r[0], r[1]): r[3] for r in ROWS if r[2] == "fbgemm"}
    for shape, op, impl, g, b, gbs, pct in ROWS:
        vs = f"{fbg[(shape, op)] / g:.2f}x" if (shape, op) in fbg else ""
        print(f"{shape:<22} {op:<15} {impl:<14} {g:9.1f} {b:9.1f} {gbs:6.0f} {pct:6.0f}% {vs:>9}")


def main():
    import triton

    name = "dry" if DRY else torch.cuda.get_device_name()
    print(torch.__version__, triton.__version__, name, "fbgemm" if fb else "no fbgemm")
    big = (16, 64, 4, 8) if DRY else (65536, 2048, 8, 128)
    sections = [correctness, graph_and_compile, parity, lambda: time_ops(*big)]
    fb_shapes = [(1, 5120), (4, 7168)] if DRY else [(t, d) for t in (1, 128, 2048, 4096, 16384)
                                                       for d in (5120, 7168)]  # fmt: skip
    sections += [lambda t=t, d=d: time_ops(t, d, 1, 8) for t, d in fb_shapes]
    if SWEEP:
        sections += [sweep_sizes, sweep_configs]
    if "--configs-only" in sys.argv:
        sections = [sweep_configs]
    for section in [*sections, print_table] if sections != [sweep_configs] else sections:
        try:
            section()
        except Exception:  # noqa: BLE001 - report and go on with the other sections
            traceback.print_exc()
            FAILS.append("exception")
    print("FAILS:", FAILS or "none")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
