"""World-model rollouts: one benchmark round is a full rollout of FRAMES frames."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_tools.timing import peak_memory_gib, reset_peak_memory

CUDA = torch.cuda.is_available()

PRESET = "seed-moe" if CUDA else "tiny"
FRAMES = 256 if CUDA else 8
ROUNDS = 3 if CUDA else 2

# (config overrides, engine options). The test id shows both, and the parameter counts.
if CUDA:
    VARIANTS: list[tuple[dict[str, Any], dict[str, bool]]] = [
        ({}, {}),
        ({}, {"compile": True, "cuda_graph": True}),
        ({"moe_impl": "torch"}, {"compile": True, "cuda_graph": True}),
        ({"window": 4}, {"compile": True, "cuda_graph": True}),
    ]
else:
    VARIANTS = [
        ({}, {}),
        ({"moe_impl": "triton_bf16"}, {}),
        ({"window": 2, "n_layers": 1}, {}),
    ]


def _human(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _variant_id(overrides: dict[str, Any], opts: dict[str, bool]) -> str:
    from moe_model import WorldModelConfig, count_parameters

    total, active = count_parameters(WorldModelConfig.from_preset(PRESET, **overrides))
    parts = [PRESET, *(f"{k}={v}" for k, v in overrides.items())]
    parts += [k for k, v in opts.items() if v]
    return "-".join(parts) + f"-params={_human(total)}-active={_human(active)}"


@pytest.mark.parametrize(
    ("overrides", "opts"), VARIANTS, ids=[_variant_id(o, e) for o, e in VARIANTS]
)
def test_ar_rollout(benchmark, device, sync, overrides, opts):
    from moe_model import WorldEngine, WorldModelConfig

    config = WorldModelConfig.from_preset(PRESET, **overrides)
    dtype = torch.bfloat16 if CUDA else torch.float32
    engine = WorldEngine(config, device=device, dtype=dtype, seed=0, **opts)
    for _ in range(4 if CUDA else 1):  # warm-up: compilation, autotuning, allocator
        engine.gen_frame()

    def setup() -> None:
        engine.reset()

    def rollout() -> None:
        for _ in engine.rollout(FRAMES):
            pass
        sync()

    reset_peak_memory(device)
    benchmark.pedantic(rollout, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    alloc, reserved = peak_memory_gib(device)
    benchmark.extra_info.update(
        preset=PRESET,
        overrides=dict(overrides),
        frames=FRAMES,
        fps=FRAMES / benchmark.stats.stats.median,
        params=engine.num_parameters(),
        active=engine.num_active_parameters(),
        max_vram_alloc=alloc,
        max_vram_reserved=reserved,
        **opts,
    )
    assert benchmark.stats.stats.median > 0
