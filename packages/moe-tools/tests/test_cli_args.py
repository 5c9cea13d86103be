"""Bad path and number arguments of every ``moe-bench`` command: refused before anything is
measured (exit status 2, one line naming the flag, no traceback), and a measurement whose file
cannot be written is still printed (exit status 1, one line naming the flag)."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import pytest

from moe_tools import cli, ep, memory, plots, report, routing_sweep
from moe_tools.commands import MEASURING
from moe_tools.env import machine_slug
from moe_tools.results import Result

MEASURES = [c.name for c in MEASURING]
PLOTS = [c.name for c in MEASURING if c.plot is not None]


def _boom(*args, **kwargs):
    raise AssertionError("measured before checking the arguments")


@pytest.fixture
def no_measuring(monkeypatch):
    """Every command's run (and report's rendering) fails the test if it is called; --plot
    behaves as if matplotlib were installed."""
    for name, command in cli.COMMANDS.items():
        if command.measures:
            monkeypatch.setitem(cli.COMMANDS, name, dataclasses.replace(command, run=_boom))
    monkeypatch.setattr(report, "markdown_report", _boom)
    monkeypatch.setattr(cli, "require_matplotlib", lambda: None)
    monkeypatch.setattr(cli, "plot_format_error", lambda path: None, raising=False)


@pytest.fixture
def paths(tmp_path):
    """A folder, a regular file, and a path below the regular file."""
    folder = tmp_path / "dir"
    folder.mkdir()
    file = tmp_path / "file"
    file.write_text("x")
    return {"dir": str(folder), "file": str(file), "under_file": str(file / "x.json")}


# the finding's examples
def test_verify_json_to_a_folder(no_measuring, refused, paths):
    refused(["verify", "--device", "cpu", "--json", paths["dir"]], "--json")


def test_verify_save_to_a_file(no_measuring, refused, paths):
    refused(["verify", "--device", "cpu", "--save", paths["file"]], "--save")


def test_json_empty(no_measuring, refused):
    refused(["verify", "--device", "cpu", "--json", ""], "--json")


def test_seed_too_large(no_measuring, refused):
    refused(["verify", "--device", "cpu", "--seed", str(2**70)], "--seed")


def test_report_out_below_a_file(no_measuring, refused, paths):
    refused(["report", "--out", paths["under_file"].replace(".json", ".md")], "--out")


# the same kinds, every command and flag
@pytest.mark.parametrize("command", MEASURES)
@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("--json", "dir"),
        ("--json", "under_file"),
        ("--json", ""),
        ("--save", "file"),
        ("--save", "under_file"),
        ("--save", ""),
    ],
)
def test_bad_output_paths(no_measuring, refused, paths, command, flag, kind):
    refused([command, "--device", "cpu", flag, paths.get(kind, kind)], flag)


@pytest.mark.parametrize("command", PLOTS)
@pytest.mark.parametrize("kind", ["dir", "under_file", ""])
def test_bad_plot_paths(no_measuring, refused, paths, command, kind):
    refused([command, "--device", "cpu", "--plot", paths.get(kind, kind)], "--plot")


@pytest.mark.parametrize("command", MEASURES)
def test_save_whose_machine_folder_is_a_file(no_measuring, refused, tmp_path, command):
    (tmp_path / machine_slug("cpu")).write_text("x")
    refused([command, "--device", "cpu", "--save", str(tmp_path)], "--save")


@pytest.mark.parametrize("flag", ["--json", "--save"])
@pytest.mark.parametrize("existing", [False, True])
def test_read_only_paths(no_measuring, monkeypatch, refused, tmp_path, flag, existing):
    """A folder (or an existing file or folder) this user may not write (faked: root may)."""
    target = tmp_path / "x"
    if existing:
        target.mkdir() if flag == "--save" else target.write_text("x")
    denied = target if existing else tmp_path
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and str(p) != str(denied))
    refused(["verify", "--device", "cpu", flag, str(target)], flag)


@pytest.mark.parametrize("command", MEASURES)
@pytest.mark.parametrize("seed", [str(2**64), str(-(2**63) - 1), "1.5"])
def test_bad_seed(no_measuring, refused, command, seed):
    refused([command, "--device", "cpu", f"--seed={seed}"], "--seed")


@pytest.mark.parametrize(
    "argv",
    [
        ["matrix", "--tokens", str(2**63)],
        ["matrix", "--experts", str(2**64)],
        ["rollout", "--frames", str(2**63)],
        ["rollout", "--warmup-frames", str(2**63)],
        ["kernels", "--sweep", "routing", "--sweep-T", f"64,{2**63}"],
        ["kernels", "--sweep", "routing", "--jobs", str(10**9)],
        ["verify", "--shapes", str(2**63)],
        ["train", "--steps", str(2**63)],
        ["train", "--hidden", str(2**63)],
        ["ep", "--world-sizes", f"1,{2**63}"],
        ["ep", "--iters", str(2**63)],
    ],
)
def test_numbers_out_of_range(no_measuring, refused, argv):
    flag = next(a for a in reversed(argv) if a.startswith("--"))
    refused([*argv, "--device", "cpu"], flag)


# sizes that only the run can check (against the preset's, the machine's memory): refused
# before anything is allocated or measured
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["matrix", "--d-model", str(2**62)], "--d-model"),
        (["matrix", "--tokens", str(2**40)], "--tokens"),
        (["matrix", "--experts", "4", "--top-k", "5"], "--top-k"),
        (["train", "--hidden", str(2**62)], "--hidden"),
        (["train", "--tokens", str(2**40)], "--tokens"),
        (["train", "--top-k", "9"], "--top-k"),
        (["train", "--sweep", "--experts", "100", "--top-k", "200"], "--top-k"),
        (["ep", "--world-sizes", "1,9"], "--world-sizes"),
        (["ep", "--tokens", str(2**40), "--world-sizes", "1"], "--tokens"),
        (["kernels", "--sweep", "routing", "--sweep-E", "4", "--sweep-k", "8"], "--sweep-k"),
        (["kernels", "--sweep", "routing", "--sweep-T", str(2**40)], "--sweep-T"),
    ],
)
def test_sizes_the_run_checks_first(monkeypatch, refused, argv, flag):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(ep, "_spawned_rows", _boom)
    monkeypatch.setattr(routing_sweep, "spin_up", _boom)
    refused([*argv, "--device", "cpu", "--no-progress"], flag)


def test_ep_starts_no_rank_that_would_measure_nothing(monkeypatch, capsys):
    """A world size that divides no shape's expert count: its rows say so, no process starts."""
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", _boom)
    result = ep.run(device="cpu", shapes=["tiny"], world_sizes=[3], modes=["padded"])
    assert [r["status"] for r in result.rows] == ["unavailable: E=8 not divisible by 3"]


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--out", ""],
        ["report", "--out", "{dir}", "--force"],
        ["report", "--results", ""],
    ],
)
def test_report_bad_paths(no_measuring, refused, paths, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(**paths) for a in argv]
    refused(argv, next(a for a in argv if a in ("--out", "--results")))


def test_plot_format_is_checked_before_measuring(no_measuring, monkeypatch, refused, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(cli, "plot_format_error", plots.plot_format_error)
    refused(["kernels", "--device", "cpu", "--plot", str(tmp_path / "k.nope")], "--plot")


# a measurement that cannot be written is still printed
RESULT = Result("verify", [{"check": "route", "status": "pass"}], ["check", "status"], {})


def _disk_full(path, doc):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def _fake(monkeypatch, name: str, **fields) -> None:
    monkeypatch.setitem(cli.COMMANDS, name, dataclasses.replace(cli.COMMANDS[name], **fields))


def _printed_but_not_written(capsys, argv: list[str], flag: str, why="No space left") -> None:
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "route" in captured.out and "pass" in captured.out  # the result
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert flag in err and "not written" in err and why in err, err


@pytest.mark.parametrize("flag", ["--json", "--save"])
def test_a_failed_write_still_prints_the_result(monkeypatch, capsys, tmp_path, flag):
    _fake(monkeypatch, "verify", run=lambda args, checkpoint=None: RESULT)
    monkeypatch.setattr(cli, "write_json", _disk_full)
    argv = ["verify", "--device", "cpu", flag, str(tmp_path / "v")]
    _printed_but_not_written(capsys, argv, flag)


def test_a_failed_checkpoint_does_not_stop_the_measurement(monkeypatch, capsys, tmp_path):
    def run(args, checkpoint=None):
        checkpoint(RESULT)  # a sweep's progress
        return RESULT

    _fake(monkeypatch, "kernels", run=run)
    monkeypatch.setattr(cli, "write_json", _disk_full)
    argv = ["kernels", "--device", "cpu", "--json", str(tmp_path / "k.json")]
    _printed_but_not_written(capsys, argv, "--json")


def test_a_failed_plot_still_prints_the_result(monkeypatch, capsys, tmp_path):
    _fake(monkeypatch, "kernels", run=lambda args, checkpoint=None: RESULT, plot=_disk_full)
    monkeypatch.setattr(cli, "require_matplotlib", lambda: None)
    monkeypatch.setattr(cli, "plot_format_error", lambda path: None, raising=False)
    argv = ["kernels", "--device", "cpu", "--plot", str(tmp_path / "k.png")]
    _printed_but_not_written(capsys, argv, "--plot")


@pytest.mark.parametrize("flag", ["--json", "--save"])
def test_a_folder_gone_during_the_run(monkeypatch, capsys, tmp_path, flag):
    """The output folder (checked before measuring) is replaced by a file while measuring: the
    real write fails (File exists / Not a directory), the result is still printed."""
    out = tmp_path / "out"
    out.mkdir()

    def run(args, checkpoint=None):
        shutil.rmtree(out)
        out.write_text("not a folder any more")
        return RESULT

    _fake(monkeypatch, "verify", run=run)
    target = out / "v.json" if flag == "--json" else out
    _printed_but_not_written(capsys, ["verify", "--device", "cpu", flag, str(target)], flag, "")
    assert out.read_text() == "not a folder any more"


def test_report_out_gone_while_rendering(monkeypatch, capsys, tmp_path):
    out = tmp_path / "site"
    out.mkdir()

    def render(folder, title=None):
        shutil.rmtree(out)
        out.write_text("x")
        return "# page\n"

    monkeypatch.setattr(report, "markdown_report", render)
    assert cli.main(["report", "--out", str(out / "page.md")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and "Traceback" not in err, err


def test_report_results_is_a_file(refused, paths):
    err = refused(["report", "--results", paths["file"]], "--results")
    assert "not a folder" in err
