"""The world model's attention at the seed frame's shapes, per SDPA backend: which kernel is
fastest for 512 queries (32 heads, 16 kv heads, head dim 64) against a 17-frame window (8704
keys), folded as ``Attention`` runs it (the 2 query heads of a kv head as 1024 queries) and as
GQA; the same with the partial-window mask (frames before the window fills).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/attention_gpu.py [--window 16] [--dry-run]

Prints the median time (``do_bench``) and TFLOP/s (4 * heads * queries * keys * head_dim per
call) of each backend, and max |difference| from the flash backend's output.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_tools.timing import bench_us

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def run(label, q, k, v, mask, flops, device, gqa=False) -> None:
    ref = None
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):

                def call():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

                out = call()
                us = bench_us(call, device)
        except RuntimeError as e:
            print(f"{label:34s} {name:10s} unavailable ({str(e).splitlines()[0][:60]})")
            continue
        ref = out.float() if ref is None else ref
        diff = (out.float() - ref).abs().max().item()
        print(f"{label:34s} {name:10s} {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s  "
              f"max|d| {diff:.2e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    H, Hkv, N, Dh = (4, 2, 16, 16) if args.dry_run else (32, 16, 512, 64)
    S = (args.window + 1) * N
    G = H // Hkv
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    flops = 4 * H * N * S * Dh
    q_folded, k, v = randn(1, Hkv, G * N, Dh), randn(1, Hkv, S, Dh), randn(1, Hkv, S, Dh)
    print(f"# H={H} Hkv={Hkv} N={N} keys={S} Dh={Dh} {dtype}; {flops / 1e9:.1f} GFLOP a call")
    run("folded (as Attention)", q_folded, k, v, None, flops, device)
    q = q_folded.view(1, Hkv, G, N, Dh).reshape(1, H, N, Dh)
    run("GQA (enable_gqa)", q, k, v, None, flops, device, gqa=True)
    half = torch.zeros(S, device=device, dtype=dtype)
    half[: S // 2] = float("-inf")  # half the window not filled yet
    run("folded, partial-window mask", q_folded, k, v, half.view(1, 1, 1, S), flops, device)
    print("OK")


if __name__ == "__main__":
    main()
