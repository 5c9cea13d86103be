"""`moe-bench` parsing, printing, JSON/plot files and exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from moe_tools import cli, matrix, report
from moe_tools.report import Result


def test_parser_defaults_and_errors(capsys):
    p = cli.build_parser()
    args = p.parse_args(["matrix", "--impls", "torch, triton_bf16", "--tokens", "32"])
    assert args.impls == ["torch", "triton_bf16"] and args.tokens == 32
    assert isinstance(args.device, torch.device)
    assert p.parse_args(["rollout", "--compile", "--cuda-graph"]).cuda_graph is True
    rollout = p.parse_args(["rollout", "--compile"])  # the engine decides: graphs on CUDA
    assert rollout.cuda_graph is None and rollout.profile is False
    assert rollout.profile_frames is None
    assert p.parse_args(["rollout", "--compile", "--no-cuda-graph"]).cuda_graph is False
    args = p.parse_args(["rollout", "--profile", "--profile-frames", "3"])
    assert args.profile is True and args.profile_frames == 3
    assert p.parse_args(["kernels", "--quick"]).quick is True
    assert p.parse_args(["verify", "--device", "cpu"]).device == torch.device("cpu")
    for bad in (
        [],
        ["nope"],
        ["matrix", "--tokens", "0"],
        ["matrix", "--tokens", "x"],
        ["matrix", "--preset", "huge"],
        ["matrix", "--impls", ","],
        ["kernels", "--device", "tpu"],
        ["report"],  # --results is required
        ["rollout", "--cuda-graph", "--no-cuda-graph"],
        ["rollout", "--profile-frames", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(bad)
        assert exc.value.code == 2, bad
    capsys.readouterr()


def test_matrix_takes_the_moe_presets():
    from moe_model import MOE_PRESETS

    assert tuple(MOE_PRESETS) == cli.MOE_PRESETS
    p = cli.build_parser()
    for name in MOE_PRESETS:
        assert p.parse_args(["matrix", "--preset", name]).preset == name


def test_profile_frames_need_profile(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["rollout", "--device", "cpu", "--profile-frames", "2"])
    assert exc.value.code == 2
    assert "--profile-frames needs --profile" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert "moe-bench 0.1.0" in capsys.readouterr().out


def test_matrix_prints_header_and_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "m.json"
    argv = [
        "matrix",
        "--device",
        "cpu",
        "--impls",
        "baseline,torch",
        "--tokens",
        "8",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--no-compile",
        "--no-progress",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("# torch") and any(line.startswith("# device") for line in lines)
    head = next(line for line in lines if line.startswith("impl "))
    assert head.split() == matrix.COLUMNS
    doc = json.loads(out.read_text())
    assert doc["schema"] == report.SCHEMA and doc["command"] == "matrix"
    assert doc["cmdline"].startswith("moe-bench matrix --device cpu")
    assert [r["impl"] for r in doc["rows"]] == ["baseline", "torch"]
    assert doc["env"]["torch"] == torch.__version__
    assert doc["args"]["device"] == "cpu" and doc["args"]["tokens"] == 8
    assert doc["extra"]["tokens"] == 8


def test_rollout_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    argv = [
        "rollout",
        "--device",
        "cpu",
        "--frames",
        "2",
        "--warmup-frames",
        "0",
        "--no-progress",
        "--plot",
        str(png),
        "--json",
        str(js),
    ]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(js.read_text())
    assert len(doc["extra"]["frame_ms"]) == 2 and doc["rows"][0]["status"] == "ok"
    assert "fps" in capsys.readouterr().out


def test_kernels_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "k.png"
    argv = [
        "kernels",
        "--device",
        "cpu",
        "--ops",
        "blocked_3d",
        "--no-progress",
        "--plot",
        str(png),
    ]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "copy ceiling" in capsys.readouterr().out


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, tmp_path):
    def missing() -> None:
        raise RuntimeError("--plot needs matplotlib: pip install 'moe-tools[plot]'")

    ran = []
    monkeypatch.setattr(report, "require_matplotlib", missing)
    monkeypatch.setattr(cli, "_run", lambda args: ran.append(1))
    with pytest.raises(RuntimeError, match="moe-tools"):
        cli.main(["kernels", "--device", "cpu", "--plot", str(tmp_path / "k.png")])
    assert not ran


@pytest.mark.parametrize(("failed", "code"), [(0, 0), (2, 1)])
def test_verify_exit_code(monkeypatch, capsys, failed, code):
    from moe_tools import verify

    rows = [{"check": "route", "status": "pass"}] + [
        {"check": "x", "status": "FAIL: boom"} for _ in range(failed)
    ]
    monkeypatch.setattr(
        verify, "run", lambda **kw: Result("verify", rows, ["check", "status"], {"failed": failed})
    )
    assert cli.main(["verify", "--device", "cpu", "--no-progress"]) == code
    captured = capsys.readouterr()
    assert "route" in captured.out
    assert ("FAILED" in captured.err) == bool(failed)


def test_verify_real_run_exits_zero(capsys):
    assert (
        cli.main(
            [
                "verify",
                "--device",
                "cpu",
                "--ops",
                "blocked_3d,dispatch",
                "--shapes",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "pass" in capsys.readouterr().out


def test_report_command(tmp_path, capsys):
    res_dir = tmp_path / "results" / "box-2026-11-29"
    doc = report.make_document(
        "rollout",
        [{"fps": 100.0}],
        report.environment("cpu"),
        cmdline="moe-bench rollout --preset seed-moe",
    )
    report.write_json(res_dir / "rollout.json", doc)
    out = tmp_path / "BENCHMARKS.md"
    assert cli.main(["report", "--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    md = out.read_text()
    assert "moe-bench rollout --preset seed-moe" in md and "| 100.0 |" in md
    assert "box-2026-11-29/rollout.json" in md


def test_rollout_modes_on_one_engine(capsys):
    """--modes measures each runtime on one engine: a row each, in order."""
    cli.main(["rollout", "--device", "cpu", "--preset", "tiny", "--frames", "2",
              "--warmup-frames", "1", "--modes", "eager,compile", "--no-images",
              "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny ")]
    assert [r.split()[2] for r in rows] == ["eager", "compile"]
    assert all(" ok" in r for r in rows)


@pytest.mark.parametrize(
    "argv",
    [
        ["rollout", "--modes", "fast"],
        ["rollout", "--modes", "compile", "--compile"],
        ["rollout", "--modes", "graph", "--no-cuda-graph"],
    ],
)
def test_rollout_modes_bad_arguments(argv):
    with pytest.raises(SystemExit):
        cli.main(argv)
