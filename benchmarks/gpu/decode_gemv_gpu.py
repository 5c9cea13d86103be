"""A decode step's routed experts without gradients (issue 50): ``expert_mlp``'s no-grad forward
(both projections, SwiGLU experts) as two grouped GEMVs (``_triton/grouped_gemv.py``, SwiGLU in
the first one's epilogue) against the plan without the GEMV (``GemmDevice(gemv=False)``: the row
gather, the sorted-row GEMM the plan picks, the activation, the sorted-row GEMM), each captured
in a CUDA graph and replayed with the L2 flushed between replays, at T = 1 to 128 tokens of four
expert layers. Prints the time of each, the touched experts' weight bytes over the GEMV's time
(GB/s and % of the H200's 4.8 TB/s), the ratio, and whether the two agree (relative error of the
outputs). ``--configs`` times other ``GemvConfig``s beside the default (the typed override the
launcher takes: what sets ``default_config``); the plan's row bound (``GEMV_MAX_ROWS``) is where
the ratio crosses 1.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/decode_gemv_gpu.py [--shapes=qwen3,...] [--tokens=1,8] [--configs]

``--dry-run``: a tiny layer on the CPU (under ``TRITON_INTERPRET=1`` for the kernels), one eager
call each.
"""

from __future__ import annotations

import argparse

import torch
from common import graph_bench_us

import moe_kernels as mk
from moe_kernels._dispatch import triton_kernels
from moe_kernels._gemm_plan import GemmDevice, GemmProblem, choose_gemm, gemm_device

SHAPES = {  # name: (d_model, expert hidden n, experts, top_k); SwiGLU: w_in (E, 2n, d)
    "qwen3": (2048, 768, 128, 8),  # Qwen3-30B-A3B
    "small128": (2816, 704, 128, 8),  # the 128-expert small layer
    "dsv3": (7168, 2048, 256, 8),  # DeepSeek-V3's routed experts
    "mixtral": (4096, 14336, 8, 2),  # Mixtral 8x7B
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
TINY = (64, 32, 16, 8)
PEAK_GBS = 4800.0  # the H200's HBM3e (an H100 SXM's is 3350)
# (block_n, block_k, num_warps, num_stages, block_m) beside the default (32, 128, 4, 4, 16)
CONFIGS = [(64, 128, 4, 4, 16), (16, 128, 4, 4, 16), (32, 256, 4, 3, 16), (32, 64, 4, 6, 16),
           (64, 256, 8, 3, 16), (128, 128, 8, 3, 16), (32, 128, 4, 4, 32),
           (64, 128, 8, 4, 64)]  # fmt: skip


def weights(shape, dev, dtype):
    """(w_in (E, 2n, d), w_out (E, d, n)), drawn in the dtype (DeepSeek-V3's: 22 GiB of bf16)."""
    d, n, E, _ = shape
    g = torch.Generator(device=dev).manual_seed(0)
    w_in = torch.randn(E, 2 * n, d, device=dev, generator=g, dtype=dtype).mul_(d**-0.5)
    w_out = torch.randn(E, d, n, device=dev, generator=g, dtype=dtype).mul_(n**-0.5)
    return w_in, w_out


def tokens(shape, T: int, dev, dtype):
    """(the routing plan of T tokens' random scores, x (T, d))."""
    d, _, E, k = shape
    g = torch.Generator(device=dev).manual_seed(T)
    plan = mk.route(torch.randn(T, E, device=dev, generator=g).softmax(-1), k)
    return plan, torch.randn(T, d, device=dev, generator=g).to(dtype)


def gemv_forward(plan, x, w_in, w_out, config=None):
    """Both projections as grouped GEMVs, straight through the launcher (``config``: its typed
    override)."""
    gv = triton_kernels("grouped_gemv")
    a = gv.grouped_gemv(x, w_in, plan.offsets, plan.token_indices, "swiglu", config)
    return gv.grouped_gemv(a, w_out, plan.offsets, None, "none", config)


def rows_gemm(a, w, offsets, dev: GemmDevice, zero_tail: bool):
    """One sorted-row GEMM as ``grouped_mm``'s launcher runs the rows plan on ``dev`` (the
    problem read from the tensors as ``plan_rows`` reads a contiguous w)."""
    tile, pg = triton_kernels("grouped_mm"), triton_kernels("persistent_grouped_mm")
    tma = a.dtype == torch.bfloat16 and pg.tma_ok(a) and pg.tma_ok(w)
    E, N, K = w.shape
    plan = choose_gemm(GemmProblem("rows", a.shape[0], N, K, E, a.dtype, layout="nk", tma=tma,
                                   aligned=True), dev)  # fmt: skip
    if plan.kernel == "persistent":
        y = pg.persistent_grouped_mm(a, w, offsets, plan.layout, plan.config)
    elif plan.kernel == "cutlass":
        y = torch._grouped_mm(a, w.mT, offs=offsets[1:])  # routing offsets: in range
    else:
        return tile.gather_grouped_mm(a, w, offsets, None, tile.ACT_NONE)
    if zero_tail:
        tile.zero_tail(y, offsets)
    return y


def planned_forward(plan, x, w_in, w_out):
    """``expert_mlp``'s no-grad forward as the plan without the GEMV runs it (``GemmDevice(gemv=
    False)``): the row gather and a sorted-row GEMM, or the GEMM gathering in its loads; SwiGLU;
    the sorted-row GEMM."""
    dev = gemm_device(x.device)._replace(gemv=False)
    E, X, d = w_in.shape
    R = plan.token_indices.shape[0]
    up = choose_gemm(GemmProblem("gather_mlp", R, X, d, E, x.dtype, x_rows=x.shape[0],
                                 gathered=True), dev).kernel  # fmt: skip
    if up == "gather_copy":
        h = rows_gemm(mk.dispatch(x, plan), w_in, plan.offsets, dev, False)
    else:  # the Triton GEMM gathering in its loads
        tile = triton_kernels("grouped_mm")
        h = tile.gather_grouped_mm(x, w_in, plan.offsets, plan.token_indices, tile.ACT_NONE)
    return rows_gemm(mk.expert_activation(h, gated=True), w_out, plan.offsets, dev, True)


def touched_bytes(plan, w_in, w_out) -> int:
    """The weight bytes of the experts holding rows (one host read: fine in a benchmark)."""
    touched = int((plan.counts > 0).sum())
    return touched * (w_in[0].numel() + w_out[0].numel()) * w_in.element_size()


def run_shape(name, shape, token_counts, configs, dev, dtype, dry) -> None:
    w_in, w_out = weights(shape, dev, dtype)
    for T in token_counts:
        plan, x = tokens(shape, T, dev, dtype)
        R = plan.token_indices.shape[0]
        y_gemv, y_plan = gemv_forward(plan, x, w_in, w_out), planned_forward(plan, x, w_in, w_out)
        n_ok = int(plan.offsets[-1])
        rel = float((y_gemv[:n_ok].float() - y_plan[:n_ok].float()).norm()
                    / y_plan[:n_ok].float().norm().clamp_min(1e-30))  # fmt: skip
        plan_us = graph_bench_us(lambda: planned_forward(plan, x, w_in, w_out), dry=dry)
        nbytes = touched_bytes(plan, w_in, w_out)
        for cfg in configs:
            us = graph_bench_us(lambda c=cfg: gemv_forward(plan, x, w_in, w_out, c), dry=dry)
            gbs = nbytes / us / 1e3
            label = "default" if cfg is None else "/".join(map(str, cfg))
            check = f"{'agree' if rel < 2e-2 else 'DIFFER'} ({rel:.1e})"
            print(f"{name:<9}{T:>5}{R:>6}{nbytes / 2**20:>9.1f}{label:>15}{us / 1e3:>9.4f}"
                  f"{plan_us / 1e3:>9.4f}{gbs:>9.0f}{100 * gbs / PEAK_GBS:>6.0f}%"
                  f"{plan_us / us:>7.2f}  {check}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--configs", action="store_true", help="other GemvConfigs beside the default")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.dry_run
    dev = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    if gemm_device(dev).path == "reference":
        raise SystemExit("the kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1")
    gv = triton_kernels("grouped_gemv")
    configs = [None] + ([gv.GemvConfig(*c) for c in CONFIGS] if args.configs else [])
    if not dry:
        print(torch.cuda.get_device_name(), f"(% of {PEAK_GBS / 1e3:.1f} TB/s)")
    print(f"{'shape':<9}{'T':>5}{'rows':>6}{'MiB':>9}{'config':>15}{'gemv ms':>9}{'plan ms':>9}"
          f"{'GB/s':>9}{'peak':>7}{'ratio':>7}  check")  # fmt: skip
    shapes = {"tiny": TINY} if dry else {s: SHAPES[s] for s in args.shapes.split(",")}
    token_counts = (1, 8) if dry else tuple(int(t) for t in args.tokens.split(","))
    for name, shape in shapes.items():
        run_shape(name, shape, token_counts, configs, dev, dtype, dry)
        if not dry:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
