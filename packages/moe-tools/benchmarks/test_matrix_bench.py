"""One MoE layer forward per implementation (the `moe-bench matrix` layer), eager and compiled."""

from __future__ import annotations

import pytest
import torch

from moe_tools.matrix import build_layer, diff_stats, layer_sizes
from moe_tools.tables import short_error

CUDA = torch.cuda.is_available()

PRESET = "seed-moe" if CUDA else "tiny"
TOKENS = 2048 if CUDA else 64
MODES = ("eager", "compiled") if CUDA else ("eager",)


def _impls() -> list[str]:
    from moe_model import MOE_IMPLS

    return list(MOE_IMPLS)


@pytest.fixture(scope="module")
def layer_and_input(device):
    sizes = layer_sizes(PRESET)
    dtype = torch.bfloat16 if CUDA else torch.float32
    layer = build_layer(sizes, device, dtype, seed=0)
    x = torch.randn(TOKENS, sizes["d_model"], generator=torch.Generator().manual_seed(0))
    x = x.to(device=device, dtype=dtype)
    with torch.no_grad():
        y_base = layer(x).clone()
    return layer, x, y_base


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", _impls())
def test_moe_layer(benchmark, sync, layer_and_input, impl, mode):
    layer, x, y_base = layer_and_input
    try:
        layer.impl = impl
    except Exception as exc:
        pytest.skip(f"unavailable: {short_error(exc)}")
    fn = layer
    if mode == "compiled":
        if impl == "baseline":
            pytest.skip("expected: the baseline syncs with the host (no fullgraph compile)")
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True)

    def forward() -> torch.Tensor:
        y = fn(x)
        sync()
        return y

    with torch.no_grad():
        y = forward()  # first call: compiles
        benchmark.pedantic(forward, rounds=20 if CUDA else 5, iterations=1, warmup_rounds=2)
    vs_max, vs_mean = diff_stats(y, y_base)
    benchmark.extra_info.update(
        preset=PRESET,
        tokens=TOKENS,
        impl=impl,
        mode=mode,
        vs_base_max=vs_max,
        vs_base_mean=vs_mean,
    )
    if mode == "compiled":
        torch._dynamo.reset()
    assert torch.isfinite(y.float()).all()
