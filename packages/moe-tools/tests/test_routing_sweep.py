"""``moe-bench kernels --sweep routing`` on CPU: the grid, the arithmetic of the derived columns,
the table and summary, the CLI flags, the plot and the markdown report."""

from __future__ import annotations

import itertools
import json
import shlex

import pytest
import torch

from moe_tools import cli, report, routing_sweep_report
from moe_tools import routing_sweep as rs
from moe_tools.env import environment
from moe_tools.results import SCHEMA, make_document, write_json


def _row(op, T, eager, graph, torch_us, fbgemm=None, fbgemm_graph=None, E=8, k=1, status="ok"):
    return dict(
        op=op,
        dtype="bf16",
        T=T,
        E=E,
        k=k,
        eager_us=eager,
        graph_us=graph,
        torch_us=torch_us,
        fbgemm_us=fbgemm,
        fbgemm_graph_us=fbgemm_graph,
        status=status,
    )


@pytest.fixture
def synthetic():
    """route: a cliff at T=1024 (eager 10 > 8 at 4096); index_shuffling: slower than fbgemm at
    T=4096 in eager only; one failed point; a T=2048 row with no 4T neighbour."""
    return rs.derive(
        [
            _row("route", 1024, 10.0, 5.0, 100.0),
            _row("route", 4096, 8.0, 5.5, 100.0),
            _row("route", 16384, 20.0, 30.0, 50.0),
            _row("route", 2048, 4.0, 2.0, 8.0, k=2),
            _row("index_shuffling", 1024, 4.0, 2.0, 100.0, fbgemm=8.0, fbgemm_graph=3.0),
            _row("index_shuffling", 4096, 10.0, 4.0, 100.0, fbgemm=5.0, fbgemm_graph=6.0),
            _row("index_shuffling", 16384, None, None, 100.0, status="FAIL: RuntimeError: x"),
        ]
    )


def _by(rows, op, T):
    return next(r for r in rows if r["op"] == op and r["T"] == T)


def test_derived_columns_match_hand_computed_numbers(synthetic):
    r1, r4, r16 = (_by(synthetic, "route", T) for T in (1024, 4096, 16384))
    assert r1["speedup_vs_torch"] == pytest.approx(10.0)  # 100 / 10
    assert r1["graph_speedup_vs_torch"] == pytest.approx(20.0)  # 100 / 5
    assert r16["speedup_vs_torch"] == pytest.approx(2.5)  # 50 / 20
    assert r1["cliff_eager"] == pytest.approx(1.25)  # 10 / 8: a cliff
    assert r1["cliff_graph"] == pytest.approx(5.0 / 5.5)
    assert r4["cliff_eager"] == pytest.approx(0.4) and r4["cliff_graph"] == pytest.approx(5.5 / 30)
    assert r16["cliff_eager"] is None and r16["cliff_graph"] is None  # no 4T
    assert _by(synthetic, "route", 2048)["cliff_eager"] is None  # 8192 was not measured
    assert r1["vs_fbgemm"] is None  # route has no fbgemm peer
    i1, i4, i16 = (_by(synthetic, "index_shuffling", T) for T in (1024, 4096, 16384))
    assert i1["vs_fbgemm"] == pytest.approx(2.0) and i1["vs_fbgemm_graph"] == pytest.approx(1.5)
    assert i4["vs_fbgemm"] == pytest.approx(0.5) and i4["vs_fbgemm_graph"] == pytest.approx(1.5)
    assert i1["cliff_eager"] == pytest.approx(0.4) and i1["cliff_graph"] == pytest.approx(0.5)
    assert i4["cliff_eager"] is None  # the 4T point failed: no ratio
    assert i16["speedup_vs_torch"] is None and i16["vs_fbgemm"] is None


def test_summary_finds_the_worst_points(synthetic):
    s = rs.summarize(synthetic)
    assert s["points"] == 7 and s["failed"] == 1
    assert s["cliffs"] == 1
    assert s["worst_cliff_eager"] == {
        "value": pytest.approx(1.25),
        "where": "route bf16 E=8 k=1 T=1024->4096",
    }
    assert s["worst_cliff_graph"]["value"] == pytest.approx(5.0 / 5.5)
    assert s["min_speedup_eager"] == {"value": 2.0, "where": "route bf16 E=8 k=2 T=2048"}
    assert s["min_speedup_graph"]["value"] == pytest.approx(50 / 30)
    assert s["fbgemm_points"] == 2
    assert s["slower_than_fbgemm"] == [
        {"where": "index_shuffling bf16 E=8 k=1 T=4096", "vs_fbgemm": 0.5, "vs_fbgemm_graph": 1.5}
    ]


def test_table_and_summary_rendering(synthetic):
    text = routing_sweep_report.format_sweep(synthetic, rs.summarize(synthetic))
    lines = text.splitlines()
    assert lines[0].split() == ["op", "dtype", "E", "k", "T=1K", "T=2K", "T=4K", "T=16K"]
    body = [line for line in lines[2:] if not line.startswith("#")]
    assert len(body) == 3  # (index_shuffling, k=1), (route, k=1), (route, k=2)
    assert body[0].startswith("route ")  # measured first in the synthetic rows
    route_k1 = body[0].split()
    assert route_k1[:4] == ["route", "bf16", "8", "1"]
    # eager/graph us and speedup per T; ! marks the cliff; T=2K was not measured for k=1
    assert route_k1[4:9] == ["10.0/5.00", "10.0x!", "-", "8.00/5.50", "12.5x"]
    shuffle = body[2]
    assert "4.00/2.00 25.0x" in shuffle and "10.0/4.00 10.0x*" in shuffle
    assert shuffle.endswith("FAIL")
    assert "# worst cliff eager: 1.25 at route bf16 E=8 k=1 T=1024->4096 (a cliff)" in lines
    assert "# worst cliff graph: 0.909 at route bf16 E=8 k=1 T=1024->4096 (no cliff)" in lines
    assert "# slower than fbgemm: 1 of 2 point(s) fbgemm ran" in lines
    assert "#   index_shuffling bf16 E=8 k=1 T=4096: vs_fbgemm 0.5, graph 1.5" in lines


def test_grid_axes_and_skipped_k():
    full = rs.make_grid(quick=False)
    assert full.T == (1024, 4096, 16384, 65536, 262144, 1048576)
    assert full.E == (8, 16, 32, 64, 128, 256, 320) and full.k == (1, 2, 4, 8)
    assert len(full.points()) == 6 * 7 * 4 * 2
    g = rs.make_grid(quick=True, E=[4, 2], k=[4, 1], dtypes=["fp32"], ops=["route"])
    assert g.T == rs.QUICK_T and g.E == (2, 4) and g.ops == ("route",)
    assert (("fp32", 2, 64, 4)) not in g.points() and ("fp32", 4, 64, 4) in g.points()
    assert len(g.points()) == 2 * 3  # k=4 > E=2 skipped
    with pytest.raises(ValueError, match="unknown dtypes"):
        rs.make_grid(quick=True, dtypes=["fp16"])
    with pytest.raises(ValueError, match="unknown ops"):
        rs.make_grid(quick=True, ops=["combine"])


def test_time_bounds(monkeypatch):
    seen = []
    monkeypatch.setattr(rs, "bench_us", lambda fn, dev, **kw: seen.append(kw) or 1.0)
    cuda = torch.device("cuda")  # bench_us is replaced: nothing touches a GPU
    for call_ms in (0.01, 20.0, 400.0):
        rs.eager_us(lambda: None, cuda, call_ms)
    rs.eager_us(lambda: None, cuda, 400.0, warm=True)
    assert rs.EAGER_REP_MS < 100 < rs.MAX_REP_MS  # what the next line assumes
    assert [kw["rep_ms"] for kw in seen] == [rs.EAGER_REP_MS, 100, rs.MAX_REP_MS, 1]
    # (the window; 5 calls of 20 ms; the cap; the warm-up's shortest window)
    assert rs.graph_plan(10.0) == (10, 50)  # 10 calls per replay, capped at 50 replays
    assert rs.graph_plan(1000.0) == (1, 5)  # one call per replay, 5 ms of replays
    assert rs.graph_plan(1e5) == (1, 3)  # at least 3 replays


def test_quick_sweep_on_cpu_writes_rows_and_table(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["kernels", "--sweep", "routing", "--device", "cpu", "--quick", "--json", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["command"] == "kernels"
    assert doc["cmdline"] == shlex.join(["moe-bench", *argv])
    assert doc["columns"] == rs.COLUMNS and doc["env"]["torch"] == torch.__version__
    rows = doc["rows"]
    by_key = {(r["op"], r["dtype"], r["T"], r["E"], r["k"]): r for r in rows}
    assert len(rows) == len(by_key) == 32
    assert set(by_key) == set(
        itertools.product(rs.OPS, ("bf16", "fp32"), (64, 256), (8, 16), (1, 2))
    )
    for r in rows:
        assert list(r) == rs.COLUMNS
        assert r["status"] == "ok" and r["torch_status"] == "ok"
        assert r["eager_us"] > 0 and r["torch_us"] > 0
        assert r["speedup_vs_torch"] == pytest.approx(r["torch_us"] / r["eager_us"])
        assert r["graph_us"] is None and r["graph_status"] == "skipped: no CUDA"
        assert r["fbgemm_us"] is None
        peer = "skipped: no CUDA" if r["op"] == "index_shuffling" else "n/a: fbgemm has no route"
        assert r["fbgemm_status"] == peer
        if r["T"] == 64:  # time(T) / time(4T)
            up = by_key[(r["op"], r["dtype"], 256, r["E"], r["k"])]
            assert r["cliff_eager"] == pytest.approx(r["eager_us"] / up["eager_us"])
        else:
            assert r["cliff_eager"] is None
    extra = doc["extra"]
    assert extra["sweep"] == "routing" and extra["partial"] is False and extra["quick"] is True
    assert extra["summary"]["points"] == 32 and extra["summary"]["failed"] == 0
    table = [line for line in captured.out.splitlines() if line.startswith(("index_", "route "))]
    assert len(table) == 16  # (op, dtype, E, k)
    assert "T=64" in captured.out and "T=256" in captured.out
    assert "# min speedup vs torch eager: " in captured.out
    progress = [line for line in captured.err.splitlines() if line.startswith("[sweep routing]")]
    assert progress[0].startswith("[sweep routing] bf16 E=8 (1/4)")
    assert any("fp32 E=16 (4/4)" in line for line in progress)


def test_a_failing_point_is_a_status_and_checkpoints_keep_partial_rows(monkeypatch):
    real = rs.op_thunks

    def boom():
        raise RuntimeError("boom")

    def broken(scores, k):
        thunks = real(scores, k)
        if k == 2:
            thunks["route"] = boom
        return thunks

    monkeypatch.setattr(rs, "op_thunks", broken)
    seen = []
    res = rs.run(device="cpu", T=[64], E=[8, 16], k=[1, 2], dtypes=["fp32"], checkpoint=seen.append)
    assert [c.extra["partial"] for c in seen] == [True, False]
    assert [len(c.rows) for c in seen] == [4, 8]
    status = {(r["op"], r["E"], r["k"]): r["status"] for r in res.rows}
    assert status[("route", 8, 2)] == "FAIL: RuntimeError: boom"
    assert status[("route", 8, 1)] == "ok" and status[("index_shuffling", 8, 2)] == "ok"
    assert res.extra["summary"]["failed"] == 2


def test_warm_points_and_the_worker_pool(monkeypatch):
    assert rs.warm_points([("fp32", 8, 64, 2)], "cpu", rs.OPS) == []
    errors = rs.warm_points([("fp8", 8, 64, 2)], "cpu", rs.OPS)
    assert len(errors) == 1 and "KeyError" in errors[0]

    from concurrent.futures import ThreadPoolExecutor

    chunks = []

    class InlinePool(ThreadPoolExecutor):  # the same interface, without spawning processes
        def __init__(self, n, mp_context=None):
            super().__init__(n)

        def submit(self, fn, points, device, ops):
            chunks.append(list(points))
            return super().submit(fn, points, device, ops)

    monkeypatch.setattr(rs, "ProcessPoolExecutor", InlinePool)
    grid = rs.make_grid(quick=True, T=[64, 256], E=[8, 16], k=[1, 2], dtypes=["fp32"])
    info = rs.warm_plans(grid, torch.device("cpu"), jobs=3)
    assert info["jobs"] == 3 and info["failed"] == 0 and info["errors"] == []
    assert sorted(p for c in chunks for p in c) == sorted(grid.points())
    for chunk in chunks:  # every k of a shape goes to the same worker (one scores tensor)
        assert len(chunk) == 2 * len({p[:3] for p in chunk})
    chunks.clear()
    assert rs.warm_plans(grid, torch.device("cpu"), jobs=8)["jobs"] == 4  # 4 shapes, 4 workers
    assert sorted(p for c in chunks for p in c) == sorted(grid.points())

    real = rs.op_thunks

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(rs, "op_thunks", lambda scores, k: {**real(scores, k), "route": boom})
    errors = rs.warm_points([("fp32", 8, 64, 1)], "cpu", rs.OPS)
    assert errors == ["('fp32', 8, 64, 1) route: FAIL: RuntimeError: boom, graph -"]


def test_cli_sweep_flags():
    p = cli.build_parser()
    args = p.parse_args(
        ["kernels", "--sweep", "routing", "--sweep-T", "1024, 4096", "--sweep-E", "8"]
        + ["--sweep-k", "1,2", "--sweep-dtypes", "bf16", "--jobs", "4", "--ops", "route"]
    )
    assert args.sweep == "routing" and args.sweep_T == [1024, 4096] and args.sweep_E == [8]
    assert args.sweep_k == [1, 2] and args.sweep_dtypes == ["bf16"] and args.jobs == 4
    assert p.parse_args(["kernels"]).sweep is None and p.parse_args(["kernels"]).jobs == 0
    for bad in (
        ["kernels", "--sweep", "mxfp8"],
        ["kernels", "--sweep", "routing", "--sweep-T", "0"],
        ["kernels", "--sweep", "routing", "--sweep-E", "x"],
        ["kernels", "--sweep", "routing", "--sweep-dtypes", "fp16"],
        ["kernels", "--sweep", "routing", "--jobs", "-1"],
    ):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(bad)
        assert exc.value.code == 2, bad


def test_sweep_flags_need_sweep(capsys):
    assert cli.main(["kernels", "--device", "cpu", "--sweep-T", "64"]) == 2
    err = capsys.readouterr().err
    assert "--sweep-T need(s) --sweep routing" in err and len(err.strip().splitlines()) == 1


def test_sweep_plot(tmp_path, synthetic):
    pytest.importorskip("matplotlib")
    out = routing_sweep_report.plot_sweep(synthetic, tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(out).shape[:2]
    assert w > h > 100  # 4 panels side by side: (index_shuffling, route) x (eager, graph)


def test_report_renders_a_sweep(tmp_path, synthetic):
    extra = {"sweep": "routing", "partial": True, "summary": rs.summarize(synthetic)}
    doc = make_document(
        "kernels",
        synthetic,
        environment("cpu"),
        columns=rs.COLUMNS,
        name="kernels-sweep-routing",
        cmdline="moe-bench kernels --sweep routing --jobs 16",
        extra=extra,
    )
    write_json(tmp_path / "box" / "sweep.json", doc)
    md = report.markdown_report(tmp_path)
    assert "## box" in md and "### kernels-sweep-routing" in md
    assert "```bash\nmoe-bench kernels --sweep routing --jobs 16\n```" in md
    assert "| op | dtype | E | k | T=1K | T=2K | T=4K | T=16K |" in md
    assert (
        "| route | bf16 | 8 | 1 | 10.0/5.00 10.0x! | - | 8.00/5.50 12.5x | 20.0/30.0 2.5x |" in md
    )
    assert "* worst cliff eager: 1.25 at route bf16 E=8 k=1 T=1024->4096 (a cliff)" in md
    assert "**Partial" in md
    assert "graph_status" not in md  # the raw rows are not dumped
