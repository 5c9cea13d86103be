"""The whole compiled grid on the GPU (one H200 run): every op and every routing plan under
``torch.compile(fullgraph=True)``, ``dynamic=False`` and ``dynamic=True``, and one compiled
function called with several ``top_k``, expert ranges and valid counts, each bitwise equal to
the eager call (NaN == NaN).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/compile_grid_gpu.py              # H200
    python3 benchmarks/gpu/compile_grid_gpu.py --parts=several,other_ops   # some parts
    python3 benchmarks/gpu/compile_grid_gpu.py --shard=1/4  # every 4th case from the 2nd
    python3 benchmarks/gpu/compile_grid_gpu.py --dry-run    # CPU (reference path), tiny sizes

Routing: the plans of ``packages/moe-kernels/tests/test_compile_sm90.py`` (PLANS for
``index_shuffling`` and ``route``, SELECTION_PLANS for ``route``; T capped at 65536 here, which
keeps each plan family), plus FBGEMM's test forms (num_tokens 1 and 3, E 16 / 128, bf16 / fp32,
row- and column-major scores, a valid count on doubled scores). Each case compiles afresh
(``torch._dynamo.reset``) for the static and the dynamic run. ``several``: one compiled function,
never reset, called over a list of (top_k, start, end, valid count) per op, as FBGEMM's tests and
users call it (recompiles and automatic dynamic ints included). Every other op: the per-pass
problems of ``compile_gpu.py``, static and dynamic. Prints one line per failure and a summary.
"""

from __future__ import annotations

import sys
import traceback

import torch
from common import FAILS, check, same_bits
from compile_gpu import fresh, problems

import moe_kernels as mk

sys.path.insert(0, "packages/moe-kernels/tests")  # the plan lists, read not imported twice
from test_compile_sm90 import PLANS, SELECTION_PLANS  # noqa: E402

DRY = "--dry-run" in sys.argv
DEV = torch.device("cpu" if DRY else "cuda")
T_CAP = 64 if DRY else 65536
COUNTS = {"cases": 0, "seen": 0}
# --shard=i/n: run the cases whose running number is i mod n (processes side by side)
SHARD = next((tuple(map(int, a.split("=", 1)[1].split("/"))) for a in sys.argv
              if a.startswith("--shard=")), (0, 1))  # fmt: skip


def scores_of(T, E, dtype, seed, col=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, E, generator=g, device=DEV).softmax(-1).to(dtype)
    return x.t().contiguous().t() if col else x


def compare(name: str, fn, args: tuple, dynamic: bool, compiled=None) -> None:
    COUNTS["seen"] += 1
    if (COUNTS["seen"] - 1) % SHARD[1] != SHARD[0] and compiled is None:
        return  # another shard's case (a shared compiled function's calls stay together)
    COUNTS["cases"] += 1
    print(f"  {name}", flush=True)  # progress: the last line names the case running
    try:
        want = fn(*fresh(args))  # fresh clones: an in-place op gets its own output each call
        if compiled is None:
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        got = compiled(*fresh(args))
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        ok = same_bits(tuple(want), tuple(got)) if isinstance(want, tuple) else same_bits(want, got)
        if not ok:
            check(name, False, "differs from eager")
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
        check(name, False, f"{type(exc).__name__}: {str(exc)[:300]}")
        traceback.print_exc(limit=3)


def routing_plans() -> None:
    kinds = (torch.float32, torch.bfloat16, torch.float16)
    for plan, route in [(p, False) for p in PLANS] + [(p, True) for p in PLANS + SELECTION_PLANS]:
        T, E, k, start, end, kind, renorm, *sel = plan
        T = min(T, T_CAP)
        x = scores_of(T, E, kinds[kind], seed=T + E + k)
        if route:
            opts = dict(expert_index_start=start, expert_index_end=end, renormalize=renorm)
            if sel:
                bias, n_groups, topk_groups, scaled = sel
                b = torch.randn(E, device=DEV) * 0.1 if bias else None
                opts.update(bias=b, n_groups=n_groups, topk_groups=topk_groups,
                            scale=2.5 if scaled else 1.0)  # fmt: skip

            def fn(s, k=k, opts=opts):
                return tuple(mk.route(s, k, **opts))
        else:

            def fn(s, k=k, start=start, end=end):
                return tuple(mk.index_shuffling(s, start, end, None, k))

        for dynamic in (False, True):
            compare(f"{'route' if route else 'index_shuffling'} {plan} dyn={dynamic}", fn, (x,),
                    dynamic)  # fmt: skip


def fbgemm_forms() -> None:
    """FBGEMM's compiled index_shuffling calls (its test_top1_index_shuffling, and top_k 1-8)."""
    for T, E, dtype, col, padded, k in [
        (T, E, dt, col, pad, k)
        for T in (1, 3, 123)
        for E in (16, 128)
        for dt in (torch.bfloat16, torch.float32)
        for col in (False, True)
        for pad in (False, True)
        for k in (1, 2, 8)
        if k == 1 or (T == 1 and not col and not pad)  # FBGEMM's test is top-1; k 2, 8 once
    ]:
        x = scores_of(2 * T if padded else T, E, dtype, seed=T * E + k, col=col)
        vtc = torch.tensor([T], device=DEV) if padded else None

        def fn(s, c, k=k):
            return tuple(mk.index_shuffling(s, None, None, c, k))

        compare(f"fbgemm form T={T} E={E} {dtype} col={col} padded={padded} k={k}", fn,
                (x, vtc), dynamic=False)  # fmt: skip


def several() -> None:
    """One compiled function per op, called over many top_k / ranges / valid counts."""
    calls = [(1, 0, 128, None), (2, 0, 128, 5), (8, 0, 128, None), (4, 32, 64, None),
             (8, 16, 80, 3), (6, 0, 16, None), (1, 127, 128, 1), (8, 0, 128, 64)]  # fmt: skip
    ops = ("index_shuffling", "route")
    groups = [(op, dt) for op in ops for dt in (torch.bfloat16, torch.float32)]
    for n, (op, dtype) in enumerate(groups):
        if n % SHARD[1] != SHARD[0]:
            continue  # another shard's compiled function (--shard splits this part by function)
        x = scores_of(64, 128, dtype, seed=7)

        def fn(s, k, a, b, c, op=op):
            if op == "route":
                return tuple(mk.route(s, k, valid_token_count=c, expert_index_start=a,
                                      expert_index_end=b))  # fmt: skip
            return tuple(mk.index_shuffling(s, a, b, c, k))

        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        for k, a, b, valid in calls:
            vtc = None if valid is None else torch.tensor([valid], device=DEV)
            compare(f"several {op} {dtype} k={k} [{a},{b}) valid={valid}", fn,
                    (x, k, a, b, vtc), dynamic=False, compiled=compiled)  # fmt: skip


def other_ops() -> None:
    for name, (fn, args) in problems(64 if DRY else 512).items():
        for dynamic in (False, True):
            compare(f"{name} dyn={dynamic}", fn, args, dynamic)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 256
    parts = (fbgemm_forms, several, routing_plans, other_ops)
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--parts=")), None)
    for part in parts:
        if only and part.__name__ not in only:
            continue
        before = len(FAILS)
        part()
        print(f"{part.__name__}: {COUNTS['cases']} cases so far, {len(FAILS) - before} failed",
              flush=True)  # fmt: skip
    print(f"compiled grid: {COUNTS['cases']} cases, {len(FAILS)} failed:",
          "pass" if not FAILS else "FAIL")  # fmt: skip
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
