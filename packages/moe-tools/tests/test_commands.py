"""matrix / rollout / kernels / verify on tiny CPU sizes: the rows they return, what they mean."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from moe_tools import kernels, matrix, rollout, verify
from moe_tools.ops import REGISTRY
from moe_tools.tables import short_error


def test_diff_stats():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert matrix.diff_stats(a, a) == (0.0, 0.0)
    mx, mean = matrix.diff_stats(a, torch.tensor([1.0, 2.5, 2.0]))
    assert mx == 1.0 and mean == pytest.approx(0.5)
    assert matrix.diff_stats(a, a[:2]) == (math.inf, math.inf)
    assert matrix.diff_stats(a, torch.tensor([1.0, float("nan"), 3.0]))[0] == math.inf


def test_short_error_is_one_clipped_line():
    text = short_error(ValueError("first line\nsecond line"))
    assert text == "ValueError: first line"
    assert len(short_error(RuntimeError("x" * 500), limit=50)) == 50


def test_matrix_rows_on_tiny_preset():
    res = matrix.run(
        device="cpu",
        preset="tiny",
        tokens=16,
        impls=["baseline", "torch", "fbgemm", "nope"],
        warmup=1,
        iters=2,
        progress=False,
        compile=True,
        compile_backend="eager",
    )
    assert res.command == "matrix" and res.columns == matrix.COLUMNS
    rows = {r["impl"]: r for r in res.rows}
    assert list(rows) == ["baseline", "torch", "fbgemm", "nope"]
    for r in res.rows:
        assert set(r) == set(matrix.COLUMNS)
    base, tor = rows["baseline"], rows["torch"]
    # the baseline is the reference: no drift from itself, deterministic, not fullgraph-compilable
    assert base["vs_base_max"] == 0.0 and base["self_max"] == 0.0
    assert base["eager_ms"] > 0 and base["compiled_ms"] is None
    assert base["status"].startswith("expected: ")
    # torch impl: same weights, so only fp32 rounding separates it from the baseline
    assert tor["status"] == "ok", tor["status"]
    assert tor["self_max"] == 0.0
    assert 0.0 <= tor["vs_base_max"] < 1e-4 and tor["vs_base_mean"] <= tor["vs_base_max"]
    assert tor["eager_ms"] > 0 and tor["compiled_ms"] > 0
    assert tor["speedup"] == pytest.approx(tor["eager_ms"] / tor["compiled_ms"])
    assert tor["comp_vs_base_max"] < 1e-4 and tor["comp_vs_eager_max"] < 1e-4
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        assert rows["fbgemm"]["status"].startswith("unavailable: ")
        assert rows["fbgemm"]["eager_ms"] is None
    assert rows["nope"]["status"].startswith("unavailable: unknown impl")
    assert res.extra["layer"]["n_experts"] > 1 and res.extra["tokens"] == 16


def test_matrix_detects_a_drifting_impl(monkeypatch):
    """An implementation that is off by a constant shows up in vs_base, not in self."""
    from moe_model import MoELayer

    real = MoELayer.forward

    def shifted(self, x):
        y = real(self, x)
        return y + 0.5 if self.impl == "torch" else y

    monkeypatch.setattr(MoELayer, "forward", shifted)
    res = matrix.run(
        device="cpu",
        preset="tiny",
        tokens=8,
        impls=["baseline", "torch"],
        warmup=1,
        iters=1,
        progress=False,
        compile=False,
    )
    tor = res.rows[1]
    assert tor["vs_base_max"] == pytest.approx(0.5, abs=1e-4)
    assert tor["self_max"] == 0.0
    assert tor["compiled_ms"] is None


def test_matrix_on_an_moe_preset_with_small_overrides():
    """deepseek-v3's routing (sigmoid, expert bias, 8 groups / top-4, scale 2.5, renormalised,
    a shared expert) on a small layer: every impl sees the preset's options."""
    small = dict(d_model=32, hidden=16, n_experts=16)  # 8 groups of 2: top-8 of 4 groups
    res = matrix.run(
        device="cpu",
        preset="deepseek-v3",
        tokens=12,
        impls=["baseline", "torch", "triton_fp32", "fbgemm"],
        warmup=1,
        iters=1,
        progress=False,
        compile=False,
        layer_overrides=small,
    )
    layer = res.extra["layer"]
    assert res.extra["preset"] == "deepseek-v3" and res.extra["tokens"] == 12
    assert layer["n_experts"] == 16 and layer["d_model"] == 32 and layer["top_k"] == 8
    assert layer["n_groups"] == 8 and layer["topk_groups"] == 4 and layer["expert_bias"]
    assert layer["routed_scaling_factor"] == 2.5 and layer["n_shared_experts"] == 1
    rows = {r["impl"]: r for r in res.rows}
    for impl in ("torch", "triton_fp32"):
        assert rows[impl]["status"] == "ok", rows[impl]["status"]
        assert rows[impl]["self_max"] == 0.0 and rows[impl]["vs_base_max"] < 1e-4
    assert rows["fbgemm"]["status"].startswith("unavailable: ")  # not installed, or the options


def test_matrix_builds_presets_on_the_device_in_the_dtype():
    """The full deepseek-v3 layer on the meta device: bf16 expert weights straight away (no fp32
    host copy), the router fp32; tiny's world-model layer keeps its sizes."""
    sizes = matrix.layer_sizes("deepseek-v3")
    assert sizes["n_experts"] == 256 and sizes["hidden"] == 2048
    layer = matrix.build_layer(sizes, torch.device("meta"), torch.bfloat16, seed=0)
    assert layer.in_proj.device.type == "meta" and layer.in_proj.dtype == torch.bfloat16
    assert layer.shared_experts.in_proj.dtype == torch.bfloat16
    assert layer.router.weight.dtype == torch.float32 and not layer.training
    assert layer.route_options()["n_groups"] == 8 and layer.expert_bias is not None
    tiny = matrix.build_layer(matrix.layer_sizes("tiny", top_k=1), "cpu", torch.bfloat16, seed=3)
    again = matrix.build_layer(matrix.layer_sizes("tiny", top_k=1), "cpu", torch.bfloat16, seed=3)
    assert tiny.top_k == 1 and tiny.in_proj.dtype == torch.bfloat16
    assert all(
        torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters(), strict=True)
    )


def test_rollout_row_on_tiny_preset():
    from moe_model import WorldModelConfig, count_parameters

    res = rollout.run(device="cpu", preset="tiny", frames=3, warmup_frames=1, progress=False)
    (row,) = res.rows
    assert row["status"] == "ok", row["status"]
    assert set(row) == set(rollout.COLUMNS)
    assert row["frames"] == 3 and len(res.extra["frame_ms"]) == 3
    assert row["fps"] > 0 and row["frame_ms_median"] > 0
    assert row["frame_ms_p99"] >= row["frame_ms_median"]
    # fps is measured over the whole rollout: at most what the per-frame times allow
    assert row["fps"] <= 1e3 / min(res.extra["frame_ms"]) * 1.01
    total, active = count_parameters(WorldModelConfig.from_preset("tiny"))
    assert (row["params"], row["active_params"]) == (total, active)
    assert active < total
    assert row["peak_alloc_gib"] is None and row["vram_last_gib"] is None  # CPU: no allocator
    assert row["impl"] == WorldModelConfig.from_preset("tiny").moe_impl


def test_rollout_leaves_cuda_graphs_to_the_engine(monkeypatch):
    built = []

    def spy(preset, **kw):
        built.append(kw["cuda_graph"])
        return build(preset, **kw)

    build = rollout.build_engine
    monkeypatch.setattr(rollout, "build_engine", spy)
    res = rollout.run(device="cpu", preset="tiny", frames=1, warmup_frames=0, progress=False)
    assert built == [None]  # passed through: the engine's default applies
    (row,) = res.rows
    assert row["status"] == "ok" and row["cuda_graph"] is False  # what the engine did (CPU)
    assert res.extra["title"].endswith("cuda_graph=False") and "profile" not in res.extra
    assert res.text is None


def test_rollout_unavailable_rows():
    res = rollout.run(device="cpu", preset="tiny", frames=1, cuda_graph=True, progress=False)
    assert res.rows[0]["status"].startswith("unavailable: --cuda-graph needs")
    res = rollout.run(device="cpu", preset="tiny", frames=1, impl="nope", progress=False)
    assert res.rows[0]["status"].startswith("unavailable: ")
    assert res.rows[0]["fps"] is None


def test_kernels_rows_on_cpu():
    ops = ["route", "to_blocked_per_group_3d", "to_mxfp8", "gather_grouped_mm"]
    res = kernels.run(device="cpu", ops=ops, progress=False)
    assert res.extra["quick"] is True and res.extra["path"] == "reference"
    assert res.extra["ceiling_gbps"] is None  # no copy ceiling on a CPU: nothing to compare
    assert res.extra["notes"][0] == kernels.CPU_NOTE
    want = [name for name, spec in REGISTRY.items() if name in ops for _ in spec.sizes["quick"]]
    assert [r["op"] for r in res.rows] == want  # registry order
    for r in res.rows:
        assert set(r) == set(kernels.COLUMNS) and r["status"] == "ok", r
        assert r["us"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
        assert r["pct_ceiling"] is None and r["clone_us"] is None and r["graph_us"] is None
        if REGISTRY[r["op"]].native is None:
            assert r["torch_us"] is None and r["speedup"] is None  # vs nothing
        else:
            assert r["speedup"] == pytest.approx(r["torch_us"] / r["us"])
        assert (r["tflops"] is not None) == (r["op"] == "gather_grouped_mm")
    header = res.text.splitlines()[0].split()
    assert "pct_ceiling" not in header and "fbgemm_us" not in header  # empty columns drop out


def test_kernels_full_shapes_are_the_published_sizes():
    full = {name: spec.sizes["full"] for name, spec in REGISTRY.items()}
    assert dict(T=1048576, E=128, k=8) in full["route"] and dict(T=4096, E=16, k=8) in full["route"]
    assert full["combine"] == [dict(T=65536, k=8, D=2048)]
    assert dict(R=524288, C=256, G=8) in full["to_blocked_per_group_2d"]
    assert dict(E=16, N=4096, C=64) in full["to_blocked_per_group_3d"]
    assert full["to_mxfp8"] == [dict(M=16384, K=8192), dict(M=131072, K=2048)]


def test_kernels_missing_op_is_an_unavailable_row(monkeypatch):
    import moe_kernels

    def boom(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(moe_kernels, "to_mxfp8", boom)
    res = kernels.run(device="cpu", ops=["to_mxfp8"], progress=False)
    assert res.rows and all(
        r["status"] == "unavailable: RuntimeError: no kernel here" for r in res.rows
    )
    with pytest.raises(ValueError, match="unknown ops"):
        kernels.run(device="cpu", ops=["nope"], progress=False)


def test_kernels_peer_failures_are_notes_not_rows(monkeypatch):
    spec = REGISTRY["dispatch"]

    def broken(problem):
        raise RuntimeError("peer broke")

    monkeypatch.setitem(REGISTRY, "dispatch", type(spec)(**{**spec.__dict__, "native": broken}))
    res = kernels.run(device="cpu", ops=["dispatch"], progress=False)
    assert res.rows[0]["status"] == "ok" and res.rows[0]["torch_us"] is None
    assert any("torch: RuntimeError: peer broke" in n for n in res.extra["notes"])

    def not_installed(problem):
        raise ModuleNotFoundError("No module named 'fbgemm_gpu'")

    missing: dict[str, str] = {}
    patched = type(spec)(**{**spec.__dict__, "native": not_installed})
    problem = spec.make(
        spec.sizes["quick"][0], torch.Generator().manual_seed(0), torch.device("cpu")
    )
    for _ in range(2):  # a peer that does not import: recorded once, then skipped
        row, skipped = kernels.measure(patched, problem, torch.device("cpu"), None, missing)
        assert row["status"] == "ok" and skipped == []
    assert missing == {"torch": "ModuleNotFoundError: No module named 'fbgemm_gpu'"}


def test_verify_passes_on_the_reference_path():
    res = verify.run(device="cpu", shapes=1, ops=list(verify.CHECKS), progress=False)
    bad = [r for r in res.rows if r["status"] != "pass" and not r["status"].startswith("unavail")]
    assert not bad, bad
    assert res.extra["failed"] == 0 and res.extra["path"] == "reference"
    checks = [r["check"] for r in res.rows]
    assert checks[: len(REGISTRY)] == list(REGISTRY)  # every op, by its public name
    assert any(c.startswith("moe:") for c in checks)
    for r in res.rows[: len(REGISTRY)]:
        assert r["vs_reference"] is None and r["vs_oracle"] is not None  # CPU: the oracle checks


def test_verify_catches_a_wrong_kernel(monkeypatch):
    import moe_kernels

    real = moe_kernels.route

    def wrong(scores, top_k, **kw):
        plan = real(scores, top_k, **kw)
        return plan._replace(weights=plan.weights * 1.001)

    monkeypatch.setattr(moe_kernels, "route", wrong)
    res = verify.run(device="cpu", shapes=2, ops=["route"], progress=False)
    assert res.extra["failed"] == 2
    assert all(r["status"].startswith("FAIL: oracle weights") for r in res.rows)
    assert all(r["shape"].startswith("T=") for r in res.rows)


def test_verify_catches_nondeterminism(monkeypatch):
    import moe_kernels

    real, calls = moe_kernels.to_blocked_per_group_3d, []

    def flaky(s):
        calls.append(1)
        out = real(s).clone()
        if len(calls) % 2 == 0:
            out.view(torch.uint8)[..., -1] ^= 1
        return out

    monkeypatch.setattr(moe_kernels, "to_blocked_per_group_3d", flaky)
    res = verify.run(device="cpu", shapes=1, ops=["to_blocked_per_group_3d"], progress=False)
    assert res.rows[0]["deterministic"] is False
    assert res.rows[0]["status"] == "FAIL: not deterministic"


def test_verify_compares_with_the_reference_where_the_kernels_run(monkeypatch):
    """Off the reference path (CUDA, the interpreter) vs_reference is measured and checked."""
    import moe_kernels

    monkeypatch.setattr(verify, "execution_path", lambda device: "interpreter")
    res = verify.run(device="cpu", shapes=1, ops=["combine"], progress=False)
    assert res.rows[0]["vs_reference"] == 0.0 and res.rows[0]["status"] == "pass"
    real = moe_kernels.combine
    monkeypatch.setattr(moe_kernels, "combine", lambda y, plan, **kw: real(y, plan, **kw) * 1.1)
    res = verify.run(device="cpu", shapes=1, ops=["combine"], progress=False)
    assert res.rows[0]["status"].startswith("FAIL: output 0 vs reference")


def test_verify_holds_chained_roundings_to_their_bound_in_the_interpreter(monkeypatch):
    """expert_mlp's reference comparison in the interpreter: within twice its oracle's rounding
    bound (its truncated bf16 intermediates). That worst-case bound lets a 2% error through at
    bf16 (one step is 0.8%, carried through the down-projection's terms), not at fp32; 25%
    fails every row."""
    import moe_kernels

    monkeypatch.setattr(verify, "execution_path", lambda device: "interpreter")
    res = verify.run(device="cpu", shapes=6, ops=["expert_mlp"], progress=False)
    assert res.extra["failed"] == 0 and all(r["vs_reference"] is not None for r in res.rows)
    real = moe_kernels.expert_mlp
    for factor, dtypes in ((1.02, ("float32",)), (1.25, ("float32", "bfloat16"))):
        monkeypatch.setattr(
            moe_kernels, "expert_mlp", lambda *a, f=factor, **kw: real(*a, **kw) * f
        )
        res = verify.run(device="cpu", shapes=6, ops=["expert_mlp"], progress=False)
        caught = [r["status"].startswith("FAIL: output 0 vs reference") for r in res.rows]
        assert caught == [r["shape"].endswith(dtypes) for r in res.rows], factor


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_verify_passes_with_the_kernels_in_the_interpreter():
    """``TRITON_INTERPRET=1 moe-bench verify --device cpu``, as its footer suggests: exit 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "moe_tools.cli", "verify", "--device", "cpu", "--no-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in run.stdout and " 0 failed" in run.stdout
