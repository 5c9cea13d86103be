"""Timing of the token-movement ops (one H200 run): every op (``do_bench`` medians, and in CUDA
graphs) beside ``index_select`` / ``index_add_`` / a clone of the same bytes, and a sweep of the
launch configs (BLOCK_N, BLOCK_D, num_warps) at the big shape.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/tokens_gpu.py

``TOKENS_GPU_DRY_RUN=1 TRITON_INTERPRET=1``: a CPU smoke run. Correctness (bit for bit against
the reference, no sync, graph replay, compile): ``tests/gpu/test_tokens_gpu.py``.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from common import bench_us, clone_of, graph_bench_us

import moe_kernels as mk
from moe_kernels._triton import tokens as tri
from moe_kernels.reference import tokens as ref
from moe_kernels.testing import naive_plan

DRY = os.environ.get("TOKENS_GPU_DRY_RUN") == "1"  # CPU + TRITON_INTERPRET=1 smoke run
dev = torch.device("cpu" if DRY else "cuda")


def bench(fn) -> float:
    """do_bench median (L2 flushed between calls), us."""
    return bench_us(fn, dry=DRY)


def bench_graph(fn) -> float:
    """do_bench median of replaying ``fn`` captured in a CUDA graph: the GPU time without launch
    gaps, us."""
    return graph_bench_us(fn, dry=DRY)


ROWS: list[tuple] = []


def row(shape: str, name: str, us: float, nbytes: int, clone_us: float, base_us: float | None):
    gbs = nbytes / us / 1e3
    ROWS.append((shape, name, us, gbs, 100 * clone_us / us, (base_us / us) if base_us else None))
    print(f"  {name}: {us:.1f} us", flush=True)


def timings(num_tokens: int, dim: int, k: int, num_experts: int) -> None:
    shape = f"T={num_tokens},k={k},D={dim}"
    print(f"timing {shape}")
    dtype = torch.bfloat16
    scores = torch.randn(num_tokens, num_experts, device=dev)
    plan = naive_plan(scores.softmax(-1), k)
    probs = scores.softmax(-1)
    n = num_tokens * k
    x = torch.randn(num_tokens, dim, device=dev, dtype=dtype)
    y = torch.randn(n, dim, device=dev, dtype=dtype)
    tok64 = plan.token_indices.long()
    es = 2
    gather_bytes = 2 * n * dim * es
    combine_bytes = n * dim * es + num_tokens * dim * es
    scatter_bytes = n * dim * es + 2 * num_tokens * dim * 4

    c_g, c_c, c_s = (bench(clone_of(b, dev)) for b in (gather_bytes, combine_bytes, scatter_bytes))
    t_isel = bench(lambda: x.index_select(0, tok64))
    row(shape, "index_select (gather)", t_isel, gather_bytes, c_g, None)
    row(shape, "clone same bytes (gather)", c_g, gather_bytes, c_g, None)
    t = bench(lambda: mk.dispatch(x, plan))
    row(shape, "dispatch", t, gather_bytes, c_g, t_isel)
    t = bench(lambda: mk.dispatch(x, plan, scale=True))
    row(shape, "dispatch scale", t, gather_bytes, c_g, t_isel)
    t = bench(
        lambda: mk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
    )
    row(shape, "gather_scale_dense_tokens", t, gather_bytes, c_g, t_isel)

    out_bf = torch.zeros(num_tokens, dim, device=dev, dtype=dtype)
    yw = y * plan.weights[:, None].to(dtype)
    t_iab = bench(lambda: out_bf.index_add_(0, tok64, yw))
    row(shape, "index_add_ bf16 (combine)", t_iab, combine_bytes + num_tokens * dim * es, c_c, None)
    t = bench(lambda: mk.combine(y, plan))
    row(shape, "combine", t, combine_bytes, c_c, t_iab)
    t = bench(lambda: mk.combine(y, plan, weighted=False))
    row(shape, "combine unweighted", t, combine_bytes, c_c, t_iab)

    out32 = torch.zeros(num_tokens, dim, device=dev)
    y32 = y.float()
    t_ia32 = bench(lambda: out32.index_add_(0, tok64, y32))
    row(shape, "index_add_ fp32", t_ia32, scatter_bytes + n * dim * 2, c_s, None)
    t = bench(lambda: mk.scatter_add_dense_tokens(out32, y, plan.token_indices))
    row(shape, "scatter_add fp32<-bf16", t, scatter_bytes, c_s, t_ia32)
    src, bounds = ref.scatter_order(plan.token_indices, num_tokens, None)
    t = bench(lambda: ref.scatter_order(plan.token_indices, num_tokens, None))
    row(shape, "  scatter order (sort)", t, 1, c_s, None)
    t = bench(lambda: tri.scatter_add_sorted(out32, y, src, bounds))
    row(shape, "  scatter kernel only", t, scatter_bytes, c_s, t_ia32)
    key = plan.token_indices.clone()
    t = bench(lambda: torch.sort(key, stable=True))
    row(shape, "  torch.sort only", t, 1, c_s, None)
    skey = torch.sort(key, stable=True)[0]
    q = torch.arange(num_tokens + 1, device=dev, dtype=torch.int32)
    t = bench(lambda: torch.searchsorted(skey, q, out_int32=True))
    row(shape, "  searchsorted only", t, 1, c_s, None)

    t_ia32g = bench_graph(lambda: out32.index_add_(0, tok64, y32))
    row(shape, "index_add_ fp32 (graph)", t_ia32g, scatter_bytes + n * dim * 2, c_s, None)
    t = bench_graph(lambda: mk.scatter_add_dense_tokens(out32, y, plan.token_indices))
    row(shape, "scatter_add fp32 (graph)", t, scatter_bytes, c_s, t_ia32g)
    t = bench_graph(lambda: mk.combine(y, plan))
    row(shape, "combine (graph)", t, combine_bytes, c_c, t_iab)
    t = bench_graph(lambda: mk.dispatch(x, plan))
    row(shape, "dispatch (graph)", t, gather_bytes, c_g, t_isel)


def sweep(num_tokens: int, dim: int, k: int, num_experts: int) -> None:
    dtype = torch.bfloat16
    plan = naive_plan(torch.randn(num_tokens, num_experts, device=dev).softmax(-1), k)
    n = num_tokens * k
    x = torch.randn(num_tokens, dim, device=dev, dtype=dtype)
    y = torch.randn(n, dim, device=dev, dtype=dtype)
    out32 = torch.zeros(num_tokens, dim, device=dev)
    src, bounds = ref.scatter_order(plan.token_indices, num_tokens, None)
    print("config sweep (BLOCK_N, BLOCK_D, warps): us")
    print(
        "  default gather",
        tri.pick_config("gather", n, dim),
        "combine",
        tri.pick_config("combine", num_tokens, dim),
        "scatter",
        tri.pick_config("scatter", num_tokens, dim),
    )
    cfgs = [(1, 1024, 4), (1, 2048, 8), (2, 512, 4), (4, 512, 4), (8, 256, 4), (1, 512, 2)]
    tokn = plan.token_indices
    for cfg in cfgs:
        r = []
        r.append(bench(lambda cfg=cfg: tri.gather_rows(x, tokn, mode=0, scale=None, config=cfg)))
        r.append(
            bench(lambda cfg=cfg: tri.gather_rows(x, tokn, mode=1, scale=plan.weights, config=cfg))
        )
        r.append(
            bench(lambda cfg=cfg: tri.combine(y, plan.inverse, plan.weights, dtype, config=cfg))
        )
        r.append(bench(lambda cfg=cfg: tri.scatter_add_sorted(out32, y, src, bounds, config=cfg)))
        print(
            f"  {cfg}: copy {r[0]:.0f}  scaled {r[1]:.0f}  combine {r[2]:.0f}  scatter {r[3]:.0f}",
            flush=True,
        )


def main() -> None:
    print(torch.__version__, triton.__version__, "dry" if DRY else torch.cuda.get_device_name())
    big = (256, 64, 4, 16) if DRY else (65536, 2048, 8, 128)
    failed = 0
    for section in (
        lambda: timings(*big),
        lambda: timings(*((64, 64, 4, 8) if DRY else (4096, 2048, 8, 16))),
        print_table,
        lambda: sweep(*big),
    ):
        try:
            section()
        except Exception:
            traceback.print_exc()
            failed += 1
    sys.exit(1 if failed else 0)


def print_table() -> None:
    print()
    print(f"{'shape':<20} {'op':<28} {'us':>9} {'GB/s':>8} {'%clone':>7} {'speedup':>8}")
    for shape, name, us, gbs, pct, sp in ROWS:
        sps = f"{sp:.2f}x" if sp else ""
        print(f"{shape:<20} {name:<28} {us:9.1f} {gbs:8.0f} {pct:6.0f}% {sps:>8}", flush=True)


if __name__ == "__main__":
    main()
