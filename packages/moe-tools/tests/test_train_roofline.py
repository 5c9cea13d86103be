"""`moe-bench train --roofline` on CPU: the experts' FLOP count, the six grouped GEMMs against
per-expert matmuls, and the roofline columns of a tiny run."""

from __future__ import annotations

import pytest
import torch

from moe_tools import cli
from moe_tools.train import command as train_command
from moe_tools.train import measure
from moe_tools.train import roofline as train_roofline
from moe_tools.train import sweep as train_sweep


def test_expert_flops_reproduce_the_issue_table():
    """The Qwen3-30B-A3B layer at 8192 tokens (SwiGLU): 5.389 ms is 344 TFLOP/s."""
    cfg = dict(tokens=8192, d_model=2048, hidden=768, n_experts=128, top_k=8, gated=True)
    assert train_roofline.tflops(train_roofline.expert_flops(cfg), 5.389) == pytest.approx(
        344.3, abs=0.1
    )
    plain = dict(cfg, gated=False)  # SiLU: up-projection n wide, not 2n
    assert train_roofline.expert_flops(plain) == 6 * 8192 * 8 * 2048 * (768 + 768)


@pytest.mark.parametrize("gated", [False, True])
def test_six_gemms_are_the_layers_per_expert_products(gated):
    cfg = dict(tokens=12, d_model=16, hidden=8, n_experts=3, top_k=2, gated=gated)
    counts = torch.tensor([5, 0, 19])  # an empty group included
    g = train_roofline.six_gemms(counts, cfg, torch.device("cpu"), torch.float32)
    out = g.run()
    bounds = [0, 5, 5, 24]
    n_up = 16 if gated else 8
    assert [tuple(t.shape) for t in out] == [
        (24, n_up), (24, 16), (24, 8), (24, 16), (3, 8, 16), (3, 16, n_up)
    ]  # fmt: skip
    for e in range(3):
        r = slice(bounds[e], bounds[e + 1])
        want = (
            g.x_PD[r] @ g.w_up[e],
            g.a_Pn[r] @ g.w_down[e],
            g.dy_PD[r] @ g.w_down[e].T,
            g.dh_PN[r] @ g.w_up[e].T,
            g.a_Pn[r].T @ g.dy_PD[r],
            g.x_PD[r].T @ g.dh_PN[r],
        )
        for got, ref in zip(out, want, strict=True):
            part = got[e] if got.dim() == 3 else got[r]
            torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)


def test_roofline_columns_on_cpu(tmp_path):
    res = measure.run(
        device="cpu", impls=["baseline", "torch"], steps=0, warmup=1, iters=1, roofline=True,
        progress=False,
    )  # fmt: skip
    roof = res.extra["roofline"]
    # tiny: 64 tokens x top 2 = 128 rows, width 64, hidden 32, no gate. Each of the six GEMMs
    # (up and down, forward; their input and weight gradients) is a 128 x 64 x 32 product.
    assert roof["six_gemms_ms"] > 0 and roof["expert_flops"] == 6 * 2 * 128 * 64 * 32
    rows = {r["impl"]: r for r in res.rows}
    assert rows["baseline"]["fb_best_ms"] is None  # the reference is not timed
    row = rows["torch"]
    assert row["roofline_status"] == "ok", row
    assert row["fb_best_ms"] == min(row["fb_eager_ms"], row["fb_compiled_ms"])
    assert row["vs_gemms"] == pytest.approx(row["fb_best_ms"] / roof["six_gemms_ms"])
    assert row["tflops"] == pytest.approx(roof["expert_flops"] / row["fb_best_ms"] / 1e9)
    assert row["fb_graph_ms"] is None and row["fb_peak_gib"] is None  # CPU: no graph, no peak
    assert any("vs_gemms" in n for n in res.extra["notes"])


def test_roofline_flags():
    p = cli.build_parser()
    assert p.parse_args(["train"]).roofline is None
    assert p.parse_args(["train", "--roofline"]).roofline is True
    assert p.parse_args(["train", "--no-roofline"]).roofline is False
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--roofline", "--no-roofline"])


def test_sweep_points_one_axis_at_a_time():
    center = dict(tokens=8, d_model=16, n_experts=4, top_k=2, hidden=8)
    got = list(train_sweep.points(center, {"tokens": (4, 8, 16), "top_k": (1, 2)}))
    assert got == [
        ("center", center),
        ("tokens", dict(center, tokens=4)),
        ("tokens", dict(center, tokens=16)),
        ("top_k", dict(center, top_k=1)),
    ]
    assert set(train_sweep.GRID) <= set(train_sweep.CENTER)


def test_sweep_rows_and_report(tmp_path):
    from moe_tools.train import report as train_report

    center = dict(tokens=16, d_model=16, n_experts=4, top_k=2, hidden=8)
    res = train_sweep.run(
        device=torch.device("cpu"), dtype=torch.float32, impls=["torch", "nope"],
        modes=("eager",), warmup=1, iters=1, center=center,
        grid={"top_k": (1, 2), "n_experts": (4, 1 << 40)},
    )  # fmt: skip
    rows = res.rows
    assert [(r["axis"], r["impl"]) for r in rows] == [
        ("center", "torch"), ("center", "nope"), ("top_k", "torch"), ("top_k", "nope"),
        ("n_experts", "torch"), ("n_experts", "nope"),
    ]  # fmt: skip
    ok = [r for r in rows[:4] if r["impl"] == "torch"]
    assert all(r["status"] == "ok" and r["vs_gemms"] > 0 and r["tflops"] > 0 for r in ok)
    assert all(r["fb_best_ms"] / r["six_gemms_ms"] == pytest.approx(r["vs_gemms"]) for r in ok)
    assert all(r["status"].startswith("FAIL") for r in rows[:4] if r["impl"] == "nope")
    assert all(r["status"].startswith("skipped") for r in rows[4:])  # 2**40 experts: refused
    doc = {"rows": rows, "columns": res.columns, "extra": res.extra}
    md = train_report.markdown(doc, tmp_path / "train.json")
    assert "vs_gemms" in md and "one axis at a time" in md


def test_sweep_flag():
    args = cli.build_parser().parse_args(["train", "--sweep", "--hidden", "512"])
    assert args.sweep and args.hidden == 512


def test_sweep_axes():
    from moe_tools import command

    args = cli.build_parser().parse_args(["train", "--sweep", "--sweep-axes", "top_k,hidden"])
    assert args.sweep_axes == ["top_k", "hidden"]
    args.device = torch.device("cpu")
    assert train_command.result_name(args) == "train-tiny-sweep+top_k+hidden"  # its own saved file
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--sweep", "--sweep-axes", "width"])
    args = cli.build_parser().parse_args(["train", "--sweep-axes", "top_k"])
    with pytest.raises(command.UsageError, match="--sweep-axes needs --sweep"):
        train_command.run_cli(args)


def test_sweep_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        dict(axis=axis, tokens=t, hidden=8, n_experts=4, top_k=2, impl=impl, vs_gemms=v)
        for axis, t, v in (("center", 16, 1.5), ("tokens", 8, 1.9), ("tokens", 32, 1.2))
        for impl in ("torch", "triton_bf16")
    ]
    train_sweep.plot(rows, str(tmp_path / "sweep.png"), title="t")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
