"""The FP8 grouped GEMM (``moe_kernels.fp8_grouped_mm``, e4m3 rows x e4m3 expert weights, per-row
and per-channel or 128 x 128 block scales) against our bf16 grouped GEMM on the same sorted rows
(``gather_grouped_mm``: the GEMM plan's persistent / CUTLASS kernel) and torch's FP8 rowwise
``torch._scaled_grouped_mm`` where it runs, at MoE layers' expert GEMMs (issue 51's target:
>= 1.6x our bf16 at >= 512 rows per expert). Medians of ``do_bench`` (us), TFLOP/s, and the
largest error relative to the largest output against the fp32 reference of the same fp8 values.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/fp8_grouped_mm_gpu.py [--dry-run]
"""

from __future__ import annotations

import argparse

import torch
from common import bench_us

import moe_kernels as mk
from moe_kernels._triton import fp8_grouped_mm as tri
from moe_kernels.reference import fp8_grouped_mm as ref
from moe_kernels.reference.fp8_rowwise import quantize_rows

try:  # FBGEMM's FP8 rowwise grouped GEMMs (fbgemm-gpu-genai), benchmarks only
    import fbgemm_gpu.experimental.gen_ai  # noqa: F401 (registers torch.ops.fbgemm)
    from fbgemm_gpu.experimental.gemm.triton_gemm.grouped_gemm import (
        grouped_gemm_fp8_rowwise as FB_TRITON,
    )
except Exception as exc:  # noqa: BLE001
    print("fbgemm_gpu not importable, its columns fail:", repr(exc)[:160])
    FB_TRITON = None

SHAPES = {  # name: (rows per expert, E, N, D)
    "seed-up 1024/e": (1024, 16, 1024, 2048),
    "qwen3-up 512/e": (512, 128, 1536, 2048),
    "qwen3-down 512/e": (512, 128, 2048, 768),
    "dsv3-up 256/e": (256, 256, 4096, 7168),
    "mixtral-up 2048/e": (2048, 8, 28672, 4096),
    "qwen3-up 128/e": (128, 128, 1536, 2048),
    "qwen3-up 256/e": (256, 128, 1536, 2048),
    "qwen3-up 1024/e": (1024, 128, 1536, 2048),
    "qwen3-up 2048/e": (2048, 128, 1536, 2048),
    "sonic-up 2048/e": (2048, 128, 2048, 4096),
}


def problem(rows_e, E, N, D, device, dry):
    """(sizes, bf16 rows and weights, equal groups, the rows' FP8 data and scales)."""
    if dry:
        rows_e, E, N, D = 16, 2, 64, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    P = rows_e * E
    x = torch.randn(P, D, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(E, N, D, generator=g) / D**0.5).to(device, torch.bfloat16)
    offsets = torch.arange(0, P + 1, rows_e, dtype=torch.int32, device=device)
    xq, xs = quantize_rows(x.float(), None, None)
    return (rows_e * E, E, N, D), x, w, offsets, xq, xs


def run(name, rows_e, E, N, D, device, dry):
    (P, E, N, D), x, w, offsets, xq, xs = problem(rows_e, E, N, D, device, dry)
    flop = 2 * P * N * D
    t_bf16 = bench_us(lambda: mk.gather_grouped_mm(x, w, offsets), dry=dry)
    line = f"{name:18s} bf16 {t_bf16:8.1f} us {flop / t_bf16 / 1e6:6.0f} TF/s"
    for block in (False, True):
        q = mk.quantize_fp8_weights(w, block=block)
        y = mk.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets)
        want = ref.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, None, torch.float32)
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        t = bench_us(lambda q=q: mk.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets), dry=dry)
        kind = "block" if block else "chan"
        if not block:
            want_chan = want
        line += f" | fp8 {kind} {t:8.1f} us {t_bf16 / t:5.2f}x err {err:.1e}"
    if device.type == "cuda":
        q = mk.quantize_fp8_weights(w)
        sizes = offsets.diff().long()
        peers = {
            "torch._scaled_grouped_mm": lambda: torch._scaled_grouped_mm(
                xq,
                q.weight.transpose(1, 2),
                xs.reshape(-1),
                q.scale,
                offs=offsets[1:],
                out_dtype=torch.bfloat16,
            ),
            "fbgemm cutlass": lambda: torch.ops.fbgemm.f8f8bf16_rowwise_grouped_stacked(
                xq, q.weight, xs.reshape(-1), q.scale.reshape(E, N), sizes
            ),
        }
        if FB_TRITON is not None:
            peers["fbgemm triton"] = lambda: FB_TRITON(
                xq, q.weight.reshape(E * N, D), sizes.int(), xs.reshape(-1), q.scale.reshape(-1)
            )
        for peer, fn in peers.items():
            try:
                err = ((fn().float() - want_chan).abs().max() / want_chan.abs().max()).item()
                t = bench_us(fn)
                line += f" | {peer} {t:8.1f} us {t_bf16 / t:5.2f}x err {err:.1e}"
            except Exception as e:  # noqa: BLE001 (a build without it here)
                line += f" | {peer}: {type(e).__name__} {str(e)[:60]}"
    print(line, flush=True)


CONFIG_SHAPES = ("seed-up 1024/e", "qwen3-up 512/e", "qwen3-down 512/e", "sonic-up 2048/e")
CONFIGS = {  # name: Fp8Config overrides of the plan's choice (the launcher's typed config=); no
    # spill at sm_90a with Triton 3.6 (128 x 256 promoted, 256 x 128 and 4 warps spill)
    "bk256": dict(block_k=256),
    "bk256 s2": dict(block_k=256, num_stages=2),
    "s4": dict(num_stages=4),
    "gm16": dict(group_m=16),
    "64x256": dict(block_m=64, block_n=256),
    "fast": dict(fast_accum=True),
    "fast 128x256": dict(fast_accum=True, block_n=256),
    "fast 128x256 s4": dict(fast_accum=True, block_n=256, num_stages=4),
    "fast 64x256": dict(fast_accum=True, block_m=64, block_n=256),
    # the persistent grouped GEMM's scaled form (fast accumulation; these spill 16-1940 bytes a
    # thread at sm_90a, as its bf16 default does)
    "pers 128x256": dict(persistent=True, block_n=256),
    "pers 128x256 bk64 s4": dict(persistent=True, block_n=256, block_k=64, num_stages=4),
    "pers 128x128 s4": dict(persistent=True, num_stages=4),
    "pers 128x128": dict(persistent=True),
}


def sweep_configs(name, rows_e, E, N, D, device, dry):
    """Per-channel FP8 on sorted rows under each ``CONFIGS`` override: us and error."""
    (P, E, N, D), x, w, offsets, xq, xs = problem(rows_e, E, N, D, device, dry)
    q = mk.quantize_fp8_weights(w)
    want = ref.fp8_grouped_mm(xq, xs, q.weight, q.scale, offsets, None, torch.float32)
    base = tri.fp8_config(P, N, D, False)
    t_bf16 = bench_us(lambda: mk.gather_grouped_mm(x, w, offsets), dry=dry)
    line = f"{name:18s} bf16 {t_bf16:7.1f} us"
    for label, kw in {"plan": {}, **CONFIGS}.items():
        cfg = base._replace(**kw)
        fn = lambda cfg=cfg: tri.fp8_grouped_mm(  # noqa: E731
            xq, xs.float(), q.weight, q.scale, offsets, None, torch.bfloat16, cfg
        )
        try:
            err = ((fn().float() - want).abs().max() / want.abs().max()).item()
            t = bench_us(fn, dry=dry)
            line += f" | {label} {t:7.1f} us {t_bf16 / t:4.2f}x {err:.0e}"
        except Exception as e:  # noqa: BLE001 (out of shared memory, a compile failure)
            line += f" | {label}: {type(e).__name__} {str(e)[:40]}"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--configs-only", action="store_true", help="the config sweep alone")
    ap.add_argument("--shapes", help="comma-separated SHAPES names for the config sweep")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    for name, shape in {} if args.configs_only else SHAPES.items():
        run(name, *shape, device, args.dry_run)
    for name in args.shapes.split(",") if args.shapes else CONFIG_SHAPES:
        sweep_configs(name, *SHAPES[name], device, args.dry_run)


if __name__ == "__main__":
    main()
