"""The persistent grouped GEMM over expert-sorted rows (``_triton/persistent_grouped_mm.py``,
issue 33) beside ``torch._grouped_mm`` (CUTLASS) on the four row-grouped GEMMs of an MoE layer's
training step, per shape and launch config: the up-projection ``xs @ w_in[e].T``, the
down-projection ``a @ w_out[e].T``, the down-projection's data gradient ``dY[tok] @ w_out[e]``
and the up-projection's ``dh @ w_in[e]`` ("kn": the ``.mT`` view the backward passes), each
timed in CUDA graphs (device time per call); the ``bits`` column says whether it equals CUTLASS
on the group rows, the ``rule`` column which kernel ``_gemm_plan.use_persistent`` picks.
The public op against CUTLASS: ``tests/gpu/test_grouped_mm_gpu.py``.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/persistent_grouped_mm_gpu.py [--shapes=seed,qwen3,...] [--configs]
        [--dry-run]

``--configs`` adds other tile configs (the typed override ``config=PersistentConfig(...)``);
``--dry-run``: one tiny shape on the CPU (set ``TRITON_INTERPRET=1``), no CUTLASS column.
"""

from __future__ import annotations

import torch
from common import config_sweep_main, graph_us, once_us

import moe_kernels as mk
from moe_kernels import _gemm_plan as rules
from moe_kernels._triton.persistent_grouped_mm import persistent_grouped_mm

SHAPES = {  # name: (tokens, d_model, hidden, experts, top_k, gated); rows per expert = T k / E
    "k2": (8192, 2048, 768, 128, 2, True),  # 128
    "t2048": (2048, 2048, 768, 128, 8, True),  # 128
    "e256": (8192, 2048, 768, 256, 8, True),  # 256
    "qwen3": (8192, 2048, 768, 128, 8, True),  # 512
    "seed": (2048, 2048, 1024, 16, 8, False),  # 1024
    "sonic_mem": (24576, 1536, 256, 128, 8, True),  # 1536
    "sonic": (32768, 4096, 1024, 128, 8, True),  # 2048
    "e16": (8192, 2048, 768, 16, 8, True),  # 4096
}
TINY = (64, 32, 16, 4, 2, True)
C = rules.PersistentConfig
OTHER_CONFIGS = [C(128, 256, 64, 8, 3, flatten=False), C(128, 128, 64, 8, 4), C(64, 256, 64, 4, 4)]


def gemms(shape, dev, dtype):
    """{name: (a (R, K), w, layout, w as the (E, N, K) view torch._grouped_mm's B transposes)}."""
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=dev).manual_seed(0)
    plan = mk.route(torch.randn(T, E, device=dev, generator=g).softmax(-1), k)
    R, X = plan.token_indices.shape[0], 2 * H if gated else H

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(dtype)

    w_in, w_out = r(E, X, D, scale=D**-0.5), r(E, D, H, scale=H**-0.5)
    xs, a, dyg, dh = r(R, D), r(R, H), r(R, D, scale=D**-0.5), r(R, X)
    return plan.offsets, {
        "up": (xs, w_in, "nk", w_in),
        "down": (a, w_out, "nk", w_out),
        "dgrad": (dyg, w_out, "kn", w_out.mT),
        "dx": (dh, w_in, "kn", w_in.mT),
    }


def run_shape(name, shape, configs, dev, dtype, dry):
    offsets, cases = gemms(shape, dev, dtype)
    offs32 = offsets[1:].to(torch.int32)
    rows, num_experts = int(offsets[-1]), offsets.shape[0] - 1
    timer = once_us if dry else (lambda fn: graph_us(fn, calls=3, replays=7))
    for gemm, (a, w, layout, w_end) in cases.items():
        flops = 2 * a.shape[0] * w_end.shape[1] * a.shape[1]
        base = float("nan")
        cutlass = None
        if not dry:
            cutlass = torch._grouped_mm(a, w_end.mT, offs=offs32)
            base = timer(lambda a=a, w_end=w_end: torch._grouped_mm(a, w_end.mT, offs=offs32))
        pick = rules.use_persistent(a.shape[0], num_experts, dtype == torch.bfloat16, 9, True)
        print(f"{name:<10}{gemm:<7}{'cutlass':<40}{base:>10.1f}{flops / base / 1e6:>8.0f}"
              f"{'':>14}{'persistent' if pick else 'cutlass':>12}", flush=True)  # fmt: skip
        for cfg in configs:
            c = persistent_grouped_mm(a, w, offsets, layout, cfg)
            bits = (
                "" if cutlass is None else "==" if torch.equal(c[:rows], cutlass[:rows]) else "!="
            )
            us = timer(lambda a=a, w=w, layout=layout, cfg=cfg: persistent_grouped_mm(
                a, w, offsets, layout, cfg))  # fmt: skip
            label = "default" if cfg is None else str(tuple(cfg))
            print(f"{name:<10}{gemm:<7}{label:<40}{us:>10.1f}{flops / us / 1e6:>8.0f}"
                  f"{us / base:>8.2f}{bits:>6}", flush=True)  # fmt: skip


def main():
    header = (f"{'shape':<10}{'gemm':<7}{'kernel (config)':<40}{'us':>10}{'TFLOP/s':>8}"
              f"{'/cutlass':>8}{'bits':>6}{'rule':>12}")  # fmt: skip
    config_sweep_main(__doc__, SHAPES, TINY, OTHER_CONFIGS, run_shape, header)


if __name__ == "__main__":
    main()
