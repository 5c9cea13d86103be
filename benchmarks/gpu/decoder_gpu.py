"""The world model's latent decoder (``moe_model.autoencoder.LatentDecoder``) at the seed size,
timed in CUDA graphs per layout and runtime (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/decoder_gpu.py              # H200
    python3 benchmarks/gpu/decoder_gpu.py --dry-run    # CPU, tiny

Variants: the module's memory format (``nn.Module.to(memory_format=...)``: NCHW, or channels_last,
where cuDNN picks NHWC kernels) x eager or ``torch.compile`` (Inductor fuses the upsampling and
SiLU around the convolutions), timed as the replay of a CUDA graph of one call
(``graph_bench_us``), with the count of pixels that differ from eager NCHW's image. Within one
level of it and repeatable: ``tests/gpu/test_gpu.py`` (moe-model).
"""

from __future__ import annotations

import sys

import torch
from common import graph_bench_us

from moe_model import WorldModelConfig
from moe_model.autoencoder import LatentDecoder

DRY = "--dry-run" in sys.argv
DEV = torch.device("cpu" if DRY else "cuda")


def main() -> int:
    cfg = WorldModelConfig.from_preset("tiny" if DRY else "seed-moe")
    torch.manual_seed(0)
    dec = LatentDecoder(cfg.latent_channels, cfg.decoder_channels).to(DEV, torch.bfloat16).eval()
    z = torch.randn(cfg.latent_channels, cfg.latent_h, cfg.latent_w, device=DEV)
    with torch.no_grad():
        want = dec(z)
        rows = []
        for fmt in (torch.contiguous_format, torch.channels_last):
            for comp in (False, True):
                torch._dynamo.reset()
                m = LatentDecoder(cfg.latent_channels, cfg.decoder_channels)
                m.load_state_dict(dec.state_dict())
                m = m.to(DEV, torch.bfloat16).eval().to(memory_format=fmt)
                fn = torch.compile(m, fullgraph=True) if comp else m
                name = f"{'NHWC' if fmt is torch.channels_last else 'NCHW'} " + (
                    "compiled" if comp else "eager"
                )
                diff = (fn(z).int() - want.int()).abs()
                us = graph_bench_us(lambda fn=fn: fn(z), dry=DRY)
                rows.append((name, us, int((diff > 0).sum()), want.numel()))
    print(f"\n{'variant':22} {'graph_us':>9} {'diff px':>8}")
    for name, us, n_diff, n in rows:
        print(f"{name:22} {us:9.1f} {n_diff:8d} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
