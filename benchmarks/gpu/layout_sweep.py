"""The blocked scale layouts (``to_blocked_per_group_2d`` / ``_3d``) against a clone of the same
bytes, over a sweep of shapes (one H200 run): device time in a CUDA graph, the eager ``do_bench``
median, and the host time of one eager call, each shape's output checked against the torch
reference once (the layouts' correctness: ``tests/gpu/test_mxfp8_gpu.py``).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/layout_sweep.py [--quick]

Targets (issue "Compatibility"): graph time <= 1.3x the clone's, eager <= 2x the clone's, on
every shape (G > 32, C not a multiple of 4, C < 16 included). ``--host`` adds the breakdown of an
eager call's host time (the public op, the launcher under it, one allocation, a clone);
``--configs`` runs only the sweep of (column chunk, warps) overrides behind ``_block_c``'s rules.
``LAYOUT_SWEEP_DRY_RUN=1 TRITON_INTERPRET=1`` runs a tiny version on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from common import bench_us, clone_of, graph_us, host_us

from moe_kernels import mxfp8 as mx
from moe_kernels.reference import mxfp8 as ref

DRY = os.environ.get("LAYOUT_SWEEP_DRY_RUN") == "1"
dev = torch.device("cpu" if DRY else "cuda")


def ends(R: int, G: int, seed: int) -> torch.Tensor:
    """(G,) int32 non-decreasing end offsets, last = R, some groups empty when G > 2."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, R + 1, (G - 1,), generator=g).sort().values
    return torch.cat([cuts, torch.tensor([R])]).to(torch.int32)


ROWS: list[tuple] = []
BAD: list[str] = []  # shapes whose timed output is not the reference's (the one-line sanity check)


def run_case(kind: str, shape: tuple, host: bool) -> None:
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    if kind == "2d":
        R, C, G = shape
        s_d = torch.randint(0, 256, (R, C), generator=g, dtype=torch.uint8).to(dev)
        e_d = ends(R, G, R + C + G).to(dev)
        want = ref.to_blocked_per_group_2d(s_d, e_d)  # the torch reference, on the same device
        fn = lambda: mx.to_blocked_per_group_2d(s_d, e_d)  # noqa: E731
        got = fn()
        rows = int(want[1][-1])
        ok = torch.equal(got[1], want[1]) and torch.equal(got[0][:rows], want[0][:rows])
        nbytes = R * C + rows * ref.ceil_to(C, 4)
    else:
        E, N, C = shape
        s_d = torch.randint(0, 256, (E, N, C), generator=g, dtype=torch.uint8).to(dev)
        want = ref.to_blocked_per_group_3d(s_d)
        fn = lambda: mx.to_blocked_per_group_3d(s_d)  # noqa: E731
        ok = torch.equal(fn(), want)
        nbytes = s_d.numel() + want.numel()
    if not ok:
        BAD.append(f"{kind} {shape}")
    clone = clone_of(nbytes, dev)
    ours_g, clone_g = graph_us(fn, 10, 20, DRY), graph_us(clone, 10, 20, DRY)
    ours_e, clone_e = bench_us(fn, dry=DRY), bench_us(clone, dry=DRY)
    h = (host_us(fn, dry=DRY), host_us(clone, dry=DRY)) if host else (float("nan"),) * 2
    ROWS.append((kind, shape, ok, ours_g, clone_g, ours_e, clone_e, *h))
    print(
        f"{kind} {str(shape):20} {'ok' if ok else 'FAIL'} graph {ours_g:7.2f} / {clone_g:7.2f} "
        f"= {ours_g / clone_g:5.2f}  eager {ours_e:7.2f} / {clone_e:7.2f} = {ours_e / clone_e:5.2f}"
        f"  host {h[0]:6.1f} / {h[1]:6.1f}",
        flush=True,
    )


def config_sweep() -> None:
    """Graph device time of the launchers per (column chunk, warps) override where C is odd or
    narrow or the problem small: which launch configuration the defaults should take there."""
    from moe_kernels._triton import mxfp8_layout as tl_mod

    configs = [(b, w) for b in (4, 8, 16, 64) for w in (1, 2, 4)]
    print("configs (block_c, warps): " + " ".join(f"{b},{w}" for b, w in configs) + " | clone")
    for kind, shape in [
        ("2d", (524288, 37, 8)), ("2d", (131072, 37, 8)), ("2d", (20000, 37, 40)),
        ("2d", (524288, 15, 8)), ("2d", (524288, 8, 40)), ("2d", (524288, 3, 8)),
        ("2d", (524288, 1, 128)), ("2d", (131072, 3, 40)), ("2d", (2048, 64, 128)),
        ("2d", (20000, 256, 40)), ("3d", (64, 7168, 37)), ("3d", (64, 7168, 3)),
        ("3d", (8, 2048, 37)),
    ]:  # fmt: skip
        if kind == "2d":
            R, C, G = shape
            s_d = torch.randint(0, 256, (R, C), dtype=torch.uint8, device=dev)
            e_d = ends(R, G, 7).to(dev)
            fns = [
                lambda b=b, w=w, s=s_d, e=e_d: tl_mod.to_blocked_per_group_2d(
                    s, e, block_c=b, warps=w
                )
                for b, w in configs
            ]
            want = ref.to_blocked_per_group_2d(s_d, e_d)
            rows = int(want[1][-1])
            ok = all(torch.equal(f()[0][:rows], want[0][:rows]) for f in fns)
            nbytes = R * C + rows * ref.ceil_to(C, 4)
        else:
            s_d = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
            fns = [
                lambda b=b, w=w, s=s_d: tl_mod.to_blocked_per_group_3d(s, block_c=b, warps=w)
                for b, w in configs
            ]
            want = ref.to_blocked_per_group_3d(s_d)
            ok = all(torch.equal(f(), want) for f in fns)
            nbytes = s_d.numel() + want.numel()
        if not ok:
            BAD.append(f"config {kind} {shape}")
        times = [graph_us(f, 10, 20, DRY) for f in fns]
        best = min(range(len(configs)), key=lambda i: times[i])
        clone = graph_us(clone_of(nbytes, dev), 10, 20, DRY)
        print(
            f"  {kind} {str(shape):18} {'ok' if ok else 'FAIL'} "
            + " ".join(f"{t:6.2f}" for t in times)
            + f" | {clone:.2f}; best {configs[best]} {times[best] / clone:.2f}x",
            flush=True,
        )


def host_breakdown() -> None:
    """Host cost of the pieces of one eager 2d call (small problem: the GPU keeps up)."""
    from moe_kernels._triton import mxfp8_layout as tl_mod

    s = torch.randint(0, 256, (20000, 37), dtype=torch.uint8, device=dev)
    e = ends(20000, 40, 1).to(dev)
    print("host breakdown (us per call), (20000, 37) G=40:")
    for name, fn in [
        ("public op", lambda: mx.to_blocked_per_group_2d(s, e)),
        ("launcher", lambda: tl_mod.to_blocked_per_group_2d(s, e)),
        ("torch.empty", lambda: torch.empty((20000 + 128 * 40, 40), dtype=torch.uint8, device=dev)),
        ("clone", lambda: s.clone()),
        ("view", lambda: s.view(torch.uint8)),
    ]:
        print(f"  {name:12} {host_us(fn, dry=DRY):7.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--configs", action="store_true", help="only the launch-config sweep")
    args = ap.parse_args()
    if args.configs:
        config_sweep()
        sys.exit(1 if BAD else 0)
    if DRY or args.quick:
        cases_2d = [(300, 37, 5), (256, 3, 40)]
        cases_3d = [(2, 130, 5)]
    else:
        cases_2d = [
            (R, C, G)
            for R in (2048, 20000, 131072, 524288)
            for C in (1, 3, 8, 15, 37, 64, 160, 224, 256)
            for G in (1, 8, 40, 128)
        ]
        cases_3d = [
            (E, N, C) for E in (1, 8, 64) for N in (100, 2048, 7168) for C in (3, 16, 37, 64, 224)
        ]
    for shape in cases_2d:
        run_case("2d", shape, args.host)
    for shape in cases_3d:
        run_case("3d", shape, args.host)
    if args.host:
        host_breakdown()
    g_ratio = [r[3] / r[4] for r in ROWS]
    e_ratio = [r[5] / r[6] for r in ROWS]
    worst_g = max(range(len(ROWS)), key=lambda i: g_ratio[i])
    worst_e = max(range(len(ROWS)), key=lambda i: e_ratio[i])
    print(f"cases {len(ROWS)}, bit-exact failures {len(BAD)} {BAD[:5]}")
    print(f"graph/clone: median {statistics.median(g_ratio):.2f}, worst {g_ratio[worst_g]:.2f} "
          f"at {ROWS[worst_g][:2]}; > 1.3: {sum(r > 1.3 for r in g_ratio)}")  # fmt: skip
    print(f"eager/clone: median {statistics.median(e_ratio):.2f}, worst {e_ratio[worst_e]:.2f} "
          f"at {ROWS[worst_e][:2]}; > 2.0: {sum(r > 2.0 for r in e_ratio)}")  # fmt: skip
    sys.exit(1 if BAD else 0)


if __name__ == "__main__":
    main()
