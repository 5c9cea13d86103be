"""The persistent K-grouped weight-gradient GEMM (``_triton/grouped_weight_grad.py``, issue 33)
beside ``torch._grouped_mm``'s K-grouped CUTLASS GEMM on the two weight gradients of an MoE
layer's training step: ``dw_in[e] = dh_e.T @ xs_e`` (E, X, D) and ``dw_out[e] = dyg_e.T @
(s a)_e`` (E, D, H), over the groups of a real routing plan (unaligned group sizes). Each launch
config is timed in CUDA graphs (device time per call) after a one-line sanity check against an
fp32 reference (relative error printed); the last column says whether it equals CUTLASS bit for
bit, or which kernel ``grouped_weight_grad`` runs by default (``_gemm_plan.
use_persistent``). The public op's correctness: ``tests/gpu/test_grouped_mm_gpu.py``.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/grouped_weight_grad_gpu.py [--shapes=seed,qwen3,...] [--configs]
        [--dry-run]

``--configs`` adds other launch configs (the typed override ``config=WgradConfig(...)``: TMA for
neither operand, for x, or for both; other tiles and stages); ``--dry-run``: one tiny shape on
the CPU (set ``TRITON_INTERPRET=1``), no CUTLASS column.
"""

from __future__ import annotations

import torch
from common import config_sweep_main, graph_us, once_us
from persistent_grouped_mm_gpu import SHAPES, TINY

import moe_kernels as mk
from moe_kernels import _gemm_plan as rules
from moe_kernels._triton.grouped_weight_grad import grouped_weight_grad
from moe_kernels.reference.grouped_mm import grouped_weight_grad as reference

C = rules.WgradConfig
OTHER_CONFIGS = [
    C(tma="none"),
    C(tma="both"),
    C(num_stages=4),
    C(128, 128, 64, 8, 4),
    C(256, 128, 64, 8, 3),
    C(128, 256, 64, 8, 3, programs_per_sm=2),
]


def wgrads(shape, dev, dtype):
    """(offsets, {name: (dy (R, N), x (R, D))}) of the layer's two weight gradients."""
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=dev).manual_seed(0)
    plan = mk.route(torch.randn(T, E, device=dev, generator=g).softmax(-1), k)
    R, X = plan.token_indices.shape[0], 2 * H if gated else H

    def r(*s):
        return torch.randn(*s, device=dev, generator=g).to(dtype)

    return plan.offsets, {"dw_in": (r(R, X), r(R, D)), "dw_out": (r(R, D), r(R, H))}


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_shape(name, shape, configs, dev, dtype, dry):
    offsets, cases = wgrads(shape, dev, dtype)
    offs32 = offsets[1:].to(torch.int32)
    num_experts = offsets.shape[0] - 1
    timer = once_us if dry else (lambda fn: graph_us(fn, calls=3, replays=7))
    for gemm, (dy, x) in cases.items():
        flops = 2 * dy.shape[0] * dy.shape[1] * x.shape[1]
        ref = reference(dy.float(), x.float(), offsets, None, torch.float32)
        base, cutlass = float("nan"), None
        if not dry:
            cutlass = torch._grouped_mm(dy.mT, x, offs=offs32)
            base = timer(lambda dy=dy, x=x: torch._grouped_mm(dy.mT, x, offs=offs32))
        pick = rules.use_persistent(
            dy.shape[0], num_experts, dtype == torch.bfloat16, 9, True, wgrad=True
        )
        print(f"{name:<10}{gemm:<8}{'cutlass':<46}{base:>10.1f}{flops / base / 1e6:>8.0f}"
              f"{'':>8}{'persistent' if pick else 'cutlass':>12}", flush=True)  # fmt: skip
        for cfg in configs:
            out = grouped_weight_grad(dy, x, offsets, None, dtype, cfg)
            label = "default" if cfg is None else str(tuple(cfg))
            err = rel_err(out, ref)
            if err >= (1e-2 if dtype == torch.bfloat16 else 1e-5):
                print(f"{name:<10}{gemm:<8}{label:<46} FAIL: {err:.1e} from fp32", flush=True)
                continue
            bits = ""
            if cutlass is not None:
                bits = "==cutlass" if torch.equal(out, cutlass) else "!=cutlass"
            us = timer(lambda dy=dy, x=x, cfg=cfg: grouped_weight_grad(dy, x, offsets, None,
                                                                       dtype, cfg))  # fmt: skip
            print(f"{name:<10}{gemm:<8}{label:<46}{us:>10.1f}{flops / us / 1e6:>8.0f}"
                  f"{us / base:>8.2f}{bits:>12}", flush=True)  # fmt: skip


def main():
    header = (f"{'shape':<10}{'gemm':<8}{'kernel (config)':<46}{'us':>10}{'TFLOP/s':>8}"
              f"{'/cutlass':>8}{'rule/bits':>12}")  # fmt: skip
    config_sweep_main(__doc__, SHAPES, TINY, OTHER_CONFIGS, run_shape, header)


if __name__ == "__main__":
    main()
