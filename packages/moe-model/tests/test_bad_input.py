"""Bad input refused when given, naming the argument: ``buttons`` (indices or a multi-hot, by
dtype), ``device`` (known and reachable), ``dtype`` (one the chosen ``impl`` takes)."""

from __future__ import annotations

import pytest
import torch

from moe_model import (
    IMPLS,
    MOE_IMPLS,
    PRESETS,
    ExpertParallelMoE,
    MoELayer,
    WorldEngine,
    WorldModelConfig,
)
from moe_model.engine import _ctrl_tensors
from moe_model.shared_experts import SharedExperts

D, E, K, H = 32, 4, 2, 32
CPU_IMPLS = [i for i in MOE_IMPLS if IMPLS[i].available and i != "mxfp8"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")


def _layer(**kw) -> MoELayer:
    return MoELayer(
        **{"d_model": D, "n_experts": E, "top_k": K, "hidden": H, "impl": "torch", **kw}
    )


@pytest.fixture(scope="module")
def eng() -> WorldEngine:
    return WorldEngine(PRESETS["tiny"], device="cpu", dtype=torch.float32)


# -- buttons ------------------------------------------------------------------------------------

MULTI_HOT_HINT = "pass a multi-hot as a bool or floating tensor"


@pytest.mark.parametrize(
    "buttons, match",
    [
        (torch.tensor([0, 0, 1, 0]), MULTI_HOT_HINT),  # the issue: an int64 multi-hot
        ([0, 0, 1, 0], MULTI_HOT_HINT),  # the same as a list
        (torch.tensor([2, 2]), MULTI_HOT_HINT),  # a repeated index
        (torch.tensor([0.0, 7.0, 0.0, 0.0]), "buttons multi-hot must hold only 0 and 1"),
        (torch.tensor([0.0, 0.5, 0.0, 0.0]), "buttons multi-hot must hold only 0 and 1"),
        (torch.tensor([0.0, -1.0, 0.0, 0.0], dtype=torch.bfloat16), "only 0 and 1"),
        (torch.zeros(3, dtype=torch.bool), r"buttons multi-hot must have shape \(4,\)"),
        (torch.tensor([4]), r"button index 4 out of range \[0, 4\)"),
    ],
)
def test_ambiguous_or_bad_buttons_refused(eng, buttons, match):
    with pytest.raises(ValueError, match=match):
        eng.gen_frame({"buttons": buttons})
    with pytest.raises(ValueError, match=match):  # rollout checks every ctrl before a frame
        eng.rollout(2, [None, {"buttons": buttons}])
    assert int(eng.frame_index) == 0


def test_buttons_rule():
    """Integers are pressed indices (any order); bool and float tensors are multi-hots."""
    want = torch.tensor([0.0, 1.0, 0.0, 1.0])
    for b in (
        [1, 3],
        (3, 1),
        torch.tensor([3, 1]),
        torch.tensor([1, 3], dtype=torch.int32),
        torch.tensor([False, True, False, True]),
        torch.tensor([0.0, 1.0, 0.0, 1.0]),
        torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float16),
    ):
        assert torch.equal(_ctrl_tensors({"buttons": b}, 4)[0], want), b
    # an int tensor of n_buttons distinct indices is indices, never a multi-hot
    assert _ctrl_tensors({"buttons": torch.tensor([1, 0])}, 2)[0].tolist() == [1.0, 1.0]
    assert _ctrl_tensors({"buttons": []}, 4)[0].tolist() == [0.0] * 4


# -- device -------------------------------------------------------------------------------------

BAD_DEVICES = [
    pytest.param("cuda", marks=NO_CUDA),  # no CUDA here: an AssertionError inside torch before
    "cuda:64",  # past the last GPU
    "bogus",  # torch cannot parse it: its RuntimeError before
    pytest.param(3.5, id="float"),
]


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize(
    "build",
    [
        lambda dev: _layer(device=dev),
        lambda dev: MoELayer.from_preset("mixtral-8x7b", d_model=D, hidden=H, device=dev),
        lambda dev: ExpertParallelMoE.from_config(D, E, K, H, impl="torch", device=dev),
        lambda dev: SharedExperts(D, H, False, device=dev),
        lambda dev: WorldEngine(PRESETS["tiny"], device=dev),
    ],
    ids=["MoELayer", "from_preset", "EP.from_config", "SharedExperts", "WorldEngine"],
)
def test_bad_device_refused_when_built(build, device):
    with pytest.raises(ValueError, match=f"device={device!r} is not a device this process"):
        build(device)


def test_meta_device_still_builds_a_layer():
    layer = MoELayer.from_preset("deepseek-v3", device="meta", dtype=torch.bfloat16)
    assert layer.in_proj.device.type == "meta"


# -- dtype per impl -----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_float64_layer_per_impl(impl):
    """float64 weights: built (and run) only by the impls that take float64 (torch, baseline);
    the Triton impls refuse them when built, naming dtype and impl."""
    x = torch.randn(5, D, dtype=torch.float64)
    if torch.float64 in IMPLS[impl].x_dtypes:
        y = _layer(impl=impl, dtype=torch.float64)(x)
        assert y.dtype == torch.float64
        return
    with pytest.raises(TypeError, match=f"dtype must be one of .* for impl '{impl}'"):
        _layer(impl=impl, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"dtype must be one of .* for impl '{impl}'"):
        MoELayer.from_preset("qwen3-30b-a3b", d_model=D, hidden=H, impl=impl, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"dtype must be one of .* for impl '{impl}'"):
        ExpertParallelMoE.from_config(D, E, K, H, impl=impl, dtype=torch.float64)


def test_default_dtype_float64_refused_for_triton():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match=r"dtype \(None: torch's default\) must be one of"):
            _layer(impl="triton_fp32")
    finally:
        torch.set_default_dtype(old)


def test_float64_weights_then_triton_impl():
    """A float64 layer switched to a Triton impl (impl setter), or cast to float64 after being
    built: refused naming the impl and the weights, not a kernel's ``x_ND``."""
    layer = _layer(dtype=torch.float64)
    with pytest.raises(TypeError, match="expert weights' dtype must be one of .* 'triton_fp32'"):
        layer.impl = "triton_fp32"
    assert layer.impl == "torch"
    cast = _layer(impl="triton_fp32").double()
    with pytest.raises(TypeError, match="expert weights' dtype must be one of .* 'triton_fp32'"):
        cast(torch.randn(3, D, dtype=torch.float32))


def test_layer_x_of_other_dtype_or_device():
    """x may differ from the weights' dtype when the impl takes it (cast to the weights');
    otherwise, or on another device, the error names x."""
    layer = _layer(impl="triton_fp32", dtype=torch.bfloat16)
    assert layer(torch.randn(3, D)).dtype == torch.float32
    with pytest.raises(TypeError, match=r"x\.dtype must be one of .* 'triton_fp32'"):
        layer(torch.randn(3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="x is on meta"):
        layer(torch.randn(3, D, device="meta"))


@pytest.mark.parametrize("mlp", ["moe", "dense"])
def test_engine_float64_refused_when_built(mlp):
    """The attention's kernel (qk_norm_rope) reads float32/bf16/fp16 only: float64 is refused
    when the engine is built, even with the torch impl (which takes float64) or a dense MLP."""
    cfg = WorldModelConfig.from_preset("tiny", mlp=mlp)
    with pytest.raises(TypeError, match=r"dtype must be one of .*qk_norm_rope"):
        WorldEngine(cfg, device="cpu", dtype=torch.float64)


def test_engine_from_pretrained_checks_before_loading(tmp_path):
    WorldEngine(PRESETS["tiny"], device="cpu", dtype=torch.float32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # never read
    with pytest.raises(ValueError, match="device='bogus'"):
        WorldEngine.from_pretrained(tmp_path, device="bogus")
    with pytest.raises(TypeError, match="dtype must be one of"):
        WorldEngine.from_pretrained(tmp_path, device="cpu", dtype=torch.float64)
