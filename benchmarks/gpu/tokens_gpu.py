"""GPU check and timing of the token-movement ops (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/tokens_gpu.py

Checks (bit-exact vs the torch reference, run on the GPU too): random non-zero data, outputs
poisoned with NaN through the caching allocator, under ``set_sync_debug_mode("error")``, in a
captured CUDA graph replayed with new inputs, compiled with ``fullgraph=True``. Then times every
op (``do_bench`` medians) beside ``index_select`` / ``index_add_`` / a clone of the same bytes, and
sweeps the launch configs (BLOCK_N, BLOCK_D, num_warps) at the big shape.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from common import (
    FAILS,
    bench_us,
    capture,
    check,
    clone_of,
    forbid_host_sync,
    graph_bench_us,
    poison,
)
from common import same_bits as bitwise

from moe_kernels import tokens as tk
from moe_kernels._triton import tokens as tri
from moe_kernels.reference import tokens as ref
from moe_kernels.routing import RoutingPlan

DRY = os.environ.get("TOKENS_GPU_DRY_RUN") == "1"  # CPU + TRITON_INTERPRET=1 smoke run
dev = torch.device("cpu" if DRY else "cuda")


def naive_plan(scores_TE: torch.Tensor, k: int, start: int = 0, end: int | None = None):
    num_tokens, num_experts = scores_TE.shape
    end = num_experts if end is None else end
    w_TE, e_TE = torch.sort(scores_TE.softmax(-1), dim=1, descending=True, stable=True)
    e_TK, w_TK = e_TE[:, :k], w_TE[:, :k]
    local_TK = (e_TK >= start) & (e_TK < end)
    tok_TK = torch.arange(num_tokens, device=scores_TE.device)[:, None].expand(-1, k)
    key = torch.where(local_TK, (e_TK - start) * num_tokens + tok_TK, 2**62).reshape(-1)
    _, order = torch.sort(key, stable=True)
    n = num_tokens * k
    live = local_TK.reshape(-1)[order]
    token_indices = torch.where(live, tok_TK.reshape(-1)[order], -1).int()
    expert_indices = torch.where(live, e_TK.reshape(-1)[order] - start, -1).int()
    weights = torch.where(live, w_TK.reshape(-1)[order], 0.0).float()
    inverse = torch.empty(n, dtype=torch.int64, device=scores_TE.device)
    inverse[order] = torch.arange(n, device=scores_TE.device)
    inverse = torch.where(local_TK.reshape(-1), inverse, -1).view(num_tokens, k).int()
    counts = torch.bincount(expert_indices[live].long(), minlength=end - start).int()
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0).int()])
    return RoutingPlan(counts, offsets, expert_indices, token_indices, weights, inverse)


def correctness(num_tokens: int, dim: int, k: int, num_experts: int, dtype: torch.dtype) -> None:
    print(f"correctness T={num_tokens} D={dim} k={k} E={num_experts} {dtype}")
    g = torch.Generator(device=dev).manual_seed(num_tokens + dim)
    x = torch.randn(num_tokens, dim, device=dev, generator=g).to(dtype)
    scores = torch.randn(num_tokens, num_experts, device=dev, generator=g)
    plan = naive_plan(scores, k, 1, num_experts - 1)  # a tail of -1 rows
    n = plan.token_indices.shape[0]
    vtc = (plan.token_indices >= 0).sum().reshape(1).int()
    probs = scores.softmax(-1)

    poison(n * dim * 4, device=dev)  # 0xFF: NaN in every float dtype
    with forbid_host_sync(not DRY):
        g_out = tk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs, vtc)
        d_out = tk.dispatch(x, plan)
        ds_out = tk.dispatch(x, plan, scale=True)
        c_out = tk.combine(ds_out, plan, weighted=True)
        cu_out = tk.combine(d_out, plan, weighted=False, out_dtype=torch.float32)
        acc = torch.randn(num_tokens, dim, device=dev, generator=g)
        acc2 = acc.clone()
        tk.scatter_add_dense_tokens(acc, ds_out, plan.token_indices, vtc)
        tk.scatter_add_dense_tokens(acc2, ds_out, plan.token_indices, vtc)
        acc_bf = torch.randn(num_tokens, dim, device=dev, generator=g).to(torch.bfloat16)
        acc_bf_in = acc_bf.clone()
        tk.scatter_add_dense_tokens(acc_bf, ds_out, plan.token_indices)
    if not DRY:
        torch.cuda.synchronize()
    check("no sync (sync_debug_mode=error)", True)

    r_g = ref.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs, vtc)
    check("gather_scale exact", bitwise(g_out, r_g))
    check(
        "dispatch exact", bitwise(d_out, ref.dispatch(x, plan.token_indices, plan.weights, False))
    )
    check(
        "dispatch scale exact",
        bitwise(ds_out, ref.dispatch(x, plan.token_indices, plan.weights, True)),
    )
    check(
        "combine exact",
        bitwise(c_out, ref.combine(ds_out, plan.inverse, plan.weights, True, dtype)),
    )
    check(
        "combine unweighted fp32 exact",
        bitwise(cu_out, ref.combine(d_out, plan.inverse, plan.weights, False, torch.float32)),
    )
    check("scatter fp32 deterministic", bitwise(acc, acc2))
    r_acc = acc_bf_in.clone()
    ref.scatter_add_dense_tokens(r_acc, ds_out, plan.token_indices, None)
    check("scatter bf16 out exact", bitwise(acc_bf, r_acc))
    check("no NaN in outputs", not any(t.isnan().any() for t in (g_out, d_out, ds_out, c_out)))


def scatter_exact(num_tokens: int, dim: int, k: int) -> None:
    g = torch.Generator(device=dev).manual_seed(7)
    n = num_tokens * k
    tok = torch.randint(-1, num_tokens, (n,), device=dev, generator=g, dtype=torch.int32)
    src = torch.randn(n, dim, device=dev, generator=g).to(torch.bfloat16)
    out = torch.randn(num_tokens, dim, device=dev, generator=g)
    r = out.clone()
    vtc = torch.tensor([n - 5], device=dev)
    tk.scatter_add_dense_tokens(out, src, tok, vtc)
    ref.scatter_add_dense_tokens(r, src, tok, vtc)
    check(f"scatter fp32<-bf16 exact vs reference T={num_tokens} D={dim}", bitwise(out, r))


def graph_and_compile(num_tokens: int, dim: int, k: int, num_experts: int) -> None:
    print("cuda graph + compile")
    dtype = torch.bfloat16
    scores = torch.randn(num_tokens, num_experts, device=dev)
    plan = naive_plan(scores, k)
    x = torch.randn(num_tokens, dim, device=dev, dtype=dtype)
    probs = scores.softmax(-1)
    out = torch.zeros(num_tokens, dim, device=dev)

    def step():
        xs = tk.dispatch(x, plan, scale=False)
        g = tk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
        tk.scatter_add_dense_tokens(out, g, plan.token_indices)
        return tk.combine(xs, plan), g

    if not DRY:
        graph_replay(step, x, probs, out, plan, dtype)

    def fn(x, probs, out, plan):
        xs = tk.dispatch(x, plan, scale=True)
        g = tk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
        tk.scatter_add_dense_tokens(out, g, plan.token_indices)
        return tk.combine(xs * 2, plan, weighted=False), out * 1

    compiled = torch.compile(fn, fullgraph=True)
    o1 = torch.zeros_like(out)
    o2 = torch.zeros_like(out)
    e = fn(x, probs, o1, plan)
    c = compiled(x, probs, o2, plan)
    check("compile fullgraph combine equal eager", bitwise(e[0], c[0]))
    check("compile fullgraph scatter in place equal eager", bitwise(o1, o2) and bitwise(e[1], c[1]))


def graph_replay(step, x, probs, out, plan, dtype) -> None:
    step()
    graph, (y_static, g_static) = capture(step)
    x.copy_(torch.randn_like(x))
    probs.copy_(torch.rand_like(probs))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    r_y = ref.combine(
        ref.dispatch(x, plan.token_indices, plan.weights, False),
        plan.inverse,
        plan.weights,
        True,
        dtype,
    )
    r_g = ref.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
    r_out = torch.zeros_like(out)
    ref.scatter_add_dense_tokens(r_out, r_g, plan.token_indices)
    check("graph replay combine(dispatch) exact", bitwise(y_static, r_y))
    check("graph replay gather exact", bitwise(g_static, r_g))
    check("graph replay scatter exact", bitwise(out, r_out))


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
    plan = naive_plan(scores, k)
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
    t = bench(lambda: tk.dispatch(x, plan))
    row(shape, "dispatch", t, gather_bytes, c_g, t_isel)
    t = bench(lambda: tk.dispatch(x, plan, scale=True))
    row(shape, "dispatch scale", t, gather_bytes, c_g, t_isel)
    t = bench(
        lambda: tk.gather_scale_dense_tokens(x, plan.token_indices, plan.expert_indices, probs)
    )
    row(shape, "gather_scale_dense_tokens", t, gather_bytes, c_g, t_isel)

    out_bf = torch.zeros(num_tokens, dim, device=dev, dtype=dtype)
    yw = y * plan.weights[:, None].to(dtype)
    t_iab = bench(lambda: out_bf.index_add_(0, tok64, yw))
    row(shape, "index_add_ bf16 (combine)", t_iab, combine_bytes + num_tokens * dim * es, c_c, None)
    t = bench(lambda: tk.combine(y, plan))
    row(shape, "combine", t, combine_bytes, c_c, t_iab)
    t = bench(lambda: tk.combine(y, plan, weighted=False))
    row(shape, "combine unweighted", t, combine_bytes, c_c, t_iab)

    out32 = torch.zeros(num_tokens, dim, device=dev)
    y32 = y.float()
    t_ia32 = bench(lambda: out32.index_add_(0, tok64, y32))
    row(shape, "index_add_ fp32", t_ia32, scatter_bytes + n * dim * 2, c_s, None)
    t = bench(lambda: tk.scatter_add_dense_tokens(out32, y, plan.token_indices))
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
    t = bench_graph(lambda: tk.scatter_add_dense_tokens(out32, y, plan.token_indices))
    row(shape, "scatter_add fp32 (graph)", t, scatter_bytes, c_s, t_ia32g)
    t = bench_graph(lambda: tk.combine(y, plan))
    row(shape, "combine (graph)", t, combine_bytes, c_c, t_iab)
    t = bench_graph(lambda: tk.dispatch(x, plan))
    row(shape, "dispatch (graph)", t, gather_bytes, c_g, t_isel)


def sweep(num_tokens: int, dim: int, k: int, num_experts: int) -> None:
    dtype = torch.bfloat16
    plan = naive_plan(torch.randn(num_tokens, num_experts, device=dev), k)
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
    for section in (
        lambda: correctness(64 if DRY else 4096, 256 if DRY else 2048, 8, 16, torch.bfloat16),
        lambda: correctness(60 if DRY else 300, 130, 4, 8, torch.float32),
        lambda: correctness(257, 33, 2, 5, torch.float16),
        lambda: scatter_exact(50 if DRY else 500, 130, 8),
        lambda: scatter_exact(64 if DRY else 4096, 256 if DRY else 2048, 8),
        lambda: graph_and_compile(64 if DRY else 512, 256, 4, 8),
        lambda: timings(*big),
        lambda: timings(*((64, 64, 4, 8) if DRY else (4096, 2048, 8, 16))),
        print_table,
        lambda: sweep(*big),
    ):
        try:
            section()
        except Exception:
            traceback.print_exc()
            FAILS.append("exception")
    print("FAILS:", FAILS or "none")
    sys.exit(1 if FAILS else 0)


def print_table() -> None:
    print()
    print(f"{'shape':<20} {'op':<28} {'us':>9} {'GB/s':>8} {'%clone':>7} {'speedup':>8}")
    for shape, name, us, gbs, pct, sp in ROWS:
        sps = f"{sp:.2f}x" if sp else ""
        print(f"{shape:<20} {name:<28} {us:9.1f} {gbs:8.0f} {pct:6.0f}% {sps:>8}", flush=True)


if __name__ == "__main__":
    main()
