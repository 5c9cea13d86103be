"""Routing plan candidates over a grid of problems: each checked bit-exact against the
reference, then timed (device time in CUDA graphs, eager ``do_bench`` medians). The data behind
the chooser's rules (``moe_kernels/_triton/routing/plan.py``, ``docs/routing.md``).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/routing_plans.py --jobs 14 --json $OUT/routing-plans.json

Candidates of a problem, forced through ``Constraints`` (the library's one override): the
``ranked`` plan and the placement the chooser takes for large T (columns, counted, prefix or
sorted), each with the histogram scan in C and as a launch of its own; and the default plan.
``--jobs N`` compiles and checks in N worker processes first (Triton's disk cache then serves
the timing pass). ``--T/--E/--k`` narrow the grid; ``--dry`` runs a tiny grid on the CPU (with
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

import common
import torch

from moe_kernels._triton.routing.launch import device_of, problem_of, run
from moe_kernels._triton.routing.plan import Constraints, Problem, choose_plan
from moe_kernels.reference.routing import index_shuffling_reference, route_reference
from moe_kernels.testing import bits_equal

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def problems(args) -> list[tuple]:
    """(op, dtype name, E, k, T) of the grid, ops and dtypes outermost."""
    return [(op, dt, E, k, T) for op in ("route", "index_shuffling") for dt in args.dtypes
            for E in args.E for k in args.k for T in args.T if k <= E]  # fmt: skip


def scores(T: int, E: int, dtype: torch.dtype, dev: str) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(T * 7 + E)
    return torch.randn(T, E, device=dev, generator=g).softmax(-1).to(dtype)


def candidates(x: torch.Tensor, k: int, route: bool) -> dict[str, Constraints | None]:
    """The variants of a problem: name -> constraints (None: the default plan)."""
    T, E = x.shape
    d = device_of(0)  # the interpreter's under TRITON_INTERPRET=1
    big = Problem(1 << 20, E, k, 0, E, x.dtype, route, words=x.dtype != torch.float32)
    out: dict[str, Constraints | None] = {"default": None}
    prob = problem_of(x, k, None, 0, E, False, route)
    for place in dict.fromkeys(("ranked", choose_plan(big, d).placement)):
        for scan in (True, False):
            c = Constraints(placement=place, scan_in_c=scan)
            try:
                choose_plan(prob, d, c)
            except ValueError:
                continue
            out[f"{place}/{'C' if scan else 'B'}"] = c
    return out


def call(x: torch.Tensor, k: int, route: bool, c: Constraints | None, one_buffer: bool = False):
    return run(x, k, None, 0, x.shape[1], False, route, c, one_buffer)


def check_problem(job: tuple) -> list[str]:
    """Compile and check every candidate of one problem; the failures."""
    (op, dt, E, k, T), dev = job
    x = scores(T, E, DTYPES[dt], dev)
    route = op == "route"
    want = (route_reference(x, k, None, 0, E, False) if route
            else index_shuffling_reference(x, 0, E, None, k))  # fmt: skip
    fails = []
    for name, c in candidates(x, k, route).items():
        try:
            ok = bits_equal(call(x, k, route, c), want)
            ok = ok and bits_equal(call(x, k, route, c, one_buffer=True), want)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            ok, name = False, f"{name} raised {type(exc).__name__}: {exc}"[:200]
        if not ok:
            fails.append(f"{op} {dt} E={E} k={k} T={T} {name}")
    return fails


def time_problem(prob: tuple, dev: str, dry: bool) -> list[dict]:
    op, dt, E, k, T = prob
    x = scores(T, E, DTYPES[dt], dev)
    route = op == "route"
    rows = []
    for name, c in candidates(x, k, route).items():
        plan = choose_plan(problem_of(x, k, None, 0, E, False, route), device_of(0), c)
        graph = common.graph_us(lambda c=c: call(x, k, route, c), calls=10, replays=5, dry=dry)
        eager = common.bench_us(lambda c=c: call(x, k, route, c, True), dry=dry, warmup_ms=5,
                                rep_ms=20)  # fmt: skip
        rows.append(dict(op=op, dtype=dt, E=E, k=k, T=T, variant=name, graph_us=graph,
                         eager_us=eager, placement=plan.placement, topk=plan.topk,
                         scan_in_c=plan.scan_in_c, n_programs=plan.n_programs,
                         cooperative=plan.cooperative))  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """Per (op, dtype, E, k, T): the default's graph time, the best variant and its time."""
    lines = ["op               dtype   E  k       T  default us  best variant     best us  x"]
    keys = dict.fromkeys((r["op"], r["dtype"], r["E"], r["k"], r["T"]) for r in rows)
    for key in keys:
        rs = [r for r in rows if (r["op"], r["dtype"], r["E"], r["k"], r["T"]) == key]
        best = min(rs, key=lambda r: r["graph_us"])
        d = next(r for r in rs if r["variant"] == "default")
        lines.append(f"{key[0]:16} {key[1]:5} {key[2]:3} {key[3]:2} {key[4]:7} "
                     f"{d['graph_us']:10.1f}  {best['variant']:15} {best['graph_us']:7.1f} "
                     f"{d['graph_us'] / best['graph_us']:5.2f}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument("--T", type=ints, default=[1024, 4096, 16384, 65536])
    ap.add_argument("--E", type=ints, default=[8, 16, 32, 64, 128, 320])
    ap.add_argument("--k", type=ints, default=[1, 2, 8])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp32"])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="a tiny grid on the CPU (interpreter)")
    args = ap.parse_args()
    if args.dry:
        args.T, args.E, args.k = [64], [8, 64], [2]
    dev = "cpu" if args.dry else "cuda"
    probs = problems(args)
    t0 = time.time()
    jobs = [(p, dev) for p in probs]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            fails = [f for fs in pool.imap_unordered(check_problem, jobs) for f in fs]
    else:
        fails = [f for job in jobs for f in check_problem(job)]
    print(f"checked {len(probs)} problems in {time.time() - t0:.0f} s: "
          f"{len(fails)} failures", flush=True)  # fmt: skip
    for f in fails:
        print("  FAIL", f)
    rows = []
    for i, prob in enumerate(probs):
        rows += time_problem(prob, dev, args.dry)
        if i % 24 == 0:
            print(f"  timed {i + 1}/{len(probs)} ({time.time() - t0:.0f} s)", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows, fails=fails), f)
    print(table(rows))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
