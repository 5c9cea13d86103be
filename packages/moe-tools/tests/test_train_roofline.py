"""`moe-bench train --roofline` on CPU: the experts' FLOP count, the six grouped GEMMs against
per-expert matmuls, and the roofline columns of a tiny run."""

from __future__ import annotations

import pytest
import torch

from moe_tools import cli, train, train_roofline


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
    res = train.run(
        device="cpu", impls=["baseline", "torch"], steps=0, warmup=1, iters=1, roofline=True,
        progress=False,
    )  # fmt: skip
    roof = res.extra["roofline"]
    assert roof["six_gemms_ms"] > 0 and roof["expert_flops"] == train_roofline.expert_flops(
        dict(train.PRESETS["tiny"], gated=False)
    )
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
