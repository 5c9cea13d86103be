"""GPU check and timing of index_shuffling and route (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 packages/moe-kernels/gpu/routing_gpu.py

Checks (bit-exact vs the torch reference, run on the GPU too): random non-zero scores, ties,
NaN/-inf rows, expert ranges, valid counts, column-major layout, fp32/bf16/fp16; outputs poisoned
through the caching allocator; under ``set_sync_debug_mode("error")``; in a captured CUDA graph
replayed on new inputs; compiled with ``fullgraph=True``. Then times index_shuffling and route
(``do_bench`` medians, which flush L2 and so show GPU time; plus back-to-back eager calls, which
show the host's launch cost too; plus a CUDA-graph replay) beside torch-native routing (topk +
stable sort + bincount) and a clone of the scores, and sweeps launch configs.
``fused_stress`` drives the eager calls that take the fused launch (A, grid barrier, C) hundreds
of times back to back and on two streams at once.
``ROUTING_GPU_DRY_RUN=1 TRITON_INTERPRET=1`` runs a tiny version on CPU. ``ROUTING_GPU_PARTS``
picks parts (e.g. ``correctness,no_sync_graph_compile,fused_stress``), ``ROUTING_GPU_CASES=cols``
only the token-column plans' shapes, ``ROUTING_GPU_JOBS=N`` checks the shapes in N worker
processes (each compiles its own kernels), ``ROUTING_COLS_ROUTE=0/1`` forces route's plan.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from triton.testing import do_bench

from moe_kernels._reference.routing import index_shuffling_reference, route_reference
from moe_kernels._triton import routing as tri
from moe_kernels._triton import routing_eager as lane
from moe_kernels.routing import index_shuffling, route

DRY = os.environ.get("ROUTING_GPU_DRY_RUN") == "1"
if os.environ.get("ROUTING_COLS_ROUTE") is not None:  # route on the token columns: 0 / 1
    tri._COLS_ROUTE = os.environ["ROUTING_COLS_ROUTE"] == "1"  # here, so workers see it too
dev = torch.device("cpu" if DRY else "cuda")
FAILS: list[str] = []
COPY_CEILING = 4.2e12


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal; NaN equals NaN (payloads may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb):
            return False
        return torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32))
    return torch.equal(a, b)


def poison(nbytes: int) -> None:
    """Leave 0x7F-filled blocks in the caching allocator so fresh outputs start as garbage."""
    blocks = [torch.full((nbytes + 4096,), 0x7F, dtype=torch.uint8, device=dev) for _ in range(4)]
    del blocks


def scores(T, E, dtype, kind="softmax", seed=0, layout="row"):
    g = torch.Generator(device=dev).manual_seed(seed)
    if kind == "softmax":
        x = torch.randn(T, E, device=dev, generator=g).softmax(-1)
    elif kind == "ties":
        x = torch.randint(1, 4, (T, E), device=dev, generator=g).float() * 0.25
    else:  # special
        x = torch.randn(T, E, device=dev, generator=g)
        x[torch.rand(T, E, device=dev, generator=g) < 0.1] = float("nan")
        x[torch.rand(T, E, device=dev, generator=g) < 0.1] = float("-inf")
        x[torch.rand(T, E, device=dev, generator=g) < 0.05] = -0.0
        x[:: max(T // 7, 1)] = float("-inf")
    x = x.to(dtype)
    if layout == "col":
        x = x.t().contiguous().t()
    elif layout in ("pad", "odd"):  # row stride E + 2 (pairs stay 4-byte aligned) or E + 1
        pad = 2 if layout == "pad" else 1
        x = torch.empty(T, E + pad, device=dev, dtype=dtype)[:, :E].copy_(x)
    return x


def check_case(T, E, k, dtype, start=None, end=None, valid=None, kind="softmax", layout="row"):
    x = scores(T, E, dtype, kind, seed=T + E + k, layout=layout)
    s, e = (0 if start is None else start), (E if end is None else end)
    vtc = None if valid is None else torch.tensor([valid], device=dev, dtype=torch.int32)
    tag = f"T={T} E={E} k={k} {str(dtype)[6:]} [{s},{e}) valid={valid} {kind} {layout}"
    # Each shape twice: the first eager call launches through Triton, the second relaunches the
    # bound handles (int addresses into a fresh buffer).
    for renorm, launch in ((False, "full"), (False, "bound"), (True, "full"), (True, "bound")):
        poison(T * k * 16)
        got = route(
            x,
            k,
            valid_token_count=vtc,
            expert_index_start=start,
            expert_index_end=end,
            renormalize=renorm,
        )
        want = route_reference(x, k, vtc, s, e, renorm)
        op = torch.ops.moe_kernels.route.default(x, k, vtc, s, e, renorm)
        bad = [f for f, a, b in zip(got._fields, got, want, strict=True) if not same(a, b)]
        bad += [f"op:{f}" for f, a, b in zip(got._fields, got, op, strict=True) if not same(a, b)]
        check(f"route renorm={renorm} {launch} {tag}", not bad, str(bad) if bad else "")
    for launch in ("full", "bound"):
        poison(T * k * 16)
        got = index_shuffling(x, start, end, vtc, k)
        want = index_shuffling_reference(x, s, e, vtc, k)
        bad = [i for i in range(3) if not same(got[i], want[i])]
        check(f"index_shuffling {launch} {tag}", not bad, str(bad) if bad else "")


def correctness() -> None:
    print("== correctness (bit-exact vs the reference on the same device)")
    big = 1 if DRY else 0
    cases = [
        dict(T=64 if big else 4096, E=16, k=8, dtype=torch.bfloat16),
        dict(T=64 if big else 4096, E=128, k=8, dtype=torch.bfloat16),
        dict(T=64 if big else 4096, E=128, k=8, dtype=torch.float32),
        dict(T=64 if big else 65536, E=128, k=8, dtype=torch.bfloat16, valid=60000),
        dict(
            T=50 if big else 1000,
            E=7,
            k=3,
            dtype=torch.float16,
            start=1,
            end=6,
            valid=900,
            layout="col",
        ),
        dict(T=33 if big else 333, E=512, k=5, dtype=torch.float32, kind="special"),
        dict(T=33 if big else 2049, E=33, k=33, dtype=torch.bfloat16, kind="ties"),
        dict(
            T=40 if big else 100000, E=64, k=6, dtype=torch.float32, start=16, end=48, kind="ties"
        ),
        dict(T=40 if big else 300000, E=128, k=8, dtype=torch.bfloat16, start=32, end=32),
        # C's counting placement (sorted path, <= 16 local experts): full, ranges of 1/4/8
        dict(T=40 if big else 300000, E=16, k=8, dtype=torch.bfloat16, kind="ties"),
        dict(T=40 if big else 300000, E=16, k=4, dtype=torch.float32, valid=299000),
        dict(T=40 if big else 300000, E=128, k=8, dtype=torch.bfloat16, start=32, end=33),
        dict(T=40 if big else 300000, E=128, k=8, dtype=torch.float16, start=32, end=36),
        dict(
            T=40 if big else 200000,
            E=32,
            k=8,
            dtype=torch.bfloat16,
            start=8,
            end=16,
            kind="special",
        ),  # fmt: skip
        # index_shuffling's token-column plan (16-bit scores, 64 / 128 experts): ties, NaN,
        # -inf, -0.0, k < 8, ranges, valid counts, padded rows; odd row strides take another
        dict(
            T=40 if big else 300000, E=128, k=8, dtype=torch.bfloat16, kind="special", layout="pad"
        ),  # fmt: skip
        dict(T=40 if big else 300000, E=128, k=8, dtype=torch.float16, kind="ties"),
        dict(
            T=40 if big else 200000, E=64, k=5, dtype=torch.bfloat16, kind="special", valid=150000
        ),  # fmt: skip
        dict(
            T=40 if big else 200000, E=128, k=1, dtype=torch.bfloat16, kind="ties", start=5, end=100
        ),  # fmt: skip
        dict(
            T=40 if big else 100000, E=128, k=3, dtype=torch.float16, kind="special", layout="odd"
        ),  # fmt: skip
        dict(T=40 if big else 100000, E=64, k=8, dtype=torch.float16, kind="special"),
        dict(T=1, E=8, k=2, dtype=torch.float16),
        dict(T=5, E=1, k=1, dtype=torch.bfloat16, kind="special"),
        dict(T=0, E=8, k=2, dtype=torch.bfloat16),
    ]
    if os.environ.get("ROUTING_GPU_CASES") == "cols":  # the token-column plans' shapes only
        cases = [c for c in cases if c["E"] in (64, 128) and c["dtype"] != torch.float32][::-1]
    jobs = int(os.environ.get("ROUTING_GPU_JOBS", "1"))
    if jobs > 1:  # cases in worker processes: most of a case's time is compiling its kernels
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for text, fails in pool.imap(_case_in_worker, cases):
                print(text, end="", flush=True)
                FAILS.extend(fails)
        return
    for c in cases:
        _run_case(c)


def _run_case(c: dict) -> None:
    try:
        check_case(**c)
    except Exception:
        traceback.print_exc()
        check(f"case {c}", False, "raised")


def _case_in_worker(c: dict) -> tuple[str, list[str]]:
    """``_run_case`` in a worker process: its printed lines and its failures."""
    import contextlib
    import io

    out = io.StringIO()
    del FAILS[:]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        _run_case(c)
    return out.getvalue(), list(FAILS)


def no_sync_graph_compile() -> None:
    """No host sync, CUDA graph replay on new inputs, compile: on a small shape (renormalized)
    and on one that takes the token-column plans (T*k > 32768 pairs, 16-bit scores, 128
    experts, not renormalized)."""
    shapes = [(64, 32, 4, True)] if DRY else [(4096, 128, 8, True), (65536, 128, 8, False)]
    for T, E, k, renorm in shapes:
        print(f"== no sync, CUDA graph, compile: T={T} E={E} k={k} renormalize={renorm}")
        _no_sync_graph_compile(T, E, k, renorm)


def _no_sync_graph_compile(T: int, E: int, k: int, renorm: bool) -> None:
    x = scores(T, E, torch.bfloat16, seed=1)
    vtc = torch.tensor([T - 5], device=dev, dtype=torch.int64)

    def fn(x, vtc):
        p = route(
            x, k, valid_token_count=vtc, expert_index_start=8, expert_index_end=24,
            renormalize=renorm,
        )  # fmt: skip
        return (*p, *index_shuffling(x, 0, E, vtc, k))

    def ref(x, vtc):
        return (
            *route_reference(x, k, vtc, 8, 24, renorm),
            *index_shuffling_reference(x, 0, E, vtc, k),
        )

    if not DRY:
        fn(x, vtc)  # compile the kernels first
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            out = fn(x, vtc)
            out += tuple(torch.ops.moe_kernels.route.default(x, k, vtc, 0, E, False))
            torch.cuda.set_sync_debug_mode(0)
            check("no host sync (route, index_shuffling, op path)", True)
        except Exception as exc:
            torch.cuda.set_sync_debug_mode(0)
            check("no host sync", False, repr(exc)[:300])
        try:
            sx, sv = x.clone(), vtc.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn(sx, sv)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = fn(sx, sv)
            for seed in (7, 8):
                sx.copy_(scores(T, E, torch.bfloat16, seed=seed))
                sv.fill_(T - seed * 100)
                g.replay()
                want = ref(sx, sv)
                ok = all(same(a, b) for a, b in zip(gout, want, strict=True))
                check(f"CUDA graph replay on new inputs (seed {seed})", ok)
        except Exception:
            traceback.print_exc()
            check("CUDA graph", False, "raised")
    try:
        torch._dynamo.reset()
        cfn = torch.compile(fn, fullgraph=True)
        got = cfn(x, vtc)
        ok = all(same(a, b) for a, b in zip(got, fn(x, vtc), strict=True))
        ok &= all(same(a, b) for a, b in zip(got, ref(x, vtc), strict=True))
        check("torch.compile(fullgraph=True) == eager == reference", ok)
    except Exception:
        traceback.print_exc()
        check("compile", False, "raised")


def fused_stress() -> None:
    """Eager calls that take the fused launch (A, grid barrier, C in one cooperative kernel):
    hundreds back to back on rotating inputs without a sync, then on two streams at once; every
    kept result bit-exact, and the fused launch really taken (a bound entry with a barrier)."""
    cases = [(4096, 16, 8, torch.bfloat16), (4096, 128, 8, torch.bfloat16),
             (8192, 128, 8, torch.float16), (1000, 7, 3, torch.float16),
             (4096, 128, 8, torch.float32), (77, 64, 5, torch.bfloat16)]  # fmt: skip
    n_calls = 8 if DRY else 400
    for T, E, k, dtype in cases:
        T = min(T, 40) if DRY else T
        tag = f"T={T} E={E} k={k} {str(dtype)[6:]}"
        xs = [scores(T, E, dtype, kind="ties" if s % 2 else "softmax", seed=s) for s in range(5)]
        vtc = torch.tensor([T - 7], device=dev, dtype=torch.int32)
        wants = [(route_reference(x, k, None, 0, E, False),
                  index_shuffling_reference(x, 0, E, vtc, k)) for x in xs]  # fmt: skip
        lane._BOUND.clear()
        kept: list = []
        for i in range(n_calls):
            j = i % len(xs)
            kept.append((j, route(xs[j], k), index_shuffling(xs[j], None, None, vtc, k)))
            kept = kept[-2 * len(xs) :]
        if not DRY:
            torch.cuda.synchronize()
        ok = all(
            all(same(a, b) for a, b in zip(r, wants[j][0], strict=True))
            and all(same(a, b) for a, b in zip(i_, wants[j][1], strict=True))
            for j, r, i_ in kept
        )
        fused = sum(e.barrier is not None for e in lane._BOUND.values())
        public = sum(key[6] is None for key in lane._BOUND)  # the public lane's keys (start None)
        ok = ok and (DRY or fused > 0)  # the GPU must have taken the fused launch
        ok = ok and (DRY or public == 2)  # route's and index_shuffling's, by their public calls
        check(f"fused, {n_calls} back-to-back calls {tag}", ok,
              f"(fused plans bound: {fused}, public keys: {public})")  # fmt: skip
        if DRY:
            continue
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for st in streams:
            st.wait_stream(torch.cuda.current_stream())
        outs: list = [None, None]
        for _ in range(100):
            for w, st in enumerate(streams):
                with torch.cuda.stream(st):
                    outs[w] = route(xs[w], k)
        torch.cuda.synchronize()
        ok = all(all(same(a, b) for a, b in zip(outs[w], wants[w][0], strict=True))
                 for w in range(2))  # fmt: skip
        check(f"fused on two streams at once {tag}", ok)


def torch_native(x: torch.Tensor, k: int):
    """topk + stable sort of the expert ids + bincount (what the kernels replace)."""
    idx = torch.topk(x, k, dim=1).indices.flatten()
    sorted_e, perm = torch.sort(idx, stable=True)
    counts = torch.bincount(idx, minlength=x.shape[1])
    return counts, sorted_e, perm // k


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def eager_loop(fn, n=200) -> float:
    """Back-to-back calls without L2 flushes: includes the host's launch cost."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def graph_time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def timings() -> None:
    print("== timings (us, medians; bf16 scores, top_k=8)")
    shapes = [(4096, 16), (4096, 128), (65536, 128), (1048576, 128)]
    k = 8
    hdr = (
        f"{'T':>8} {'E':>4} | {'torch':>8} {'idx_shuf':>8} {'route':>8} {'route_op':>8} "
        f"{'graph':>8} {'eagerIS':>8} {'eagerRt':>8} {'clone':>8} | {'x idx':>6} {'x route':>7} "
        f"| {'%ceilIS':>7} {'%clnIS':>6} {'%ceilRt':>7}"
    )
    rows = []
    for T, E in shapes:
        x = scores(T, E, torch.bfloat16, seed=T)
        t_torch = bench(lambda x=x: torch_native(x, k))
        t_is = bench(lambda x=x: index_shuffling(x, top_k=k))
        t_rt = bench(lambda x=x: route(x, k))
        t_op = bench(lambda x=x, E=E: torch.ops.moe_kernels.route.default(x, k, None, 0, E, False))
        t_graph = graph_time(lambda x=x: route(x, k))
        e_is = eager_loop(lambda x=x: index_shuffling(x, top_k=k))
        e_rt = eager_loop(lambda x=x: route(x, k))
        t_clone = bench(lambda x=x: x.clone())
        b_is = x.numel() * 2 + 2 * T * k * 4  # scores once + the two index outputs once
        b_rt = b_is + T * k * 4 * 2  # + weights and inverse
        rows.append(
            f"{T:>8} {E:>4} | {t_torch:8.1f} {t_is:8.1f} {t_rt:8.1f} {t_op:8.1f} {t_graph:8.1f} "
            f"{e_is:8.1f} {e_rt:8.1f} {t_clone:8.1f} | {t_torch / t_is:6.1f} "
            f"{t_torch / t_rt:7.1f} | {100 * b_is / t_is / 1e6 / COPY_CEILING * 1e12:7.1f} "
            f"{100 * (b_is / t_is) / (2 * x.numel() * 2 / t_clone):6.1f} "
            f"{100 * b_rt / t_rt / 1e6 / COPY_CEILING * 1e12:7.1f}"
        )
        print(rows[-1], flush=True)
    print(hdr)
    print("\n".join(rows))
    print(
        "torch = topk+stable sort+bincount; idx_shuf/route = public calls (eager fast path); "
        "route_op = through the torch.library dispatcher; graph = route replayed in a CUDA graph; "
        "eagerIS/eagerRt = back-to-back eager calls, no L2 flush (host cost included); "
        "%ceil = (scores + index outputs [+ weights, inverse]) / time vs 4.2 TB/s; "
        "%cln = vs the clone of the scores"
    )


def sweep() -> None:
    print("== config sweep: GPU time (do_bench us), bf16, k=8; checked against the reference")
    k = 8
    b = "BLOCK_T"
    grid = [
        (4096, 128, [(32, 1, 4), (32, 1, 8), (16, 1, 4), (16, 1, 2), (32, 1, 4, False)]),
        (4096, 16, [(32, 1, 2), (32, 1, 1), (16, 1, 1), (32, 1, 4)]),
        (65536, 128, [(32, 1, 4), (32, 2, 4), (32, 1, 8), (32, 4, 8)]),
        (
            1048576,
            128,
            [
                (32, 8, 4),
                (32, 8, 8),
                (32, 4, 8),
                (32, 2, 8),
                (32, 16, 4),
                (32, 32, 4),
                (16, 16, 4),
                (16, 16, 2),
                (32, 4, 4),
            ],
        ),
    ]
    for T, E, cfgs in grid:
        x = scores(T, E, torch.bfloat16, seed=3)
        want_is = index_shuffling_reference(x, 0, E, None, k)
        want_rt = route_reference(x, k, None, 0, E, False)
        print(f"  T={T} E={E} default={tri._config(T, E, k, False)}", flush=True)
        for c in cfgs:
            cfg = {b: c[0], "SUB": c[1], "num_warps": c[2]}
            if len(c) > 3:
                cfg["FUSE_SCAN"] = c[3]
            try:

                def run_is(cfg=cfg, x=x, E=E):
                    _, _, ei, ti, _, _, tcpe = tri.routing_triton(
                        x, k, None, 0, E, False, False, False, True, config=cfg
                    )
                    return tcpe, ei, ti

                def run_rt(cfg=cfg, x=x, E=E):
                    return tri.routing_triton(x, k, None, 0, E, False, True, True, False, cfg)[:6]

                ok = all(same(a, b) for a, b in zip(run_is(), want_is, strict=True))
                ok &= all(same(a, b) for a, b in zip(run_rt(), want_rt, strict=True))
                print(
                    f"    {c!s:22} ok={ok} IS {bench(run_is):8.1f}  route {bench(run_rt):8.1f}",
                    flush=True,
                )
                if not ok:
                    FAILS.append(f"sweep {T} {E} {cfg}")
            except Exception as exc:
                print(f"    {c!s:22} raised {exc!r}"[:300])
                FAILS.append(f"sweep {T} {E} {cfg} raised")


def profile() -> None:
    print("== kernel breakdown (profiler, T=1048576 E=128 k=8 bf16, route)")
    x = scores(1048576, 128, torch.bfloat16, seed=5)
    route(x, 8)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            route(x, 8)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40)
    )


def main() -> int:
    print(f"torch {torch.__version__} triton {triton.__version__} device {dev}")
    if not DRY:
        print(torch.cuda.get_device_name())
    parts = [correctness, no_sync_graph_compile, fused_stress]
    if not DRY:
        parts += [timings, sweep, profile]
    if os.environ.get("ROUTING_COLS_ROUTE") is not None:
        print(f"route on the token-column plan: {tri._COLS_ROUTE}")
    if os.environ.get("ROUTING_GPU_PARTS"):  # e.g. correctness,timings
        parts = [p for p in parts if p.__name__ in os.environ["ROUTING_GPU_PARTS"].split(",")]
    for part in parts:
        try:
            part()
        except Exception:
            traceback.print_exc()
            FAILS.append(part.__name__)
    print("FAILS:", FAILS if FAILS else "none")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
