"""``moe-bench decode``: the bytes a forward must read, counted by hand; rows of a CPU run and
their arithmetic; the plot; bad arguments."""

from __future__ import annotations

import pytest
import torch

from moe_model import MoELayer
from moe_tools import cli
from moe_tools.decode import decode_bytes


def test_decode_bytes_by_hand():
    """d 8, 4 gated experts of hidden 6 (in 12 x 8, out 8 x 6), one shared expert (the same
    shapes), fp32: two experts touched, 5 tokens."""
    layer = MoELayer(8, 4, 2, 6, gated=True, n_shared_experts=1, dtype=torch.float32)
    counts = torch.tensor([0, 3, 0, 1], dtype=torch.int32)
    expert = (12 * 8 + 8 * 6) * 4
    router = 4 * 8 * 4
    shared = (12 * 8 + 8 * 6) * 4
    io = 2 * 5 * 8 * 4
    assert decode_bytes(layer, counts, 5) == 2 * expert + router + shared + io
    # the fp8 impl reads its FP8 experts: a byte a weight, an fp32 scale per output channel
    layer.impl = "fp8"
    fp8_expert = 12 * 8 + 8 * 6 + (12 + 8) * 4
    assert decode_bytes(layer, counts, 5) == 2 * fp8_expert + router + shared + io


def test_cpu_rows(capsys):
    out = cli.main(["decode", "--device", "cpu", "--tokens", "1,8", "--impls", "torch,triton_fp32",
                    "--peak-gbps", "100", "--no-progress"])  # fmt: skip
    assert out == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.startswith("tiny ")]
    assert [(r[1], r[2]) for r in rows] == [
        ("1", "torch"), ("1", "triton_fp32"), ("8", "torch"), ("8", "triton_fp32")
    ]  # fmt: skip
    for _, tokens, _, ms, touched, read_mb, gbps, pct, status in rows:
        assert status == "ok"
        # tiny: 4 experts, top-2; at most the pairs' experts are touched
        assert 1 <= int(touched) <= min(4, 2 * int(tokens))
        assert float(gbps) == pytest.approx(float(read_mb) / float(ms), rel=0.02)
        assert float(pct) == pytest.approx(float(gbps), rel=0.02)  # of 100 GB/s


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    out = cli.main(["decode", "--device", "cpu", "--tokens", "1,2", "--impls", "torch",
                    "--plot", str(png), "--no-progress"])  # fmt: skip
    assert out == 0 and png.stat().st_size > 0


@pytest.mark.parametrize(
    "argv",
    [["--presets", "nope"], ["--tokens", "0"], ["--impls", "fast"], ["--peak-gbps", "-1"]],
    ids=str,
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["decode", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err
