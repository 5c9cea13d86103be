"""matrix / rollout / kernels / verify on tiny CPU sizes: the rows they return, what they mean."""

from __future__ import annotations

import math

import pytest
import torch

from moe_tools import kernels, matrix, report, rollout, verify


def test_diff_stats():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert matrix.diff_stats(a, a) == (0.0, 0.0)
    mx, mean = matrix.diff_stats(a, torch.tensor([1.0, 2.5, 2.0]))
    assert mx == 1.0 and mean == pytest.approx(0.5)
    assert matrix.diff_stats(a, a[:2]) == (math.inf, math.inf)
    assert matrix.diff_stats(a, torch.tensor([1.0, float("nan"), 3.0]))[0] == math.inf


def test_short_error_is_one_clipped_line():
    text = report.short_error(ValueError("first line\nsecond line"))
    assert text == "ValueError: first line"
    assert len(report.short_error(RuntimeError("x" * 500), limit=50)) == 50


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
    res = kernels.run(device="cpu", ops=["route", "blocked_3d", "to_mxfp8"], progress=False)
    assert res.extra["quick"] is True and res.extra["ceiling_gbps"] > 0
    ops = {r["op"] for r in res.rows}
    assert ops == {"route", "blocked_3d", "to_mxfp8"}
    by = {(r["op"], r["shape"], r["impl"]): r for r in res.rows}
    for (op, shape, _), r in by.items():
        assert r["status"] == "ok", r
        assert r["us"] > 0
        assert r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
        assert r["pct_ceiling"] == pytest.approx(100 * r["gbps"] / res.extra["ceiling_gbps"])
        if op != "to_mxfp8":
            native = by[(op, shape, "torch")]["us"]
            assert r["speedup"] == pytest.approx(native / r["us"])
        else:
            assert r["speedup"] is None and (op, shape, "torch") not in by  # vs clone only
        clone = by[(op, shape, "clone")]["us"]
        assert r["vs_clone"] == pytest.approx(clone / r["us"])
    impls = {(r["op"], r["impl"]) for r in res.rows}
    assert ("route", "moe_kernels") in impls and ("to_mxfp8", "moe_kernels") in impls
    shapes = {r["shape"] for r in res.rows if r["op"] == "route"}
    assert len(shapes) == len(kernels.shapes(True)["route"])


def test_kernels_full_shapes_are_the_issue_sizes():
    full = kernels.shapes(False)
    assert (1048576, 128, 8) in full["route"] and (4096, 16, 8) in full["route"]
    assert full["tokens"] == [(65536, 8, 2048)]
    assert (524288, 256, 8) in full["blocked_2d"] and (16, 4096, 64) in full["blocked_3d"]
    assert full["quant"] == [(16384, 8192), (131072, 2048)]


def test_kernels_missing_op_is_an_unavailable_row(monkeypatch):
    import moe_kernels.mxfp8 as M

    def boom(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(M, "to_mxfp8", boom)
    res = kernels.run(device="cpu", ops=["to_mxfp8"], progress=False)
    ours = [r for r in res.rows if r["impl"] == "moe_kernels"]
    assert ours and all(r["status"] == "unavailable: RuntimeError: no kernel here" for r in ours)
    with pytest.raises(ValueError, match="unknown ops"):
        kernels.run(device="cpu", ops=["nope"], progress=False)


def test_group_ends_are_distinct_multiples_of_32():
    ends = kernels._group_ends(16640, 16, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert ends.dtype == torch.int32 and ends.shape == (16,)
    assert int(ends[-1]) == 16640 and bool((ends % 32 == 0).all())
    assert bool((ends[1:] > ends[:-1]).all()) and int(ends[0]) > 0


def test_verify_passes_on_the_reference_path():
    res = verify.run(device="cpu", shapes=1, ops=list(verify.CHECKS), progress=False)
    bad = [r for r in res.rows if r["status"] != "pass" and not r["status"].startswith("unavail")]
    assert not bad, bad
    assert res.extra["failed"] == 0
    checks = {r["check"] for r in res.rows}
    assert set(verify.KERNEL_CHECKS) <= checks
    assert any(c.startswith("moe:") for c in checks)


def test_verify_catches_a_wrong_kernel(monkeypatch):
    import moe_kernels.routing as R

    real = R.route

    def wrong(scores, top_k, **kw):
        plan = real(scores, top_k, **kw)
        return plan._replace(weights=plan.weights * 1.001)

    monkeypatch.setattr(R, "route", wrong)
    res = verify.run(device="cpu", shapes=2, ops=["route"], progress=False)
    assert res.extra["failed"] == 2
    assert all(r["status"].startswith("FAIL: weights") for r in res.rows)
    assert all(r["shape"].startswith("T=") for r in res.rows)


def test_verify_catches_nondeterminism(monkeypatch):
    import moe_kernels.mxfp8 as M

    real, calls = M.to_blocked_per_group_3d, []

    def flaky(s):
        calls.append(1)
        out = real(s).clone()
        if len(calls) % 2 == 0:
            out.view(torch.uint8)[..., -1] ^= 1
        return out

    monkeypatch.setattr(M, "to_blocked_per_group_3d", flaky)
    res = verify.run(device="cpu", shapes=1, ops=["blocked_3d"], progress=False)
    assert res.rows[0]["deterministic"] is False
    assert res.rows[0]["status"] == "FAIL: not deterministic"


def test_expect_equal():
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert verify.expect_equal("x", a, a.clone()) == 0.0
    with pytest.raises(verify.CheckFailed, match="1 of 3 differ"):
        verify.expect_equal("x", a, torch.tensor([1.0, 2.5, float("nan")]))
    with pytest.raises(verify.CheckFailed, match="NaN"):
        verify.expect_equal("x", a, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(verify.CheckFailed, match="shape"):
        verify.expect_equal("x", a, a[:2])
    assert verify.expect_equal("x", torch.tensor([1.0]), torch.tensor([1.005]), rel=0.01) > 0


def test_oracle_blocked_layout_by_hand():
    s = torch.arange(130 * 5, dtype=torch.int32).remainder(251).to(torch.uint8).view(130, 5)
    out = verify.oracle_blocked(s).flatten()
    assert out.shape == (256 * 8,)
    assert int(out[0]) == int(s[0, 0])
    assert int(out[1]) == int(s[0, 1])  # columns inside a tile are adjacent
    assert int(out[4]) == int(s[32, 0])  # row 32 is the second 32-row slab: offset 4
    assert int(out[16]) == int(s[1, 0])  # row 1: offset 16
    assert int(out[512]) == int(s[0, 4])  # second column tile of the first row tile
    assert int(out[2 * 512]) == int(s[128, 0])  # first tile of the second row tile
    assert int(out[512 + 1]) == 0  # padding column 5 of row 0


def test_oracle_mxfp8_scale():
    x = torch.zeros(4, 32)
    x[0, 3], x[1, 0], x[2, 5] = 448.0, -449.0, 1.0
    assert verify.oracle_mxfp8_scale(x).tolist() == [[127], [128], [119], [0]]


def test_every_kernel_case_runs_and_matches_its_torch_version():
    """The benchmark harness itself: every op has a case, and where a torch-native version is
    timed beside ours it computes the same thing (so the speedup compares like with like)."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for case in kernels.all_cases(torch.device("cpu"), True, gen):
        seen.add(case.op)
        assert case.nbytes > 0 and not case.unavailable, (case.op, case.unavailable)
        ours = case.impls["moe_kernels"]()
        native = case.impls["torch"]() if "torch" in case.impls else None
        if case.op in ("route", "index_shuffling"):
            counts = ours[0] if case.op == "index_shuffling" else ours.counts
            E = native[0].numel()
            # same pairs up to ties between equal bf16 scores (topk breaks those its own way)
            assert int(counts[:E].sum()) == int(native[0].sum())
            assert int((counts[:E].long() - native[0]).abs().sum()) <= 0.02 * int(native[0].sum())
        elif case.op in ("dispatch", "blocked_3d", "from_mxfp8"):
            assert torch.equal(verify._bits(ours), verify._bits(native))  # bitwise (NaN scales)
        elif case.op == "blocked_2d":
            used = int(ours[1][-1])
            assert torch.equal(ours[0][:used].view(torch.uint8), native[0][:used].view(torch.uint8))
        elif case.op in ("gather_scale", "combine"):
            torch.testing.assert_close(ours.float(), native.float(), rtol=1e-2, atol=1e-2)
    assert seen == set(kernels.OPS)
