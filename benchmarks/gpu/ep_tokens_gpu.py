"""Timing of the expert-parallel token reshuffles: ``combine_shuffling``, ``split_shuffling`` and
``scatter_add_padded_tokens`` (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/ep_tokens_gpu.py            # H200 (a few minutes; FBGEMM autotunes)
    python3 benchmarks/gpu/ep_tokens_gpu.py --dry-run  # CPU, TRITON_INTERPRET=1, tiny shapes
    options: --no-sweeps, --sections=timings,print_table (those sections alone)

Timings, ``graph`` (device time: a CUDA graph of N calls replayed, per call) and ``bench``
(``do_bench`` median, L2 flushed): ours, a clone of the bytes ours moves, the torch-native version
(the reference's torch ops on the GPU, eager and ``torch.compile``'d; for the scatter-add a
``index_add_`` with atomics), FBGEMM (split: with and without ``init_with_zeros``) when
``fbgemm_gpu.experimental.gen_ai.moe`` imports; at FBGEMM's test shapes and the big shape (T =
65536 * 8 rows, D = 2048, EP = 8, E = 128); the padded scatter's plan (row map + sort) and
kernel apart. FBGEMM 1.6.0 autotunes its shuffle kernel on (EG, EP, E, D), not T.
Sweeps: sizes (the scan / sorted crossover and cliffs), and launch configs at the big shape,
only through the launchers' typed ``config=`` (``ShuffleConfig``, ``ScatterConfig``).
Correctness (bit for bit against the reference, graph replay, compile, FBGEMM parity):
``tests/gpu/test_shuffling_gpu.py`` and ``test_fbgemm_parity_gpu.py``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from common import bench_us, clone_of, graph_us  # noqa: E402

from moe_kernels import padded_tokens as pt  # noqa: E402
from moe_kernels import shuffling as sh  # noqa: E402
from moe_kernels._triton import padded_tokens as tri_pt  # noqa: E402
from moe_kernels._triton import shuffling as tri_sh  # noqa: E402
from moe_kernels.reference import padded_tokens as ref_pt  # noqa: E402
from moe_kernels.reference import tokens as ref_tok  # noqa: E402
from moe_kernels.testing import ep_inputs  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BIG = (256, 64, 8, 32) if DRY else (65536 * 8, 2048, 8, 128)  # (rows, D, EP, E)
FB_D = 64 if DRY else 5120
fb = None
if not DRY:
    try:
        import fbgemm_gpu.experimental.gen_ai.moe as fb  # noqa: E402
    except Exception as exc:  # noqa: BLE001 - the peer is optional
        print("fbgemm_gpu not importable, its rows are skipped:", repr(exc)[:200])
gen, ref_shuffle = ep_inputs.gen, ep_inputs.ref_shuffle
tokens_of = functools.partial(ep_inputs.tokens_of, device=DEV)
split_counts = functools.partial(ep_inputs.split_counts, device=DEV)
scatter_problem = functools.partial(ep_inputs.scatter_problem, device=DEV)


# ------------------------------------------------------------------------------ shuffles


# ------------------------------------------------------------------------------ padded scatter


def big_scatter_shape():
    """(EP, T_K, D, E, T): the EP combine of T tokens x top-8 at the big shape."""
    rows, dim, ep, experts = BIG
    return ep, rows, dim, experts, rows // 8


def _fb_padded_kw() -> str:
    params = inspect.signature(fb.combine_shuffling).parameters
    return "is_padded" if "is_padded" in params else "is_balanced"


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
        # FBGEMM's contract (the rows no chunk holds left unwritten): the bytes it moves
        fn = sh.combine_shuffling if combine else sh.split_shuffling
        unwritten = timed(shape, f"{op} zero_unowned=False",
                          lambda: fn(x, counts, start, end, padded, zero_unowned=False),
                          2 * live * dim * 2, ours)  # fmt: skip
        if fb is None:
            continue
        kw = {_fb_padded_kw(): padded}
        if combine:
            timed(shape, f"{op} FBGEMM", lambda: fb.combine_shuffling(x, counts, start, end, **kw),
                  2 * live * dim * 2, unwritten)  # fmt: skip
        else:
            timed(shape, f"{op} FBGEMM", lambda: fb.split_shuffling(x, counts, start, end, **kw),
                  2 * live * dim * 2, unwritten)  # fmt: skip
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
    sections = [timings] + ([] if "--no-sweeps" in sys.argv else [sweeps]) + [print_table]
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--sections=")),
                None)  # fmt: skip
    if only:
        sections = [s for s in (timings, sweeps, print_table) if s.__name__ in only]
    failed = []
    for section in sections:
        try:
            section()
        except Exception:  # noqa: BLE001 - report and go on with the next section
            traceback.print_exc()
            failed.append(section.__name__)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
