"""Forward + backward of one MoE layer (the `moe-bench train` layer), eager and on CUDA compiled,
for the differentiable implementations; an impl whose backward raises is skipped."""

from __future__ import annotations

import pytest
import torch

from moe_tools.tables import short_error
from moe_tools.train.measure import PRESETS, build_layer, reference_grads, rel_err

CUDA = torch.cuda.is_available()

PRESET = "seed-moe" if CUDA else "tiny"
MODES = ("eager", "compiled") if CUDA else ("eager",)
IMPLS = ("torch", "triton_bf16")


@pytest.fixture(scope="module")
def layer_and_inputs(device):
    cfg = {**PRESETS[PRESET], "gated": False, "renormalize": False}
    dtype = torch.bfloat16 if CUDA else torch.float32
    layer = build_layer(cfg, device, dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["tokens"], cfg["d_model"], generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(cfg["tokens"], cfg["d_model"], generator=gen).to(device=device, dtype=dtype)
    ref = reference_grads(layer, x, dy)
    return layer, x.requires_grad_(True), dy, ref


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_moe_layer_fwd_bwd(benchmark, sync, layer_and_inputs, impl, mode):
    layer, x, dy, ref = layer_and_inputs
    try:
        layer.impl = impl
        layer(x).backward(dy)
    except Exception as exc:
        pytest.skip(f"no backward: {short_error(exc)}")
    fn = layer
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True)

    def fwd_bwd() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fn(x).backward(dy)
        sync()

    try:
        fwd_bwd()  # first call: compiles forward and backward
        benchmark.pedantic(fwd_bwd, rounds=20 if CUDA else 5, iterations=1, warmup_rounds=2)
        benchmark.extra_info.update(
            preset=PRESET,
            tokens=x.shape[0],
            impl=impl,
            mode=mode,
            grad_x_err=rel_err(x.grad, ref["x"]),
            grad_in_proj_err=rel_err(layer.in_proj.grad, ref["in_proj"]),
        )
        assert torch.isfinite(x.grad.float()).all()
    finally:
        if mode == "compiled":
            torch._dynamo.reset()
