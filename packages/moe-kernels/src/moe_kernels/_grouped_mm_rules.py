"""Which kernel runs a grouped GEMM over expert-sorted rows, and the persistent kernel's config.

Plain Python (no Triton import), so the rule has one test and the CPU path needs no Triton.

From the H200 (``benchmarks/gpu/persistent_grouped_mm_gpu.py``, torch 2.11, triton 3.6, bf16,
two runs on two machines): the flattened persistent Triton kernel
(``_triton/persistent_grouped_mm.py``, 128 x 256 x 64 tiles, 8 warps, 3 stages, TMA) against
``torch._grouped_mm`` (CUTLASS), per row-grouped GEMM of the layer's step, took 0.71-0.81x
CUTLASS's time at 128 rows per expert, 0.88-0.97x at 256, 0.84-0.97x at 512 (the Qwen3-30B-A3B
layer) and 0.94-0.98x at 1024 (seed); above, 0.91-1.04x in one run and 0.99-1.05x in the other,
so CUTLASS stays there. Its output bits equal CUTLASS's on every GEMM measured (both accumulate K
in order in fp32, no split-K). docs/training.md has the tables.
"""

from __future__ import annotations

from typing import NamedTuple

from moe_kernels._triton.blocks import pow2_clamp  # plain Python: no Triton import

# Mean rows per expert up to which the persistent row-grouped GEMM runs (above it CUTLASS was as
# fast).
PERSISTENT_MAX_ROWS_PER_EXPERT = 1024
# Likewise for the K-grouped weight gradient: 0.87-0.91x CUTLASS's time at 128 rows per expert,
# 1.04-1.11x from 256 up, the same bits (benchmarks/gpu/grouped_weight_grad_gpu.py on an H100,
# ragged-descriptor loads; docs/training.md, session 28).
WGRAD_MAX_ROWS_PER_EXPERT = 128


class PersistentConfig(NamedTuple):
    """Tile shape and launch parameters of one persistent grouped-GEMM launch. ``tma``: A and B
    through TMA descriptors where the tensors allow; ``programs_per_sm``: the persistent grid is
    that many programs per multiprocessor; ``flatten``: the tile loop and the K loop as one
    software-pipelined loop (the next tile's loads in flight during a tile's store)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    programs_per_sm: int = 1
    flatten: bool = True


def use_persistent(
    num_rows: int, num_experts: int, bf16: bool, sm_major: int, tma: bool, wgrad: bool = False
) -> bool:
    """Whether a grouped GEMM over ``num_rows`` sorted rows in ``num_experts`` groups (``wgrad``:
    the K-grouped weight gradient over them) runs the persistent Triton kernel rather than
    CUTLASS: bf16 on sm90 (the chip it was measured on), operands TMA can read (``tma``: eager,
    contiguous, aligned), and at most ``PERSISTENT_MAX_ROWS_PER_EXPERT`` (``wgrad``:
    ``WGRAD_MAX_ROWS_PER_EXPERT``) rows per expert on average (a static bound: no host read of
    the group sizes)."""
    if not (bf16 and sm_major == 9 and tma and num_experts > 0):
        return False
    bound = WGRAD_MAX_ROWS_PER_EXPERT if wgrad else PERSISTENT_MAX_ROWS_PER_EXPERT
    return num_rows <= bound * num_experts


def persistent_config(
    num_rows: int, n: int, k: int, num_experts: int, interpret: bool
) -> PersistentConfig:
    """The launch config for ``num_rows`` x ``n`` outputs over ``k`` in ``num_experts`` groups.
    GPU: 128 x 256 x 64, 8 warps, 3 stages, flattened, TMA (the fastest of the H200 sweep at every
    shape measured); BN and BK shrink to small n and k. Interpreter: 16-32 row tiles, one stage,
    pointer loads, few programs (each costs ~0.4 ms of numpy overhead)."""
    if interpret:
        return PersistentConfig(
            block_m=pow2_clamp(num_rows, 16, 32),
            block_n=pow2_clamp(n, 16, 64),
            block_k=pow2_clamp(k, 16, 64),
            num_warps=4,
            num_stages=1,
            tma=False,
            flatten=False,
        )
    return PersistentConfig(block_n=pow2_clamp(n, 16, 256), block_k=pow2_clamp(k, 16, 64))


class WgradConfig(NamedTuple):
    """Tile shape and launch parameters of one weight-gradient launch (``_triton/
    grouped_weight_grad.py``): BN x BD output tiles over BK-row steps; ``tma``: which operands
    come through TMA descriptors where they allow it (bf16, sorted rows, contiguous, aligned):
    "none" (pointer loads), "x" or "both"; ``programs_per_sm``: the persistent grid is that many
    programs per multiprocessor."""

    block_n: int = 128
    block_d: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: str = "x"
    programs_per_sm: int = 1


def wgrad_config(n: int, d: int, interpret: bool, fp32: bool = False) -> WgradConfig:
    """The weight-gradient launch config for (E, n, d) outputs. GPU, 16-bit: 128 x 256 x 64,
    8 warps, 3 stages, x through TMA (wgmma, 200-210 registers, no spills, 176 KiB of shared
    memory on sm_90a); fp32 (an exact fp32 dot on CUDA cores): 128 x 128 x 32, pointer loads
    (147 registers, no spills; 128 x 256 x 64 spilled 38 KB); BN and BD shrink to small n and
    d. Interpreter: 16-64 tiles, one stage, pointer loads."""
    if interpret:
        return WgradConfig(pow2_clamp(n, 16, 64), pow2_clamp(d, 16, 64), 16, 4, 1, tma="none")
    if fp32:
        return WgradConfig(pow2_clamp(n, 16, 128), pow2_clamp(d, 16, 128), 32, tma="none")
    return WgradConfig(block_n=pow2_clamp(n, 16, 128), block_d=pow2_clamp(d, 16, 256))
