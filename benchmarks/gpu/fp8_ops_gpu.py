"""Timing of ``silu_mul``, ``silu_mul_quant`` and ``gather_scale_quant_dense_tokens`` (one H200
run, ~5 min).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/fp8_ops_gpu.py             # H200
    python3 benchmarks/gpu/fp8_ops_gpu.py --no-sweep  # skip the size and config sweeps
    python3 benchmarks/gpu/fp8_ops_gpu.py --configs-only  # the RowConfig sweep alone
    python3 benchmarks/gpu/fp8_ops_gpu.py --dry-run   # CPU, TRITON_INTERPRET=1, tiny shapes

Timings (``graph``: device time per call, 10 calls in a CUDA graph; ``bench``: do_bench median
with the L2 flushed) at T=65536, D=2048 bf16 (the gather: k=8, N=524288 rows from T tokens) and
at FBGEMM's test shapes, beside a clone of the same bytes, the torch formula (eager and
``torch.compile``'d) and FBGEMM (when ``fbgemm_gpu.experimental.gen_ai.moe`` imports); then a
sweep over sizes (cliffs) and over ``RowConfig``s. Variants only through the launchers'
``config=`` overrides. Correctness: ``tests/gpu/test_fp8_rows_gpu.py``,
``test_fbgemm_contract.py`` and ``test_fbgemm_parity_gpu.py``.
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
from common import bench_us, clone_of, graph_us  # noqa: E402

from moe_kernels._triton import fp8_rowwise as rows  # noqa: E402
from moe_kernels._triton import gather_quant as tri_g  # noqa: E402
from moe_kernels._triton import swiglu as tri_s  # noqa: E402
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens  # noqa: E402
from moe_kernels.swiglu import silu_mul, silu_mul_quant  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BF16 = torch.bfloat16
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


def gather_problem(t, d, n, e, dtype, seed, index_dtype=torch.int32, dead=True):
    x = rand((t, d), dtype, seed)
    scores = torch.rand(t, e, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    lo = -1 if dead else 0
    tok = torch.randint(lo, t, (n,), device=DEV, generator=g).to(index_dtype)
    exp = torch.randint(lo, e, (n,), device=DEV, generator=g).to(index_dtype)
    return x, tok, exp, scores


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
    sections = [lambda: time_ops(*big)]
    fb_shapes = [(1, 5120), (4, 7168)] if DRY else [(t, d) for t in (1, 128, 2048, 4096, 16384)
                                                       for d in (5120, 7168)]  # fmt: skip
    sections += [lambda t=t, d=d: time_ops(t, d, 1, 8) for t, d in fb_shapes]
    if SWEEP:
        sections += [sweep_sizes, sweep_configs]
    if "--configs-only" in sys.argv:
        sections = [sweep_configs]
    failed = 0
    for section in [*sections, print_table] if sections != [sweep_configs] else sections:
        try:
            section()
        except Exception:  # noqa: BLE001 - report and go on with the other sections
            traceback.print_exc()
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
