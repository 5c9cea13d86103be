"""Tables, JSON documents, the environment header, saved results and the report page."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from moe_tools import cli, report
from moe_tools.command import UsageError
from moe_tools.env import environment, format_environment, git_commit, machine_slug
from moe_tools.results import (
    SCHEMA,
    documents,
    make_document,
    saved_path,
    slug,
    write_json,
)
from moe_tools.tables import (
    TABLE_WIDTH,
    format_table,
    format_value,
    markdown_table,
    non_empty,
    progress,
    table_width,
)


def test_format_value():
    fv = format_value
    assert fv(None) == "-"
    assert fv(True) == "yes" and fv(False) == "no"
    assert fv(12) == "12"
    assert fv(0.0) == "0"
    assert fv(float("nan")) == "nan"
    assert fv(float("inf")) == "inf"
    assert fv(3.0e-7) == "3.00e-07"
    assert fv(0.5) == "0.5"
    assert fv(0.1234) == "0.123"
    assert fv(1.5) == "1.5"
    assert fv(12.345) == "12.345"
    assert fv(1234.56) == "1234.6"
    assert fv(2.5e9) == "2.50e+09"
    assert fv("ok") == "ok"


def test_format_table_aligns_numbers_right_and_text_left():
    rows = [
        {"impl": "baseline", "ms": 12.5, "status": "ok"},
        {"impl": "torch", "ms": 1.25, "status": "unavailable: x"},
        {"impl": "t", "ms": None, "status": "ok"},
    ]
    lines = format_table(rows, ["impl", "ms", "status"]).splitlines()
    assert len(lines) == 5
    head, sep, *body = lines
    assert head.split() == ["impl", "ms", "status"]
    assert set(sep.replace(" ", "")) == {"-"}
    ms_end = head.index("ms") + len("ms")  # every row's number ends in the same column
    assert [b[:ms_end].rstrip()[-4:] for b in body] == ["12.5", "1.25", "   -"]
    assert body[1].startswith("torch    ")
    assert body[1].endswith("unavailable: x")
    assert format_table([{"a": 1}, {"b": 2, "a": 3}]).splitlines()[0].split() == ["a", "b"]
    assert format_table([]) == "(no rows)"
    assert non_empty(rows + [{"x": None}], ["impl", "x", "ms"]) == ["impl", "ms"]


def test_tables_fit_the_width_cutting_text_then_dropping_columns():
    status = "unavailable: RuntimeError: " + "x" * 150
    rows = [{"impl": f"impl{i}", **{f"metric_{j}": 1000.5 + j for j in range(14)},
             "status": status if i == 1 else "ok"} for i in range(3)]  # fmt: skip
    full = format_table(rows).splitlines()
    with table_width(TABLE_WIDTH):  # the default
        assert format_table(rows).splitlines() == full
    assert max(map(len, full)) <= TABLE_WIDTH
    head = full[0].split()
    assert head[0] == "impl" and head[-1] == "status"  # the name and the verdict stay
    dropped = [f"metric_{j}" for j in range(14) if f"metric_{j}" not in head]
    assert dropped and head[1:-1] == [f"metric_{j}" for j in range(14 - len(dropped))]
    assert full[-1].startswith(f"# {len(dropped)} more columns with --wide")
    assert full[3].endswith("...") and "unavailable: RuntimeError" in full[3]  # cut, not dropped
    with table_width(None):
        wide = format_table(rows).splitlines()
    assert wide[0].split() == list(rows[0]) and wide[3].endswith(status)
    with table_width(40):  # too narrow for any but two columns: those two, the text cut
        narrow = format_table(rows).splitlines()
    assert narrow[0].split() == ["impl", "status"] and max(map(len, narrow[:5])) <= 40


def test_markdown_table():
    md = markdown_table([{"op": "route|x", "us": 3.5}], ["op", "us"]).splitlines()
    assert md == ["| op | us |", "| --- | ---: |", "| route\\|x | 3.5 |"]


def test_document_is_strict_json_with_env_and_rows(tmp_path):
    env = environment("cpu")
    rows = [{"impl": "a", "ms": float("nan"), "n": 3}, {"impl": "b", "ms": 1.0, "n": None}]
    doc = make_document(
        "matrix",
        rows,
        env,
        name="matrix-tiny",
        columns=["impl", "ms", "n"],
        args={"device": torch.device("cpu")},
        cmdline="moe-bench matrix",
        extra={"frame_ms": [1.0, float("inf")]},
    )
    text = write_json(tmp_path / "sub" / "m.json", doc).read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert (
        back["schema"] == SCHEMA and back["command"] == "matrix" and back["name"] == "matrix-tiny"
    )
    assert back["columns"] == ["impl", "ms", "n"]
    assert back["rows"] == [{"impl": "a", "ms": None, "n": 3}, {"impl": "b", "ms": 1.0, "n": None}]
    assert back["args"] == {"device": "cpu"}
    assert back["extra"] == {"frame_ms": [1.0, None]}
    assert back["env"]["torch"] == torch.__version__


def test_environment_holds_date_commit_and_versions():
    env = environment("cpu")
    for key in ("date", "commit", "torch", "triton", "cuda", "gpu", "os", "python", "moe_tools"):
        assert key in env
    assert env["device"] == "cpu" and env["machine"] == machine_slug("cpu")
    assert env["moe_kernels"] and env["moe_model"] and env["moe_tools"]
    commit, dirty = git_commit()
    assert env["commit"] == commit and (commit is None or len(commit) == 40)
    header = format_environment(env)
    assert all(line.startswith("# ") for line in header.splitlines())
    assert torch.__version__ in header and "GPU: " in header and "moe_tools" in header
    assert git_commit("/") == (None, None)  # not a checkout


def test_header_shows_gpu_name_and_memory():
    env = dict(environment("cpu"), gpu="NVIDIA H200", gpu_memory_gib=139.8, gpu_capability="9.0",
               cuda="13.0", device="cuda")  # fmt: skip
    header = format_environment(env)
    assert "NVIDIA H200 (139.8 GiB, sm 9.0)" in header and "CUDA 13.0" in header


def test_slug_and_saved_path(tmp_path):
    assert slug("matrix", "seed-moe", None, [], ["torch", "triton_bf16"]) == (
        "matrix-seed-moe-torch+triton_bf16"
    )
    assert slug("a", "b/c d") == "a-b_c_d"
    assert saved_path(tmp_path, "nvidia-h200", "kernels") == tmp_path / "nvidia-h200/kernels.json"
    slug_ = machine_slug("cpu")
    assert slug_ and slug_ == slug_.lower() and " " not in slug_ and "_" not in slug_


def test_progress_without_tqdm_is_silent(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = progress([1, 2, 3], desc="x")
    assert list(bar) == [1, 2, 3]
    bar.update()
    bar.set_postfix_str("y")
    bar.close()
    assert list(progress(enabled=False)) == []
    assert capsys.readouterr().err == ""


def _save(folder, machine: str, name: str, command: str, rows, **kw):
    env = dict(environment("cpu"), date="2026-12-02T05:26:00+00:00", commit="a" * 40, dirty=False)
    doc = make_document(command, rows, env, name=name, **kw)
    return write_json(saved_path(folder, machine, name), doc)


PYTEST_BENCHMARK = {
    "machine_info": {"node": "box", "moe_bench": {"torch": "2.13.0", "date": "2026-11-29"}},
    "commit_info": {},
    "datetime": "2026-11-29T10:00:00",
    "benchmarks": [
        {
            "name": "test_ar_rollout[tiny]",
            "stats": {"median": 0.25, "min": 0.2, "rounds": 3},
            "extra_info": {"max_vram_alloc": 1.5, "nested": {"x": 1}},
        }
    ],
}


def test_report_page_from_one_folder(tmp_path):
    root = tmp_path / "results"
    kernels = [{"op": "route", "us": 12.0, "status": "ok"}]
    cmdline = "moe-bench kernels --save benchmarks/results"
    _save(root, "nvidia-h200", "kernels", "kernels", kernels, cmdline=cmdline,
          extra={"notes": ["ceiling 4000"]})  # fmt: skip
    _save(root, "nvidia-h200", "matrix-seed-moe", "matrix", [{"impl": "torch", "eager_ms": 1.0}],
          extra={"preset": "seed-moe"})  # fmt: skip
    (root / "cpu-x86_64").mkdir()
    (root / "cpu-x86_64" / "pytest-benchmark.json").write_text(json.dumps(PYTEST_BENCHMARK))
    (root / "cpu-x86_64" / "junk.json").write_text("not json")
    (root / "README.md").write_text("Current data; history in docs/.\n")
    assert len(list(documents(root))) == 3
    md = report.markdown_report(root, title="T")
    assert md.startswith("# T\n\nCurrent data; history in docs/.\n")
    assert "from 3 result file(s)" in md
    assert md.index("## cpu-x86_64") < md.index("## nvidia-h200")
    # per machine: an index, then the commands in the CLI's order (matrix before kernels)
    assert "| [matrix-seed-moe](#matrix-seed-moe) | 2026-12-02 05:26 UTC | aaaaaaa |" in md
    assert md.index("### matrix-seed-moe") < md.index("### kernels")
    assert "```bash\nmoe-bench kernels --save benchmarks/results\n```" in md
    assert "| route | 12 | ok |" in md and "* ceiling 4000" in md
    assert "preset: seed-moe" in md
    assert "2026-12-02 05:26 UTC, commit aaaaaaa, " in md
    assert "| test_ar_rollout[tiny] | 250.0 | 200.0 | 3 | 1.5 |" in md and "nested" not in md


def test_report_renders_provenance_of_converted_results(tmp_path):
    path = _save(tmp_path, "m", "verify", "verify", [{"check": "route", "status": "pass"}])
    doc = json.loads(path.read_text())
    doc["env"]["commit"] = None
    doc["provenance"] = {"converted_from": "old/verify.json", "commit_note": "not recorded"}
    path.write_text(json.dumps(doc))
    md = report.markdown_report(tmp_path)
    assert "commit not recorded" in md
    assert "* converted from: old/verify.json" in md and "* commit note: not recorded" in md


def test_report_command_never_overwrites_without_force(tmp_path, capsys):
    _save(tmp_path / "res", "m", "verify", "verify", [{"check": "route", "status": "pass"}])
    out = tmp_path / "BENCHMARKS.md"
    args = ["report", "--results", str(tmp_path / "res")]
    assert cli.main([*args, "--out", str(out)]) == 0 and "### verify" in out.read_text()
    out.write_text("mine")
    assert cli.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert out.read_text() == "mine"
    assert cli.main([*args, "--out", str(out), "--force"]) == 0 and "### verify" in out.read_text()
    assert cli.main(args) == 0 and "### verify" in capsys.readouterr().out  # no --out: stdout


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_of_no_results_is_an_error(tmp_path, capsys, make):
    folder = tmp_path / "res"
    if make == "empty":
        folder.mkdir()
        (folder / "notes.json").write_text('{"a": 1}')
    with pytest.raises(UsageError):
        report.markdown_report(folder)
    assert cli.main(["report", "--results", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--results" in err and len(err.splitlines()) == 1
