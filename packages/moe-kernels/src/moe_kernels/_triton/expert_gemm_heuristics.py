"""The persistent grouped GEMM's launch config, chosen from the problem's sizes alone.

One rule, kept here so that it has one test: tiles, warps and stages for ``expert_gemm`` on a GPU,
or few large programs under the interpreter (each program costs ~0.4 ms of numpy overhead).
"""

from __future__ import annotations

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import next_pow2
from moe_kernels._triton.expert_gemm import ACT, ExpertGemmConfig


def _pow2_clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(max(value, 1))))


def pick_config(
    num_rows: int,
    n: int,
    k: int,
    num_experts: int,
    epilogue: int,
    gated: bool,
    elem_bytes: int = 2,
    cuda: bool = True,
) -> ExpertGemmConfig:
    """The config for ``num_rows`` x ``n`` outputs (per accumulator) over ``k``, ``num_experts``
    groups. GPU: 128 x 128 x 64 tiles, 8 warps, 4 stages (3 with two accumulators), TMA;
    BN/BK shrink for small n/k. Interpreter (or no CUDA): 16-32 row tiles, one stage, pointers."""
    if INTERPRET or not cuda:
        return ExpertGemmConfig(
            block_m=_pow2_clamp(num_rows, 16, 32),
            block_n=_pow2_clamp(n, 16, 64),
            block_k=_pow2_clamp(k, 16, 64),
            num_warps=4,
            num_stages=1,
            tma=False,
        )
    dual = epilogue == ACT and gated
    block_n = _pow2_clamp(n, 16, 128)
    block_k = _pow2_clamp(k, 16, 64 if elem_bytes <= 2 else 32)
    stages = 3 if dual else 4
    return ExpertGemmConfig(128, block_n, block_k, 8, stages, tma=True)
