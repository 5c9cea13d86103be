"""GPU check and timing of the expert-parallel token reshuffles: ``combine_shuffling``,
``split_shuffling`` and ``scatter_add_padded_tokens`` (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/ep_tokens_gpu.py            # H200 (a few minutes; FBGEMM autotunes)
    python3 benchmarks/gpu/ep_tokens_gpu.py --dry-run  # CPU, TRITON_INTERPRET=1, tiny shapes
    options: --no-timings, --no-sweeps (checks only / checks and timings),
             --sections=timings,print_table (those sections alone)

Checks (outputs poisoned with NaN through the caching allocator first, calls under
``set_sync_debug_mode("error")``), each op bit-exact against the torch reference run on the CPU:
  * shuffles over FBGEMM's test forms (D=5120 bf16, T in {1, 3, 123, 1234, 4567}, E in {16, 128},
    EP in {4, 8}, dense (EP, E/EP) counts and sparse (EP, E) counts with experts [1, 1 + E/EP)),
    odd D (7, 130), E = 96 and 320, counts int32 / int64 with zero experts and empty ranks, all
    zero counts, padded (rank blocks of T/EP) and not, an empty range, fp32 / fp16 / fp8 / int64
    tokens, strided tokens, and the big shape (T = 65536 * 8 rows, D = 2048, EP = 8, E = 128,
    against the reference run on the GPU);
  * the padded scatter-add over FBGEMM's test forms (T in {64, 128, 256}, E in {16, 128}, EP in
    {2, 4, 8, 16}, balanced int32 / bincount int64 counts, randperm int32 indices, bf16), top-k
    duplicates (T_K = 8 T), odd D, E = 96 / 320, indices -1 and out of range, counts with zeros,
    empty ranks and past T_K, fp32 / int32 outputs, strided inputs; both plans forced
    (``ScatterConfig``) as well as the default;
  * a second call gives the same bits; a CUDA graph captured once and replayed after tokens,
    counts and indices changed in place equals the reference on the new values;
    ``torch.compile(fullgraph=True)`` equals eager bit for bit;
  * FBGEMM parity (when ``fbgemm_gpu.experimental.gen_ai.moe`` imports): every call of its test
    grids that FBGEMM takes, ours takes and matches on the rows FBGEMM writes (the shuffles: bit
    for bit; the padded scatter-add: bit for bit where each destination gets one contribution,
    else within one bf16 rounding per contribution, as FBGEMM's atomics add in any order).
Timings, ``graph`` (device time: a CUDA graph of N calls replayed, per call) and ``bench``
(``do_bench`` median, L2 flushed): ours, a clone of the bytes ours moves, the torch-native version
(the reference's torch ops on the GPU, eager and ``torch.compile``'d; for the scatter-add a
``index_add_`` with atomics), FBGEMM (split: with and without ``init_with_zeros``); at FBGEMM's
test shapes and the big shape; the padded scatter's plan (row map + sort) and kernel apart.
FBGEMM 1.6.0 autotunes its shuffle kernel on (EG, EP, E, D), not T: at D=5120 the parity section
tunes it at T=1 first, as any process calling it on a small batch first would (the big shape's
D=2048 key is first seen at the big shape).
Sweeps: sizes (the scan / sorted crossover and cliffs), and launch configs at the big shape,
only through the launchers' typed ``config=`` (``ShuffleConfig``, ``ScatterConfig``).
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback

DRY = "--dry-run" in sys.argv
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

from moe_kernels import padded_tokens as pt  # noqa: E402
from moe_kernels import shuffling as sh  # noqa: E402
from moe_kernels._triton import padded_tokens as tri_pt  # noqa: E402
from moe_kernels._triton import shuffling as tri_sh  # noqa: E402
from moe_kernels.reference import padded_tokens as ref_pt  # noqa: E402
from moe_kernels.reference import shuffling as ref_sh  # noqa: E402
from moe_kernels.reference import tokens as ref_tok  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BIG = (256, 64, 8, 32) if DRY else (65536 * 8, 2048, 8, 128)  # (rows, D, EP, E)
FB_D = 64 if DRY else 5120
fb = None
if not DRY:
    try:
        import fbgemm_gpu.experimental.gen_ai.moe as fb  # noqa: E402
    except Exception as exc:  # noqa: BLE001 - the peer is optional
        print("fbgemm_gpu not importable, its rows are skipped:", repr(exc)[:200])
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gen(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def tokens_of(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random non-zero rows, generated on DEV (the big buffers would take minutes on a CPU)."""
    x = torch.randn(rows, dim, generator=gen(seed, DEV), device=DEV) + 0.25
    if dtype in (torch.float8_e4m3fn, torch.int64, torch.int32):
        x = x * 8
    return x.to(dtype)


def split_counts(rows: int, ranks: int, cols: int, seed: int, dtype=torch.int32, cap=None):
    """FBGEMM's test counts: a random split of ``rows`` into (ranks, cols) chunks (many zeros);
    ``cap``: each rank's own split of at most ``cap`` rows (the padded layout)."""
    if cap is not None:
        per = [
            split_counts(cap - (r * 7) % (cap // 2 + 1), 1, cols, seed + r) for r in range(ranks)
        ]
        return torch.cat(per).to(dtype).to(DEV)
    cuts = torch.sort(torch.randint(0, rows + 1, (ranks * cols + 1,), generator=gen(seed)))[0]
    cuts[0], cuts[-1] = 0, rows
    return (cuts[1:] - cuts[:-1]).reshape(ranks, cols).to(dtype).to(DEV)


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ shuffles


def ref_shuffle(tokens, counts, start, end, padded, combine, device="cpu"):
    """The torch reference, by default on the CPU (the oracle), on bit views of the tokens."""
    x = tokens.to(device).view(BITS[tokens.element_size()])
    c = counts.to(device)
    if combine:
        out, cnt = ref_sh.combine_shuffling(x, c, start, end, padded)
        return out.view(tokens.dtype), cnt
    return ref_sh.split_shuffling(x, c, start, end, padded).view(tokens.dtype), None


def shuffle_cases():
    """(name, tokens, counts, start, end, padded)."""
    cases = []
    for rows in (1, 3, 40) if DRY else (1, 3, 123, 1234, 4567):
        for experts in (16, 128):
            for ep in (4, 8):
                x = tokens_of(rows, FB_D, torch.bfloat16, rows + experts)
                dense = split_counts(rows, ep, experts // ep, rows + ep)
                cases.append((f"fb dense T={rows} E={experts} EP={ep}", x, dense, 0,
                              experts // ep, False))  # fmt: skip
                xs = tokens_of(rows * ep, FB_D, torch.bfloat16, rows + 1)
                sparse = split_counts(rows * ep, ep, experts, rows + 2)
                cases.append((f"fb sparse T={rows * ep} E={experts} EP={ep}", xs, sparse, 1,
                              1 + experts // ep, False))  # fmt: skip
    zeros = split_counts(300, 8, 12, 5, torch.int64)
    zeros[:, 3] = 0
    zeros[2] = 0  # an empty rank
    cases += [
        ("odd D=130 fp32 E=96 int64", tokens_of(300, 130, torch.float32, 6),
         zeros, 0, 12, False),
        ("D=7 fp16 E=320 sparse", tokens_of(999, 7, torch.float16, 7),
         split_counts(999, 8, 320, 8), 40, 80, False),
        ("all-zero counts", tokens_of(64, 256, torch.bfloat16, 9),
         torch.zeros(4, 8, dtype=torch.int32, device=DEV), 0, 8, False),
        ("empty range", tokens_of(64, 256, torch.bfloat16, 10), split_counts(64, 4, 8, 11), 3, 3,
         False),
        ("fp8 E=320 padded", tokens_of(8 * 40, 512, torch.float8_e4m3fn, 12),
         split_counts(0, 8, 320, 13, cap=40), 100, 140, True),
        ("int64 padded EP=4", tokens_of(4 * 100, 33, torch.int64, 14),
         split_counts(0, 4, 16, 15, torch.int64, cap=100), 0, 16, True),
        ("bf16 padded FBGEMM-size", tokens_of(8 * 512, FB_D, torch.bfloat16, 16),
         split_counts(0, 8, 16, 17, cap=512), 0, 16, True),
        ("strided tokens", tokens_of(500, 2 * 384, torch.bfloat16, 18)[:, ::2],
         split_counts(480, 4, 6, 19), 1, 5, False),
        ("EP=1", tokens_of(77, 96, torch.bfloat16, 20), split_counts(77, 1, 5, 21), 0, 5, False),
    ]  # fmt: skip
    return cases


def check_shuffles() -> None:
    print("shuffles: bit-exact vs the CPU reference, no sync, repeatable")
    bad = []
    for name, x, counts, start, end, padded in shuffle_cases():
        poison(x.numel() * x.element_size(), device=DEV)
        with forbid_host_sync(not DRY):
            out, cnt = sh.combine_shuffling(x, counts, start, end, padded)
            back = sh.split_shuffling(x, counts, start, end, padded)
            again = sh.combine_shuffling(x, counts, start, end, padded)
        sync()
        r_out, r_cnt = ref_shuffle(x, counts, start, end, padded, True)
        r_back, _ = ref_shuffle(x, counts, start, end, padded, False)
        ok = same_bits(out, r_out) and same_bits(cnt, r_cnt) and same_bits(back, r_back)
        if not (ok and same_bits(out, again.tokens)):
            bad.append(name)
    check("shuffles over the grid", not bad, f"bad: {bad}" if bad else "")
    rows, dim, ep, experts = BIG
    x = tokens_of(rows, dim, torch.bfloat16, 30)
    for label, counts, start, end, padded in (
        ("dense", split_counts(rows, ep, experts // ep, 31), 0, experts // ep, False),
        ("sparse", split_counts(rows, ep, experts, 32, torch.int64), 16, 32, False),
        ("padded", split_counts(0, ep, experts // ep, 33, cap=rows // ep), 0, experts // ep, True),
    ):
        out, cnt = sh.combine_shuffling(x, counts, start, end, padded)
        back = sh.split_shuffling(x, counts, start, end, padded)
        r_out, r_cnt = ref_shuffle(x, counts, start, end, padded, True, DEV)
        r_back, _ = ref_shuffle(x, counts, start, end, padded, False, DEV)
        ok = same_bits(out, r_out) and same_bits(cnt, r_cnt) and same_bits(back, r_back)
        check(f"big shape {label} exact (reference on the GPU)", ok)


# ------------------------------------------------------------------------------ padded scatter


def scatter_problem(ep, positions, dim, experts, rows, seed, *, in_dtype=torch.bfloat16,
                    out_dtype=torch.bfloat16, counts="bincount", top_k=1):  # fmt: skip
    """(in (EP, T_K, D), counts (E,), indices (T_K,), out (T, D)) on DEV, FBGEMM's forms."""
    g = gen(seed, DEV)
    if counts == "balanced":
        cnt = torch.full((experts,), positions // experts, dtype=torch.int32, device=DEV)
    elif counts == "bincount":
        choices = torch.randint(0, experts, (positions,), generator=g, device=DEV)
        cnt = torch.bincount(choices, minlength=experts)
    else:
        cnt = counts.to(DEV)
    perm = torch.randperm(positions, generator=g, device=DEV)
    idx = (perm if top_k == 1 and rows == positions else perm % rows).int()
    x = torch.randn(ep, positions, dim, generator=g, device=DEV, dtype=torch.bfloat16) + 0.25
    out = torch.randn(rows, dim, generator=g, device=DEV) + 0.25
    if not out_dtype.is_floating_point:
        x, out = x * 1000, out * 1000
    return x.to(in_dtype), cnt, idx, out.to(out_dtype)


def scatter_equal(got, want, problem) -> bool:
    """Bit for bit; in the dry run, bf16 outputs within one rounding per add (the interpreter
    truncates fp32 -> bf16 casts instead of rounding to nearest even)."""
    if DRY and got.dtype == torch.bfloat16:
        return within_rounding(got, want.to(got.device), problem)
    return same_bits(got, want)


def ref_scatter(x, cnt, idx, out, device="cpu"):
    r = out.to(device).clone()
    ref_pt.scatter_add_padded_tokens(x.to(device), cnt.to(device), idx.to(device), r)
    return r


def scatter_cases():
    cases = []
    for rows in (64,) if DRY else (64, 128, 256):
        for experts in (16, 128):
            for ep in (2, 16) if DRY else (2, 4, 8, 16):
                for form in ("balanced", "bincount"):
                    if form == "balanced" and rows < experts:
                        continue
                    name = f"fb T={rows} E={experts} EP={ep} {form}"
                    cases.append((name, scatter_problem(ep, rows, FB_D, experts, rows, rows + ep,
                                                        counts=form)))  # fmt: skip
    odd = torch.tensor([0, 5, 0, 9, 0, 0, 3, 2] * 12)  # E = 96, zero experts, EP=8: ranks of 12
    odd[:24] = 0  # two empty ranks
    past = torch.full((320,), 9)  # 2880 positions for T_K = 2048: past T_K
    cases += [
        ("top-8 dup E=96 odd D fp32<-bf16", scatter_problem(8, 8 * 200, 130, 96, 200, 1,
         out_dtype=torch.float32, counts=odd * 2, top_k=8)),
        ("E=320 past T_K", scatter_problem(8, 2048, 256, 320, 256, 2, counts=past, top_k=8)),
        ("int32 tokens", scatter_problem(4, 512, 64, 16, 128, 3, in_dtype=torch.int32,
         out_dtype=torch.int32, top_k=4)),
        ("EP=1 E=1", scatter_problem(1, 100, 48, 1, 100, 4)),
    ]  # fmt: skip
    x, cnt, idx, out = scatter_problem(4, 300, 96, 16, 300, 5)
    idx[::7] = -1
    idx[3::11] = 1000  # out of range: skipped
    cases.append(("indices -1 / out of range, strided", (x[:, :, ::2], cnt, idx, out[:, 1::2])))
    return cases


def check_scatter() -> None:
    print("padded scatter-add: bit-exact vs the CPU reference, no sync, repeatable, both plans")
    bad = []
    for name, (x, cnt, idx, out0) in scatter_cases():
        want = ref_scatter(x, cnt, idx, out0)
        plans = [None, tri_pt.ScatterConfig("sorted", 1, 1024, 0, 4)]
        if out0.shape[0] * idx.shape[0] <= 1 << 24:
            plans.append(tri_pt.ScatterConfig("scan", 2, 512, 256, 4))
        for plan in plans:
            outs = []
            for _ in range(2):
                out = out0.clone()
                with forbid_host_sync(not DRY):
                    if plan is None:
                        pt.scatter_add_padded_tokens(x, cnt, idx, out)
                    else:
                        tri_pt.scatter_add_padded(out, x, cnt, idx, config=plan)
                outs.append(out)
            problem = (x, cnt, idx, out0)
            if not (scatter_equal(outs[0], want, problem) and same_bits(outs[0], outs[1])):
                bad.append(f"{name} {plan.path if plan else 'default'}")
    check("scatter-add over the grid", not bad, f"bad: {bad}" if bad else "")
    ep, positions, dim, experts, rows = big_scatter_shape()
    x, cnt, idx, out = scatter_problem(ep, positions, dim, experts, rows, 40, top_k=8)
    want = ref_scatter(x, cnt, idx, out, DEV)
    problem = (x, cnt, idx, out.clone())
    pt.scatter_add_padded_tokens(x, cnt, idx, out)
    check("big shape exact (reference on the GPU)", scatter_equal(out, want, problem))


def big_scatter_shape():
    """(EP, T_K, D, E, T): the EP combine of T tokens x top-8 at the big shape."""
    rows, dim, ep, experts = BIG
    return ep, rows, dim, experts, rows // 8


# ------------------------------------------------------------------------------ graph, compile


def check_graph_and_compile() -> None:
    print("CUDA graph replay with new inputs; torch.compile(fullgraph=True) == eager")
    rows, dim, ep, cols = (64, 32, 4, 4) if DRY else (4096, 1024, 8, 16)
    x = tokens_of(rows, dim, torch.bfloat16, 50)
    counts = split_counts(rows, ep, cols, 51)
    sx, scnt, sidx, sout = scatter_problem(ep, rows, dim, 2 * ep, rows // 4, 52, top_k=4)
    sout0 = sout.clone()

    def step():
        out, cnt = sh.combine_shuffling(x, counts, 1, cols)
        back = sh.split_shuffling(out, counts, 1, cols)
        pt.scatter_add_padded_tokens(sx, scnt, sidx, sout)
        return out, cnt, back

    if not DRY:
        graph, (g_out, g_cnt, g_back) = capture(step)
        x.copy_(tokens_of(rows, dim, torch.bfloat16, 53))
        counts.copy_(split_counts(rows, ep, cols, 54))
        sx.copy_(torch.randn_like(sx))
        scnt.copy_(scnt.flip(0))
        sidx.copy_(sidx.flip(0))
        sout.copy_(sout0)
        graph.replay()
        sync()
        r_out, r_cnt = ref_shuffle(x, counts, 1, cols, False, True)
        r_back, _ = ref_shuffle(r_out, counts, 1, cols, False, False)
        ok = same_bits(g_out, r_out) and same_bits(g_cnt, r_cnt) and same_bits(g_back, r_back)
        check("graph replay shuffles exact", ok)
        want = ref_scatter(sx, scnt, sidx, sout0)
        check("graph replay scatter exact", same_bits(sout, want))

    def fn(x, counts, sx, scnt, sidx, sout):
        out, cnt = sh.combine_shuffling(x * 2, counts, 1, cols, False)
        back = sh.split_shuffling(out, counts, 1, cols, is_padded=False)
        padded = sh.combine_shuffling(x, counts, is_padded=True).tokens
        pt.scatter_add_padded_tokens(sx, scnt, sidx, sout)
        return out, cnt, back + 1, padded, sout * 1

    torch._dynamo.reset()
    eager = fn(x, counts, sx, scnt, sidx, sout0.clone())
    compiled = torch.compile(fn, fullgraph=True)(x, counts, sx, scnt, sidx, sout0.clone())
    check("compile fullgraph == eager", same_bits(list(eager), list(compiled)))


# ------------------------------------------------------------------------------ FBGEMM parity


def _fb_padded_kw() -> str:
    params = inspect.signature(fb.combine_shuffling).parameters
    return "is_padded" if "is_padded" in params else "is_balanced"


def check_fbgemm_parity() -> None:
    if fb is None:
        print("FBGEMM parity: skipped (fbgemm_gpu not importable)")
        return
    print("FBGEMM parity over its test grids")
    kw = _fb_padded_kw()
    stats = {"cases": 0, "fb_rejects": 0, "ours_rejects": [], "mismatch": []}

    def run(name, fb_call, our_call, same):
        stats["cases"] += 1
        try:
            want = fb_call()
            sync()
        except Exception:  # noqa: BLE001 - FBGEMM does not take this call
            stats["fb_rejects"] += 1
            return
        try:
            got = our_call()
        except Exception as exc:  # noqa: BLE001
            stats["ours_rejects"].append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
            return
        if not same(want, got):
            stats["mismatch"].append(name)

    for rows in (1, 3, 123, 128, 1234, 2048, 4567, 4096, 8192, 16384):
        for experts in (16, 128):
            for ep in (4, 8):
                for sparse in (False, True):
                    n = rows * ep if sparse else rows
                    cols = experts if sparse else experts // ep
                    start, end = (1, 1 + experts // ep) if sparse else (0, experts // ep)
                    x = tokens_of(n, 5120, torch.bfloat16, rows)
                    for cdt in (torch.int32, torch.int64):
                        counts = split_counts(n, ep, cols, rows + experts, cdt)
                        total = int(counts[:, start:end].sum())
                        live = ref_sh.row_sources(counts, start, end, n, False, False) >= 0
                        name = f"T={n} E={experts} EP={ep} sparse={sparse} {cdt}"
                        run(f"combine {name}",
                            lambda: fb.combine_shuffling(x, counts, expert_start=start,
                                                         expert_end=end, **{kw: False}),
                            lambda: sh.combine_shuffling(x, counts, expert_start=start,
                                                         expert_end=end, **{kw: False}),
                            lambda w, g, t=total: same_bits(w[0][:t], g[0][:t])
                            and same_bits(w[1], g[1]))  # fmt: skip
                        run(f"split {name}",
                            lambda: fb.split_shuffling(x, counts, expert_start=start,
                                                       expert_end=end),
                            lambda: sh.split_shuffling(x, counts, expert_start=start,
                                                       expert_end=end),
                            lambda w, g, m=live: same_bits(w[m], g[m]))  # fmt: skip
    for name, (x, cnt, idx, out0) in scatter_cases():
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or not out0.is_contiguous():
            continue
        inside = int(cnt.sum()) <= idx.shape[0] and bool(((idx >= 0) & (idx < out0.shape[0])).all())
        if not inside:  # FBGEMM reads and writes out of bounds there: not a call it takes
            continue
        one = (out0.shape[0] == idx.shape[0]) and torch.equal(
            idx.sort().values.long(), torch.arange(idx.shape[0], device=DEV)
        )

        def ours(x=x, cnt=cnt, idx=idx, out0=out0):
            o = out0.clone()
            pt.scatter_add_padded_tokens(x, cnt, idx, o)
            return o

        def theirs(x=x, cnt=cnt, idx=idx, out0=out0):
            o = out0.clone()
            fb.scatter_add_padded_tokens(x, cnt, idx, o)
            return o

        run(
            f"scatter {name}",
            theirs,
            ours,
            lambda w, g, one=one, p=(x, cnt, idx, out0): (
                same_bits(w, g) if one else within_rounding(w, g, p)
            ),
        )
    print(f"  {stats['cases']} calls, FBGEMM rejected {stats['fb_rejects']}")
    check("every call FBGEMM takes, ours takes", not stats["ours_rejects"],
          "; ".join(stats["ours_rejects"][:5]))  # fmt: skip
    check("and matches", not stats["mismatch"], ", ".join(stats["mismatch"][:8]))


def within_rounding(a, b, problem) -> bool:
    """|a - b| within one bf16 rounding per add for each of the two (whatever their orders): each
    element's bound is 2 (k + 1) ulps of the sum of the magnitudes of its terms (out's value and
    every contribution: a bound on every partial sum), k its number of contributions."""
    x, cnt, idx, out0 = problem
    scale = ref_scatter(x.abs().float(), cnt, idx, out0.abs().float(), a.device)
    ones = torch.ones_like(x[:, :, :1], dtype=torch.float32)
    k = ref_scatter(ones, cnt, idx, torch.zeros_like(out0[:, :1], dtype=torch.float32), a.device)
    ulp = 2.0 ** (torch.floor(torch.log2(scale.clamp_min(1e-30))) - 7)
    return bool(((a.float() - b.float()).abs() <= 2 * (k + 1) * ulp).all())


# ------------------------------------------------------------------------------ timings

ROWS: list[tuple] = []


def timed(shape: str, name: str, fn, nbytes: int, base: float | None = None) -> float:
    g = graph_us(fn, calls=1 if DRY else 10, replays=1 if DRY else 20, dry=DRY)
    b = bench_us(fn, dry=DRY, warmup_ms=10, rep_ms=40)
    ROWS.append((shape, name, g, b, nbytes / g / 1e3, base))
    print(f"  {shape:<34} {name:<26} graph {g:9.1f} us  bench {b:9.1f} us", flush=True)
    return g


def time_shuffles(rows, dim, ep, cols, start, end, padded, label, native=False) -> None:
    x = tokens_of(rows, dim, torch.bfloat16, 60)
    cap = rows // ep if padded else None
    counts = split_counts(rows, ep, cols, 61, cap=cap)
    live = int(counts[:, start:end].sum())
    shape = f"{label} T={rows} D={dim} EP={ep} E={cols}[{start},{end}){' pad' if padded else ''}"
    nbytes = (live + rows) * dim * 2  # live rows read, every row written (zeros past them)
    clone = timed(shape, "clone of the same bytes", clone_of(nbytes, DEV), nbytes)
    for combine in (True, False):
        op = "combine" if combine else "split"
        if combine:
            ours = timed(shape, op, lambda: sh.combine_shuffling(x, counts, start, end, padded),
                         nbytes, clone)  # fmt: skip
            if native:  # torch.compile recompiles per shape: a few shapes only
                ref = lambda: ref_shuffle(x, counts, start, end, padded, True, DEV)  # noqa: E731
                timed(shape, f"{op} torch eager", ref, nbytes, ours)
                timed(shape, f"{op} torch compiled", torch.compile(ref), nbytes, ours)
        else:
            ours = timed(shape, op, lambda: sh.split_shuffling(x, counts, start, end, padded),
                         nbytes, clone)  # fmt: skip
        if fb is None:
            continue
        kw = {_fb_padded_kw(): padded}
        if combine:
            timed(shape, f"{op} FBGEMM", lambda: fb.combine_shuffling(x, counts, start, end, **kw),
                  2 * live * dim * 2, ours)  # fmt: skip
        else:
            timed(shape, f"{op} FBGEMM", lambda: fb.split_shuffling(x, counts, start, end, **kw),
                  2 * live * dim * 2, ours)  # fmt: skip
            if "init_with_zeros" in inspect.signature(fb.split_shuffling).parameters:
                timed(shape, f"{op} FBGEMM init_with_zeros",
                      lambda: fb.split_shuffling(x, counts, start, end, init_with_zeros=True, **kw),
                      nbytes, ours)  # fmt: skip


def time_scatter(ep, positions, dim, experts, rows, label, top_k, form="bincount",
                 native=False) -> None:  # fmt: skip
    x, cnt, idx, out = scatter_problem(ep, positions, dim, experts, rows, 70, counts=form,
                                       top_k=top_k)  # fmt: skip
    shape = f"{label} EP={ep} T_K={positions} T={rows} D={dim} E={experts}"
    nbytes = positions * dim * 2 + 2 * rows * dim * 2
    clone = timed(shape, "clone of the same bytes", clone_of(nbytes, DEV), nbytes)
    ours = timed(
        shape, "scatter_add_padded", lambda: pt.scatter_add_padded_tokens(x, cnt, idx, out),
        nbytes, clone,
    )  # fmt: skip
    cfg = tri_pt.pick_config(rows, positions, dim)
    print(f"    default plan: {cfg}")
    if cfg.path == "sorted":
        in_flat = x.reshape(ep * positions, dim)

        def plan():
            rows_p, total = ref_pt.position_rows(cnt, ep, positions, positions)
            src, bounds = ref_tok.scatter_order(idx, rows, total)
            return rows_p[src], bounds

        src, bounds = plan()
        timed(shape, "  plan (row map + sort)", plan, 1, ours)
        from moe_kernels._triton import tokens as tri_tok

        timed(shape, "  kernel only", lambda: tri_tok.scatter_add_sorted(out, in_flat, src, bounds),
              nbytes, ours)  # fmt: skip
    if fb is not None and dim % 512 == 0:
        timed(shape, "FBGEMM", lambda: fb.scatter_add_padded_tokens(x, cnt, idx, out), nbytes, ours)
    if not native:
        return
    rows_p, total = ref_pt.position_rows(cnt, ep, positions, positions)
    live = torch.arange(positions, device=DEV) < total
    flat = x.reshape(ep * positions, dim)
    safe = torch.where(live & (idx >= 0) & (idx < rows), idx, 0).long()

    def index_add():  # atomics, any order: the yardstick, not a deterministic equivalent
        src = torch.where(live[:, None], flat.index_select(0, rows_p), 0)
        out.index_add_(0, safe, src)

    timed(shape, "torch index_add_ eager", index_add, nbytes, ours)
    timed(shape, "torch index_add_ compiled", torch.compile(index_add), nbytes, ours)


def timings() -> None:
    print("timings (FBGEMM's test shapes, then the big shape)")
    for rows in (1, 40) if DRY else (1, 123, 1234, 4567, 16384):
        for experts in (16, 128):
            for ep in (4, 8):
                nat = rows == 1234 and experts == 16 and ep == 8
                time_shuffles(rows, FB_D, ep, experts // ep, 0, experts // ep, False, "fb dense",
                              nat)  # fmt: skip
                time_shuffles(rows * ep, FB_D, ep, experts, 1, 1 + experts // ep, False,
                              "fb sparse")  # fmt: skip
    for rows in (64, 256):
        for experts in (16, 128):
            for ep in (2, 8, 16):
                form = "balanced" if rows >= experts else "bincount"
                nat = rows == 256 and experts == 16 and ep == 8
                time_scatter(ep, rows, FB_D, experts, rows, f"fb {form}", 1, form, nat)
    rows, dim, ep, experts = BIG
    time_shuffles(rows, dim, ep, experts // ep, 0, experts // ep, False, "big dense", True)
    time_shuffles(rows, dim, ep, experts // ep, 0, experts // ep, True, "big padded")
    time_shuffles(rows, dim, ep, experts, 16, 32, False, "big sparse", True)
    time_scatter(*big_scatter_shape(), "big top-8", 8, native=True)


def sweeps() -> None:
    rows, dim, ep, experts = BIG
    print("size sweep (cliffs): shuffles at D, EP, E of the big shape; scatter top-8, both plans")
    sizes = (64, 256) if DRY else (64, 1024, 8192, 32768, 131072, 262144, rows)
    for n in sizes:
        time_shuffles(n, dim, ep, experts // ep, 0, experts // ep, False, "sweep")
    x = tokens_of(rows, dim, torch.bfloat16, 80)
    for n in (32, 64) if DRY else (256, 1024, 4096, 16384, 65536):
        sx, cnt, idx, out = scatter_problem(ep, 8 * n, dim, experts, n, 81, top_k=8)
        shape = f"sweep scatter T={n} T_K={8 * n}"
        nbytes = 8 * n * dim * 2 + 2 * n * dim * 2
        plans = (
            tri_pt.pick_config(n, 8 * n, dim),
            tri_pt.ScatterConfig("scan", 2, 1024, 512, 4),
            tri_pt.ScatterConfig("sorted", 1, 1024, 0, 4),
        )
        for cfg in plans:
            if cfg.path == "scan" and n * 8 * n > 1 << 28:
                continue
            timed(
                shape,
                f"{cfg.path} {cfg[1:]}",
                lambda c=cfg: tri_pt.scatter_add_padded(out, sx, cnt, idx, config=c),
                nbytes,
            )
    print("config sweep, big shape (ShuffleConfig(block_t, block_d, d_iters, block_g, warps))")
    counts = split_counts(rows, ep, experts // ep, 82)
    shape = f"big dense T={rows} D={dim}"
    default = tri_sh.pick_config(rows, dim, 2, ep, experts // ep)
    print(f"  default {default}")
    variants = [(4, 1024, 2, 4), (8, 1024, 2, 4), (8, 1024, 1, 4), (16, 1024, 2, 8),
                (32, 512, 4, 8), (8, 2048, 1, 8), (2, 2048, 1, 4), (16, 256, 8, 4)]  # fmt: skip
    if DRY:
        variants = [(4, 16, 4, 4), (8, 32, 1, 4)]
    for cfg in [default] + [tri_sh.ShuffleConfig(bt, bd, di, 16, w) for bt, bd, di, w in variants]:
        for combine in (True, False):
            timed(shape, f"{'combine' if combine else 'split'} {tuple(cfg)}",
                  lambda c=cfg, m=combine: tri_sh.shuffle(x, counts, 0, experts // ep, False, m,
                                                          config=c), 4 * rows * dim)  # fmt: skip
    print("config sweep, scatter sorted plan (ScatterConfig('sorted', block_n, block_d, 0, warps))")
    sx, cnt, idx, out = scatter_problem(*big_scatter_shape(), 83, top_k=8)
    for bn, bd, w in ((1, 1024, 4), (1, 2048, 8), (2, 1024, 8), (4, 512, 4), (1, 512, 2)):
        cfg = tri_pt.ScatterConfig("sorted", bn, bd, 0, w)
        timed(
            "big top-8 scatter",
            f"sorted {cfg[1:]}",
            lambda c=cfg: tri_pt.scatter_add_padded(out, sx, cnt, idx, config=c),
            1,
        )


def print_table() -> None:
    print()
    print(f"{'shape':<40} {'impl':<28} {'graph us':>9} {'bench us':>9} {'GB/s':>7} {'x ref':>7}")
    for shape, name, g, b, gbs, base in ROWS:
        ratio = f"{base / g:.2f}" if base else ""
        print(f"{shape:<40} {name:<28} {g:9.1f} {b:9.1f} {gbs:7.0f} {ratio:>7}", flush=True)
    print(
        "x ref = reference time / the row's graph time: ours' rows: clone / ours (the share "
        "of clone bandwidth); other rows: ours / theirs (> 1: theirs is faster)"
    )


def main() -> None:
    import triton

    name = "dry (CPU, interpreter)" if DRY else torch.cuda.get_device_name()
    print(torch.__version__, triton.__version__, name)
    sections = [check_shuffles, check_scatter, check_graph_and_compile, check_fbgemm_parity]
    if "--no-timings" not in sys.argv:
        sections.append(timings)
        if "--no-sweeps" not in sys.argv:
            sections.append(sweeps)
        sections.append(print_table)
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--sections=")),
                None)  # fmt: skip
    if only:
        everything = [*sections, timings, sweeps, print_table]
        sections = [s for s in dict.fromkeys(everything) if s.__name__ in only]
    for section in sections:
        try:
            section()
        except Exception:  # noqa: BLE001 - report and go on with the next section
            traceback.print_exc()
            FAILS.append(f"exception in {section.__name__}")
    print("FAILS:", FAILS or "none")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
