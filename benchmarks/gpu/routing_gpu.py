"""GPU checks of index_shuffling and route (one H200 run): every kept plan bit-exact.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
        python3 benchmarks/gpu/routing_gpu.py

Bit-exact against the torch reference run on the GPU too: random non-zero scores, ties, NaN /
-inf / -0.0 rows, expert ranges, valid counts, column-major and padded layouts, fp32 / bf16 /
fp16, each public call twice (the full launch, then the bound relaunch) and through the custom
op; outputs poisoned through the caching allocator. The shapes take every plan the chooser keeps
by default, and ``forced`` runs each plan at GPU sizes through ``Constraints`` (several groups of
D, the scan launched, rounds of row maxima, ...). Then: no host sync
(``set_sync_debug_mode("error")``), CUDA graph replay on new inputs, ``torch.compile(fullgraph=
True)``, and ``cooperative_stress``: eager calls that take the cooperative launch (A, grid
barrier, C) hundreds of times back to back and on two streams at once. Timings live in
``moe-bench kernels --sweep routing`` and ``routing_plans.py``.
``ROUTING_GPU_DRY_RUN=1 TRITON_INTERPRET=1`` runs a tiny version on CPU; ``ROUTING_GPU_PARTS``
picks parts (e.g. ``correctness,forced``); ``ROUTING_GPU_JOBS=N`` checks the shapes in N worker
processes (each compiles its own kernels).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from common import FAILS, check, poison
from common import same_bits as same

from moe_kernels._triton.routing import eager as lane
from moe_kernels._triton.routing.launch import device_of, problem_of, run
from moe_kernels._triton.routing.plan import Constraints, choose_plan
from moe_kernels.reference.routing import index_shuffling_reference, route_reference
from moe_kernels.routing import index_shuffling, route

DRY = os.environ.get("ROUTING_GPU_DRY_RUN") == "1"
dev = torch.device("cpu" if DRY else "cuda")


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
        poison(T * k * 16, device=dev)
        got = route(
            x,
            k,
            valid_token_count=vtc,
            expert_index_start=start,
            expert_index_end=end,
            renormalize=renorm,
        )
        want = route_reference(x, k, vtc, s, e, renorm)
        op = torch.ops.moe_kernels.route.default(x, k, vtc, s, e, renorm, None, 1, 1, 1.0)
        bad = [f for f, a, b in zip(got._fields, got, want, strict=True) if not same(a, b)]
        bad += [f"op:{f}" for f, a, b in zip(got._fields, got, op, strict=True) if not same(a, b)]
        check(f"route renorm={renorm} {launch} {tag}", not bad, str(bad) if bad else "")
    for launch in ("full", "bound"):
        poison(T * k * 16, device=dev)
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
            plain = (None, 1, 1, 1.0)  # no bias, groups or scale
            out += tuple(torch.ops.moe_kernels.route.default(x, k, vtc, 0, E, False, *plain))
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


def cooperative_stress() -> None:
    """Eager calls, most taking the cooperative launch (A, grid barrier, C in one kernel):
    hundreds back to back on rotating inputs without a sync, then on two streams at once; every
    kept result bit-exact, and the cooperative launch taken wherever the plan has it (a bound
    entry with a barrier)."""
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
        plans = [choose_plan(problem_of(xs[0], k, v, 0, E, False, r), device_of(0))
                 for v, r in ((None, True), (vtc, False))] if not DRY else []  # fmt: skip
        want_fused = sum(p.cooperative for p in plans)
        ok = ok and (DRY or fused == want_fused)  # the cooperative launch wherever planned
        ok = ok and (DRY or public == 2)  # route's and index_shuffling's, by their public calls
        check(
            f"eager, {n_calls} back-to-back calls {tag}",
            ok,
            f"(cooperative plans bound: {fused} of {want_fused}, public keys: {public})",
        )
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
        check(f"eager on two streams at once {tag}", ok)


FORCED = [
    # (T, E, k, dtype, start, end, valid, constraints): each kept plan at GPU sizes
    (100000, 48, 4, torch.float32, 3, 40, 99000, Constraints(placement="ranked")),
    (300000, 64, 12, torch.bfloat16, 0, 64, None, Constraints(placement="sorted")),
    (300000, 40, 8, torch.float16, 5, 36, 290000, Constraints(placement="sorted")),
    (200000, 96, 5, torch.float32, 0, 96, None, Constraints(placement="sorted")),
    (300000, 128, 8, torch.bfloat16, 0, 16, None, Constraints(placement="counted")),
    (300000, 16, 12, torch.float32, 0, 16, 250000, Constraints(placement="counted")),
    (300000, 256, 8, torch.bfloat16, 100, 117, None, Constraints(placement="prefix")),
    (
        300000,
        128,
        8,
        torch.float16,
        0,
        128,
        None,
        Constraints(placement="columns", scan_in_c=False, runs_group=16),
    ),
    (
        300000,
        64,
        6,
        torch.bfloat16,
        4,
        60,
        280000,
        Constraints(placement="columns", scan_in_c=True),
    ),  # fmt: skip
    (8192, 128, 8, torch.bfloat16, 0, 128, None, Constraints(placement="columns")),
    (8192, 32, 8, torch.float32, 0, 32, 8000, Constraints(placement="sorted", scan_in_c=True)),
]


def forced() -> None:
    """Each kept plan forced at GPU sizes (route and index_shuffling, where the plan applies)."""
    print("== forced plans (Constraints) bit-exact vs the reference")
    for T, E, k, dtype, s, e, valid, c in FORCED:
        T = min(T, 300) if DRY else T
        x = scores(T, E, dtype, kind="special" if T % 2 else "ties", seed=T + E)
        vtc = None if valid is None else torch.tensor([min(valid, T)], device=dev)
        tag = f"T={T} E={E} k={k} {str(dtype)[6:]} [{s},{e}) {c}"
        for route_op in (True, False):
            if route_op and c.placement == "prefix":
                continue
            try:
                got = run(x, k, vtc, s, e, False, route_op, c, one_buffer=route_op)
                want = (route_reference(x, k, vtc, s, e, False) if route_op
                        else index_shuffling_reference(x, s, e, vtc, k))  # fmt: skip
                check(f"{'route' if route_op else 'index_shuffling'} {tag}", same(got, want))
            except Exception as exc:  # noqa: BLE001
                check(f"{tag}", False, f"raised {exc!r}"[:300])


def main() -> int:
    print(f"torch {torch.__version__} triton {triton.__version__} device {dev}")
    if not DRY:
        print(torch.cuda.get_device_name())
    parts = [correctness, forced, no_sync_graph_compile, cooperative_stress]
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
