"""`moe-bench` as a user meets it: parsing, one-line errors with exit status 2 (never a
traceback), printing, JSON files, saved results, plots and exit codes."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moe_tools import cli, matrix, memory, tables, verify
from moe_tools.commands import MEASURING
from moe_tools.env import machine_slug
from moe_tools.results import SCHEMA, Result


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], ["COMMAND"]),
        (["nope"], ["nope"]),
        (["matrix", "--tokens", "0"], ["--tokens", "positive"]),
        (["matrix", "--tokens", "x"], ["--tokens", "'x'"]),
        (["matrix", "--preset", "huge"], ["--preset", "huge", "deepseek-v3"]),
        (["matrix", "--impls", ","], ["--impls"]),
        (["matrix", "--impls", "torch,foo"], ["--impls", "'foo'", "triton_bf16"]),
        (["train", "--impls", "foo"], ["--impls", "'foo'"]),
        (["kernels", "--device", "tpu"], ["--device", "tpu"]),
        (["kernels", "--ops", "route,nope"], ["--ops", "'nope'", "qk_norm_rope"]),
        (
            ["verify", "--ops", "gather_scale"],
            ["--ops", "gather_scale", "gather_scale_dense_tokens"],
        ),
        (["rollout", "--modes", "fast"], ["--modes", "'fast'", "graph"]),
        (["rollout", "--impl", "nope"], ["--impl", "nope"]),
        (["rollout", "--cuda-graph", "--no-cuda-graph"], ["--no-cuda-graph"]),
        (["rollout", "--profile-frames", "0"], ["--profile-frames"]),
        (["ep", "--shapes", "huge"], ["--shapes", "huge"]),
        (["kernels", "--sweep", "routing", "--sweep-dtypes", "fp16"], ["--sweep-dtypes", "fp16"]),
        (["kernels", "--json", f"{__file__}/k.json"], ["--json", "cannot write"]),
    ],
)
def test_bad_arguments_are_one_line_errors(refused, argv, words):
    refused(argv, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(refused):
    refused(["verify", "--device", "cuda"], "--device", "CUDA is not available")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["rollout", "--device", "cpu", "--profile-frames", "2"],
            ["--profile-frames needs --profile"],
        ),
        (["rollout", "--device", "cpu", "--modes", "compile", "--compile"], ["--modes replaces"]),
        (["rollout", "--device", "cpu", "--modes", "graph"], ["need a CUDA device"]),
        (["rollout", "--device", "cpu", "--cuda-graph"], ["need a CUDA device"]),
        (["kernels", "--device", "cpu", "--jobs", "2"], ["--jobs need(s) --sweep routing"]),
        (
            ["kernels", "--device", "cpu", "--sweep", "routing", "--ops", "combine"],
            ["--ops combine"],
        ),
        (["matrix", "--device", "cpu", "--preset", "deepseek-v3", "--experts", "12"], ["n_groups"]),
    ],
)
def test_bad_combinations_are_one_line_errors(refused, argv, words):
    refused(argv, *words)


def test_every_command_has_help_and_a_result_name():
    parser = cli.build_parser()
    for command in MEASURING:
        args = parser.parse_args([command.name, "--device", "cpu"])
        name = command.result_name(args)
        assert name.startswith(command.name) and "/" not in name
    assert parser.parse_args(["report"]).results == "benchmarks/results"


def test_result_names_follow_the_command_line():
    p = cli.build_parser()

    def name(*argv: str) -> str:
        args = p.parse_args([*argv, "--device", "cpu"])
        return cli.COMMANDS[args.command].result_name(args)

    assert name("matrix") == "matrix-tiny"
    assert name(
        "matrix", "--preset", "deepseek-v3", "--tokens", "64", "--impls", "torch,triton_bf16"
    ) == ("matrix-deepseek-v3-64-torch+triton_bf16")
    assert (
        name("matrix", "--preset", "deepseek-v3", "--experts", "16")
        == "matrix-deepseek-v3-experts=16"
    )
    assert name(
        "rollout", "--preset", "seed-moe", "--modes", "eager,compile", "--no-images", "--profile"
    ) == ("rollout-seed-moe-eager+compile-latents-profile")
    assert name("rollout", "--compile") == "rollout-tiny-compile"
    assert name("kernels") == "kernels" and name("kernels", "--ops", "route") == "kernels-route"
    assert (
        name("kernels", "--sweep", "routing", "--sweep-T", "64,256")
        == "kernels-sweep-routing-T=64+256"
    )
    assert name("verify") == "verify" and name("train", "--gated") == "train-tiny-gated"


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert "moe-bench 0.1.0" in capsys.readouterr().out


MATRIX = ["matrix", "--device", "cpu", "--impls", "baseline,torch", "--tokens", "8",
          "--warmup", "1", "--iters", "1", "--no-compile", "--no-progress"]  # fmt: skip


def test_matrix_prints_header_and_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert cli.main([*MATRIX, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# date") and any(line.startswith("# device") for line in lines)
    head = next(line for line in lines if line.startswith("impl "))
    assert max(map(len, lines[lines.index(head) :])) <= tables.TABLE_WIDTH
    note = [i for i, line in enumerate(lines) if "more columns with --wide" in line]
    hidden = []
    if note:  # the note, wrapped: its continuation lines start "#   "
        text = lines[note[0]]
        for ln in lines[note[0] + 1 :]:
            if not ln.startswith("#   "):
                break
            text += " " + ln.removeprefix("#   ")
        hidden = text.split(": ", 1)[1].split(", ")
    assert head.split()[:-1] + hidden + head.split()[-1:] == matrix.COLUMNS
    assert cli.main([*MATRIX, "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("impl ")).split() == matrix.COLUMNS
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["command"] == "matrix"
    assert doc["name"] == "matrix-tiny-8-baseline+torch"
    assert doc["cmdline"].startswith("moe-bench matrix --device cpu")
    assert [r["impl"] for r in doc["rows"]] == ["baseline", "torch"]
    env = doc["env"]
    assert env["torch"] == torch.__version__ and env["moe_kernels"] and env["moe_tools"]
    assert "commit" in env and "date" in env
    assert doc["args"]["device"] == "cpu" and doc["args"]["tokens"] == 8


def test_save_writes_current_data_per_machine_and_replaces_it(tmp_path, capsys):
    assert cli.main([*MATRIX, "--save", str(tmp_path)]) == 0
    path = tmp_path / machine_slug("cpu") / "matrix-tiny-8-baseline+torch.json"
    first = json.loads(path.read_text())
    assert f"# wrote {path}" in capsys.readouterr().out
    assert cli.main([*MATRIX, "--save", str(tmp_path), "--seed", "1"]) == 0
    again = json.loads(path.read_text())
    assert again["args"]["seed"] == 1 and first["args"]["seed"] == 0  # replaced, one file
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_layer_too_large_is_refused_before_allocating(monkeypatch, refused):
    """deepseek-v3's full layer on a machine with 8 GiB free: sized on the meta device, refused
    with its size and how to shrink it, nothing allocated."""
    devices, real = [], matrix.build_layer

    def spy(sizes, device, *args, **kwargs):
        devices.append(torch.device(device).type)
        return real(sizes, device, *args, **kwargs)

    monkeypatch.setattr(matrix, "build_layer", spy)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 << 30)
    argv = ["matrix", "--device", "cpu", "--preset", "deepseek-v3"]
    err = refused(argv, "deepseek-v3 layer", "8.0 GiB free", "--experts")
    weights = float(re.search(r"\((\S+) GiB of weights in float32", err).group(1))
    # 256 experts of SwiGLU 7168 -> 2 x 2048 -> 7168 and a shared expert in fp32: 45 GB, 42 GiB
    assert 41.5 < weights < 42.5, err
    assert devices == ["meta"]


def test_matrix_shrinks_a_preset_for_a_quick_look(tmp_path, capsys):
    argv = ["matrix", "--device", "cpu", "--preset", "deepseek-v3", "--experts", "16",
            "--hidden", "16", "--d-model", "32", "--tokens", "8", "--impls", "torch",
            "--no-compile", "--warmup", "1", "--iters", "1", "--no-progress",
            "--json", str(tmp_path / "m.json")]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads((tmp_path / "m.json").read_text())
    layer = doc["extra"]["layer"]
    assert (layer["n_experts"], layer["hidden"], layer["d_model"]) == (16, 16, 32)
    assert layer["n_groups"] == 8 and layer["top_k"] == 8  # the preset's routing stays
    assert doc["rows"][0]["status"] == "ok"


def test_rollout_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    argv = ["rollout", "--device", "cpu", "--frames", "2", "--warmup-frames", "0", "--no-progress",
            "--plot", str(png), "--json", str(js)]  # fmt: skip
    assert cli.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(js.read_text())
    assert len(doc["extra"]["frame_ms"]) == 2 and doc["rows"][0]["status"] == "ok"
    assert "fps" in capsys.readouterr().out


def test_kernels_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "k.png"
    argv = ["kernels", "--device", "cpu", "--ops", "to_blocked_per_group_3d", "--no-progress",
            "--plot", str(png)]  # fmt: skip
    assert cli.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "torch reference path" in capsys.readouterr().out


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, tmp_path, refused):
    import moe_tools.plots

    def missing():
        raise RuntimeError(moe_tools.plots.PLOT_EXTRA)

    ran = []
    monkeypatch.setattr(cli, "require_matplotlib", missing)
    monkeypatch.setattr(verify, "run", lambda **kw: ran.append(1))
    argv = ["kernels", "--device", "cpu", "--plot", str(tmp_path / "k.png")]
    refused(argv, "moe-tools[plot]")
    assert not ran


@pytest.mark.parametrize(("failed", "code"), [(0, 0), (2, 1)])
def test_verify_exit_code(monkeypatch, capsys, failed, code):
    rows = [{"check": "route", "status": "pass"}] + [
        {"check": "x", "status": "FAIL: boom"} for _ in range(failed)
    ]
    result = Result("verify", rows, ["check", "status"], {"failed": failed})
    monkeypatch.setattr(verify, "run", lambda **kw: result)
    assert cli.main(["verify", "--device", "cpu", "--no-progress"]) == code
    captured = capsys.readouterr()
    assert "route" in captured.out
    assert ("FAILED" in captured.err) == bool(failed)


def test_verify_lists_every_public_op_by_name(capsys):
    import moe_kernels
    from moe_tools.ops import RESULT_TYPES

    assert cli.main(["verify", "--device", "cpu", "--shapes", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    checks = {line.split()[0] for line in out.splitlines() if line and not line.startswith("#")}
    assert set(moe_kernels.__all__) - set(RESULT_TYPES) <= checks
    assert "vs_reference does not apply" in out  # the CPU run says what it compared against


def test_rollout_config_overrides(tmp_path, capsys):
    """--set replaces config fields, each read as its type; the run records them and its
    result name says them; a value the config refuses stops before anything is built."""
    out = tmp_path / "r.json"
    assert cli.main(["rollout", "--device", "cpu", "--preset", "tiny", "--frames", "2",
                     "--warmup-frames", "1", "--set", "window=2,d_model=96,renormalize=true",
                     "--no-images", "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["extra"]["overrides"] == {"window": 2, "d_model": 96, "renormalize": True}
    assert "window=2" in doc["name"] and doc["rows"][0]["status"] == "ok"
    capsys.readouterr()
    for bad in ("window=0", "windw=2", "window=two"):  # a usage error, or argparse's exit
        try:
            status = cli.main(["rollout", "--device", "cpu", "--set", bad])
        except SystemExit as exc:
            status = exc.code
        assert status == 2 and "--set" in capsys.readouterr().err, bad


def test_rollout_modes_on_one_engine(capsys):
    """--modes measures each runtime on one engine: a row each, in order."""
    cli.main(["rollout", "--device", "cpu", "--preset", "tiny", "--frames", "2",
              "--warmup-frames", "1", "--modes", "eager,compile", "--no-images",
              "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny ")]
    assert [r.split()[2] for r in rows] == ["eager", "compile"]
    assert all(" ok" in r for r in rows)
