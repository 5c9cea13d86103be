"""`moe-bench rollout --profile`'s roofline on CPU: the tiny frame's counts against a hand count
and torch's FlopCounterMode, the floor / achieved arithmetic, and the profile's new columns."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moe_model import WorldEngine, WorldModelConfig
from moe_model.expert_ops import grouped_mm_supported
from moe_tools import cli, rollout_profile
from moe_tools import rollout_roofline as rr
from moe_tools.rollout_profile import CATEGORIES, Activity, breakdown


def _tiny() -> WorldModelConfig:
    return WorldModelConfig.from_preset("tiny")


def _hand_count() -> tuple[dict[str, int], dict[str, int]]:
    """FLOPs and bytes (bf16, 2 B) of one tiny frame by hand: 2 layers, d 64, 4/2 heads of 16, 4
    experts top-2 of hidden 32 (not gated), 16 tokens (8x8 latent of 4 channels, 2x2 patches:
    patch dim 16), window 3 (64 keys), cond 32, freq 32, 4 buttons, 2 denoise steps: 3 passes,
    the projections of 2 x 2 + 1 = 5 full layers, K/V and modulation of 6, the final layer of 2;
    the last frame's cache pass and the first denoise pass are one forward of 32 rows, so the
    matmuls read their weights in 2 forwards: K/V and modulation 4 times, the layers in full 4
    (32 rows in layer 0, 16 in layer 1 and in the second denoise pass's two layers); decoder
    channels 16, 16, 8, 4 at 8x8 (64 px) -> 16x16 -> 32x32 -> 64x64 (4096 px)."""
    cond = 32 * 32 + 32 * 32 + 4 * 32 + 2 * 32  # t_embed (2), buttons, mouse: 2240 weights
    flops = {
        "gemm": 3 * 2 * 16 * 16 * 64  # patch_embed
        + 3 * 2 * cond
        + 6 * 2 * 32 * 384  # modulation 32 -> 6 x 64
        + 6 * 2 * 16 * 64 * 64  # k and v: 64 -> 2 x 32
        + 5 * 2 * (2 * 16 * 64 * 64)  # q and o
        + 5 * 2 * (2 * 32 * 64 * 32)  # experts: 32 rows, up and down
        + 2 * (2 * 32 * 128 + 2 * 16 * 64 * 16),  # final_mod, final_proj
        "attention": 5 * 4 * 4 * 16 * 64 * 16,
        "routing": 5 * 2 * 16 * 64 * 4,
        "pointwise": 0,
        "decode": 18 * (64 * 4 * 16 + 256 * 16 * 16 + 1024 * 16 * 8 + 4096 * 8 * 4 + 4096 * 4 * 3),
        "other": 0,
    }
    rows = 3 * 16  # the passes' rows; 5 * 16 in the layers in full, 6 * 16 at K/V
    nbytes = {
        "gemm": 2
        * (
            2 * 16 * 64
            + rows * (16 + 64)  # patch_embed
            + 3 * cond
            + 4 * 32 * 384
            + 6 * (32 + 384)  # modulation: weights, conditioning rows in and out
            + 4 * 64 * 64
            + 6 * 16 * (64 + 64)  # k and v
            + 2 * (4 * 64 * 64 + 5 * 16 * (64 + 64))  # q and o
            + 4 * 4 * 64 * 32
            + 5 * (16 * 64 + 32 * 32)  # all 4 experts' weights, tokens, rows out
            + 4 * 4 * 32 * 64
            + 5 * (32 * 32 + 32 * 64)
            + 2 * (32 * 128 + 32 + 128)
            + 2 * (64 * 16 + 16 * 64 + 16 * 16)
        ),
        "attention": 5 * 2 * (2 * 16 * 64 + 2 * 64 * 32),  # q, o; K and V of 64 keys x 32
        "routing": 4 * 64 * 4 * 4
        + 5 * (16 * 64 * 2 + 16 * 4 * 4)  # fp32 weight, scores
        + 5 * 2 * (32 * 64 + 16 * 64),  # combine
        "pointwise": 2
        * (
            6 * 2 * 16 * 64  # norm1 + modulation
            + 5 * 2 * 16 * (64 + 64)  # QK-norm + RoPE: q, k, v in and out
            + 5 * (4 + 3) * 16 * 64  # residual + norm2, residual
            + 2 * 4 * 16 * 32  # ring write, the cache pass's 2 layers
            + 2 * 2 * 16 * 64  # final norm
        )
        + 2 * 3 * 256 * 4,  # Euler step, fp32 latent of 256
        "decode": 2
        * (
            (9 * 4 * 16 + 64 * 4 + 64 * 16)
            + (9 * 16 * 16 + 64 * 16 + 256 * 16)
            + (9 * 16 * 8 + 256 * 16 + 1024 * 8)
            + (9 * 8 * 4 + 1024 * 8 + 4096 * 4)
            + (9 * 4 * 3 + 4096 * 4 + 4096 * 3)
        )
        + 3 * 4096 * 3,  # bf16 RGB in, uint8 out
        "other": 0,
    }
    return flops, nbytes


def test_tiny_frame_matches_the_hand_count():
    flops, nbytes = _hand_count()
    roof = rr.roofline(rr.frame_ops(_tiny(), itemsize=2), None)
    assert {c.category: c.flops for c in roof.categories} == flops
    assert {c.category: c.bytes for c in roof.categories} == nbytes
    assert roof.flops == sum(flops.values()) and roof.bytes == sum(nbytes.values())
    assert roof.floor_ms is None and roof.frame_bound_ms is None and roof.peak is None
    latents = rr.roofline(rr.frame_ops(_tiny(), itemsize=2, images=False), None)
    decode = {c.category: c for c in latents.categories}["decode"]
    assert decode.flops == 0 and decode.bytes == 0


def test_matmul_flops_match_torch_flop_counter():
    """One steady tiny frame, eager on CPU, torch MoE impl: FlopCounterMode counts the linear
    layers (mm, addmm), the decoder (convolution) and, under the math SDPA backend only, the
    attention (bmm); CPU's fused SDPA op has no flop formula (counted 0). The torch impl's CPU
    grouped GEMM is ``torch._grouped_mm`` where it runs (torch 2.11+: no flop formula, counted 0),
    else a static loop of every expert over all rows (E times the routed FLOPs, expert_ops)."""
    cfg = _tiny()
    engine = WorldEngine(cfg, device="cpu", dtype=torch.float32, impl="torch")
    for _ in range(cfg.window):
        engine.gen_frame()
    with FlopCounterMode(display=False) as fused:
        engine.gen_frame()
    with FlopCounterMode(display=False) as math_sdpa, sdpa_kernel(SDPBackend.MATH):
        engine.gen_frame()
    ops = rr.frame_ops(cfg, itemsize=4)
    cats = {c.category: c.flops for c in rr.roofline(ops, None).categories}
    experts = sum(o.flops * o.calls for o in ops if o.name.startswith("experts_"))
    a, b = torch.zeros(8, cfg.d_model), torch.zeros(cfg.n_experts, cfg.d_model, cfg.moe_hidden)
    counted = -1 if grouped_mm_supported(a, b) else cfg.n_experts - 1  # extra expert passes
    for counts in (fused.get_flop_counts()["Global"], math_sdpa.get_flop_counts()["Global"]):
        got = {str(k).removeprefix("aten."): v for k, v in counts.items()}
        linear = got["mm"] + got.get("addmm", 0)
        assert linear == cats["gemm"] + cats["routing"] + counted * experts
        assert got["convolution"] == cats["decode"]
    assert "bmm" not in {str(k) for k in fused.get_flop_counts()["Global"]}
    assert math_sdpa.get_flop_counts()["Global"][torch.ops.aten.bmm] == cats["attention"]


def test_peaks_by_device_name_and_overrides():
    assert rr.find_peak("NVIDIA H200") == rr.Peak("H200", 989.0, 4800.0)
    assert rr.find_peak("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert rr.find_peak("NVIDIA H100 PCIe").gbps == 2000.0  # the longest prefix wins
    assert rr.find_peak("NVIDIA H200", gbps=4000.0) == rr.Peak("H200", 989.0, 4000.0)
    assert rr.find_peak(None) is None and rr.find_peak("NVIDIA RTX 4090") is None
    assert rr.find_peak("RTX 4090", tflops=165.0) is None  # bandwidth still unknown
    assert rr.find_peak(None, tflops=2.0, gbps=3.0) == rr.Peak("custom", 2.0, 3.0)


def test_floor_and_achieved_arithmetic():
    peak = rr.Peak("p", 100.0, 1000.0)  # 1e14 FLOP/s, 1e12 B/s
    mm = rr.OpCount("mm", "gemm", 2e11, 1e9, 3)  # per call: 2 ms of FLOPs, 1 ms of bytes
    io = rr.OpCount("io", "pointwise", 0, 5e8, 2)  # 0.5 ms of bytes
    small = rr.OpCount("gemv", "gemm", 1e9, 1e9, 1)  # 0.01 ms of FLOPs, 1 ms of bytes
    assert mm.floor_ms(peak) == pytest.approx(6.0) and io.floor_ms(peak) == pytest.approx(1.0)
    roof = rr.roofline([mm, io, small], peak)
    cats = {c.category: c for c in roof.categories}
    assert [c.category for c in roof.categories] == list(CATEGORIES)
    assert cats["gemm"].floor_ms == pytest.approx(7.0)  # per op: 6 + 1, not max(6.01, 4)
    assert cats["gemm"].flops == 6.01e11 and cats["gemm"].bytes == 4e9
    assert roof.floor_ms == pytest.approx(8.0)
    assert roof.frame_bound_ms == pytest.approx(max(6.01, 5.0))
    got = rr.achieved(6e11, 4e9, 7.0, 14.0, peak)
    assert got["achieved_tflops"] == pytest.approx(6e11 / 14e-3 / 1e12)
    assert got["achieved_gbps"] == pytest.approx(4e9 / 14e-3 / 1e9)
    assert got["x_floor"] == pytest.approx(2.0) and got["bound"] == "compute"
    assert rr.achieved(0, 1e9, 1.0, 2.0, peak)["bound"] == "memory"
    none = rr.achieved(0, 0, 0.0, 2.0, peak)  # no work: nothing achieved
    assert none["achieved_gbps"] is None and none["x_floor"] is None and none["bound"] is None
    assert rr.achieved(1e9, 1e9, None, 2.0, None)["x_floor"] is None


def _profile() -> dict:
    acts = [
        Activity("nvjet_a", 14000.0, "frame", True),
        Activity("triton_poi_fused_0", 2000.0, "frame", True),
    ]
    return breakdown(acts, 1, host_us=20000.0, launches=2, basis="device").to_dict()


def test_profile_rows_carry_the_roofline():
    peak = rr.Peak("p", 100.0, 1000.0)
    ops = [rr.OpCount("mm", "gemm", 6e11, 4e9, 1), rr.OpCount("io", "pointwise", 0, 5e8, 2)]
    prof = rr.attach(_profile(), rr.roofline(ops, peak))
    assert json.loads(json.dumps(prof)) == prof
    cols = rollout_profile.profile_columns(prof)
    assert cols == [*rollout_profile.PROFILE_COLUMNS, *rollout_profile.ROOFLINE_COLUMNS]
    assert cols[-5:] == ["flops", "bytes", "floor_ms", "achieved", "x_floor"]
    rows = {r["category"]: r for r in rollout_profile.profile_rows(prof)}
    assert rows["gemm"]["floor_ms"] == pytest.approx(6.0)  # 6e11 FLOP at 1e14 FLOP/s
    assert rows["gemm"]["x_floor"] == pytest.approx(14.0 / 6.0)
    assert rows["gemm"]["achieved"] == "42.857 TFLOP/s"  # compute-bound: 6e11 FLOP / 14 ms
    assert prof["categories"][0]["bound"] == "compute"
    assert prof["categories"][0]["achieved_gbps"] == pytest.approx(4e9 / 14e-3 / 1e9)
    assert rows["pointwise"]["achieved"] == "500.0 GB/s"  # 1e9 B / 2 ms
    assert rows["decode"]["achieved"] is None and rows["decode"]["x_floor"] is None
    assert rows["total"]["floor_ms"] == pytest.approx(7.0)
    assert rows["total"]["x_floor"] == pytest.approx(16.0 / 7.0)
    text = rollout_profile.format_profile(prof)
    assert text.splitlines()[0].split() == cols
    assert "floor 7 ms/frame" in text and "142.9 fps" in text
    md = rollout_profile.markdown_profile(prof)
    assert "| flops | bytes | floor_ms | achieved | x_floor |" in md
    bare = rr.attach(_profile(), rr.roofline(ops, None))
    assert "no peaks known" in rollout_profile.format_profile(bare)
    assert rollout_profile.profile_rows(bare)[0]["floor_ms"] is None
    assert rollout_profile.profile_rows(bare)[0]["achieved"] == "42.857 TFLOP/s"  # it has FLOPs
    memory = rr.attach(_profile(), rr.roofline([rr.OpCount("mv", "gemm", 1e9, 4e9, 1)], peak))
    assert rollout_profile.profile_rows(memory)[0]["achieved"] == "285.7 GB/s"  # memory-bound


def test_cli_rollout_profile_roofline_on_cpu(tmp_path, capsys, refused):
    js = tmp_path / "p.json"
    argv = ["rollout", "--device", "cpu", "--preset", "tiny", "--frames", "1",
            "--warmup-frames", "0", "--profile", "--profile-frames", "1", "--no-progress",
            "--peak-tflops", "2", "--peak-gbps", "30", "--json", str(js)]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "x_floor" in out and "at custom peaks (2 TFLOP/s dense bf16, 30 GB/s)" in out
    prof = json.loads(js.read_text())["extra"]["profile"]
    roof = rr.roofline(rr.frame_ops(_tiny(), itemsize=4), rr.Peak("custom", 2.0, 30.0))
    assert prof["roofline"]["floor_ms"] == pytest.approx(roof.floor_ms)
    cats = {c["category"]: c for c in prof["categories"]}
    assert cats["attention"]["flops"] == roof.categories[1].flops
    gemm = cats["gemm"]
    assert math.isclose(gemm["x_floor"], gemm["ms_per_frame"] / gemm["floor_ms"])
    refused(["rollout", "--device", "cpu", "--peak-gbps", "30"], "--peak-gbps needs --profile")
    refused(["rollout", "--peak-tflops", "0"], "--peak-tflops")
