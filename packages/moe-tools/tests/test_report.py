"""Tables, JSON documents, the environment header, plots and the markdown page."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from moe_tools import report


def test_format_value():
    fv = report.format_value
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
    lines = report.format_table(rows, ["impl", "ms", "status"]).splitlines()
    assert len(lines) == 5
    head, sep, *body = lines
    assert head.split() == ["impl", "ms", "status"]
    assert set(sep.replace(" ", "")) == {"-"}
    # every row's number ends in the same column (right-aligned)
    ms_end = head.index("ms") + len("ms")
    assert [b[:ms_end].rstrip()[-4:] for b in body] == ["12.5", "1.25", "   -"]
    assert body[1].startswith("torch    ")
    assert body[1].endswith("unavailable: x")


def test_format_table_columns_default_to_first_seen_order():
    rows = [{"a": 1}, {"b": 2, "a": 3}]
    assert report.format_table(rows).splitlines()[0].split() == ["a", "b"]
    assert report.format_table([]) == "(no rows)"


def test_markdown_table():
    md = report.markdown_table([{"op": "route|x", "us": 3.5}], ["op", "us"]).splitlines()
    assert md[0] == "| op | us |"
    assert md[1] == "| --- | ---: |"
    assert md[2] == "| route\\|x | 3.5 |"


def test_document_is_strict_json_with_env_and_rows(tmp_path):
    env = report.environment("cpu")
    rows = [{"impl": "a", "ms": float("nan"), "n": 3}, {"impl": "b", "ms": 1.0, "n": None}]
    doc = report.make_document(
        "matrix",
        rows,
        env,
        columns=["impl", "ms", "n"],
        args={"device": torch.device("cpu")},
        cmdline="moe-bench matrix",
        extra={"frame_ms": [1.0, float("inf")]},
    )
    path = report.write_json(tmp_path / "sub" / "m.json", doc)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert back["schema"] == report.SCHEMA
    assert back["command"] == "matrix"
    assert back["cmdline"] == "moe-bench matrix"
    assert back["columns"] == ["impl", "ms", "n"]
    assert back["rows"] == [{"impl": "a", "ms": None, "n": 3}, {"impl": "b", "ms": 1.0, "n": None}]
    assert back["args"] == {"device": "cpu"}
    assert back["extra"] == {"frame_ms": [1.0, None]}
    assert back["env"]["torch"] == torch.__version__


def test_environment_and_header():
    env = report.environment("cpu")
    for key in ("torch", "triton", "cuda", "gpu", "gpu_memory_gib", "os", "python", "moe-tools"):
        assert key in env
    assert env["device"] == "cpu"
    assert env["moe-tools"] is not None
    header = report.format_environment(env)
    lines = header.splitlines()
    assert all(line.startswith("# ") for line in lines)
    assert torch.__version__ in header
    assert "GPU: " in header and "os" in header and "moe-tools" in header


def test_header_shows_gpu_name_and_memory():
    env = dict(
        report.environment("cpu"),
        gpu="NVIDIA H200",
        gpu_memory_gib=139.8,
        gpu_capability="9.0",
        cuda="13.0",
        device="cuda",
    )
    header = report.format_environment(env)
    assert "NVIDIA H200 (139.8 GiB, sm 9.0)" in header
    assert "CUDA 13.0" in header


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"op": "route", "impl": "moe_kernels", "bytes": 1e6, "gbps": 100.0},
        {"op": "route", "impl": "torch", "bytes": 1e6, "gbps": 50.0},
        {"op": "clone", "impl": "clone", "bytes": 1e6, "gbps": None},
    ]
    k = report.plot_kernels(rows, 200.0, tmp_path / "k.png")
    r = report.plot_rollout([1.0, 2.0, 1.5], tmp_path / "r.png")
    for p in (k, r):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"moe-tools\[plot\]"):
        report.require_matplotlib()


def test_markdown_report_from_saved_results(tmp_path):
    env = report.environment("cpu")
    doc = report.make_document(
        "kernels",
        [{"op": "route", "us": 12.0}],
        env,
        cmdline="moe-bench kernels --quick",
        extra={"ceiling_gbps": 99.5},
    )
    report.write_json(tmp_path / "kernels.json", doc)
    pb = {
        "machine_info": {"node": "box", "system": "Linux", "release": "6", "python_version": "3"},
        "commit_info": {},
        "datetime": "2026-11-29",
        "benchmarks": [
            {
                "name": "test_ar_rollout[tiny]",
                "stats": {"median": 0.25, "min": 0.2, "rounds": 3},
                "extra_info": {"max_vram_alloc": 1.5, "nested": {"x": 1}},
            }
        ],
    }
    (tmp_path / "suite.json").write_text(json.dumps(pb))
    (tmp_path / "junk.json").write_text("not json")
    md = report.markdown_report(tmp_path, title="T")
    assert md.startswith("# T\n")
    assert "## Environment" in md
    assert "moe-bench kernels --quick" in md
    assert "| route | 12 |" in md
    assert "ceiling_gbps: 99.5" in md
    assert "| test_ar_rollout[tiny] | 250.0 | 200.0 | 3 | 1.5 |" in md
    assert "nested" not in md


def test_markdown_report_from_several_folders(tmp_path):
    env = report.environment("cpu")
    for name, us in (("new", 3.0), ("old", 5.0)):
        doc = report.make_document("kernels", [{"op": name, "us": us}], env, cmdline=name)
        report.write_json(tmp_path / name / "kernels.json", doc)
    md = report.markdown_report([tmp_path / "new", tmp_path / "old"])
    assert f"--results {(tmp_path / 'new').as_posix()} --results" in md
    assert "from 2 JSON file(s)" in md
    assert md.index("(new/kernels.json)") < md.index("(old/kernels.json)")
    assert md.index("| new | 3 |") < md.index("| old | 5 |")


def test_progress_without_tqdm_is_silent(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = report.progress([1, 2, 3], desc="x")
    assert list(bar) == [1, 2, 3]
    bar.update()
    bar.set_postfix_str("y")
    bar.close()
    assert list(report.progress(enabled=False)) == []
    assert capsys.readouterr().err == ""


def test_machine_slug_and_results_folder():
    slug = report.machine_slug("cpu")
    assert slug and slug == slug.lower() and " " not in slug and "_" not in slug
    folder = report.results_folder("out")
    assert folder.parent.as_posix() == "out"
    assert folder.name.startswith(report.machine_slug() + "-20")


def test_short_error():
    assert report.short_error(KeyError("k")) == "KeyError: 'k'"
    assert report.short_error(RuntimeError()) == "RuntimeError"
