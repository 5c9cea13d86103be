"""`moe-bench train` on tiny CPU sizes: the rows and JSON, the convergence run, the checks the
command must catch (a backward that raises, a non-repeatable backward), the report section."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math

import pytest
import torch

from moe_tools import cli, report
from moe_tools.results import SCHEMA
from moe_tools.train import measure
from moe_tools.train import report as train_report

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
IMPLS = ["baseline", "torch", "triton_bf16", "triton_fp32", "mxfp8", "fbgemm"]
STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny GEMMs are faster alone than with two OpenMP threads that
    share two cores with other test workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """One CLI run on the tiny preset: (stdout, JSON document, results folder)."""
    out = tmp_path_factory.mktemp("train")
    argv = [
        "train",
        "--device",
        "cpu",
        "--no-progress",
        "--impls",
        ",".join(IMPLS),
        "--steps",
        str(STEPS),
        "--warmup",
        "1",
        "--iters",
        "2",
        "--compile-backend",
        "aot_eager",
        "--json",
        str(out / "train.json"),
    ]
    if HAS_MPL:  # the plot is optional (moe-tools[plot]); CI's test sessions lack matplotlib
        argv += ["--plot", str(out / "train.png")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(argv) == 0
    return stdout.getvalue(), json.loads((out / "train.json").read_text()), out


def _rows(doc):
    return {r["impl"]: r for r in doc["rows"]}


def _backward_works(impl: str) -> bool | None:
    """Whether ``impl`` backpropagates here today (None: it cannot even be selected)."""
    from moe_model import MoELayer

    layer = MoELayer(64, 8, 2, 32, impl="baseline")
    try:
        layer.impl = impl
    except Exception:
        return None
    x = torch.randn(8, 64, requires_grad=True)
    try:
        layer(x).sum().backward()
    except Exception:
        return False
    return True


def test_parser():
    p = cli.build_parser()
    args = p.parse_args(["train", "--preset", "training", "--experts", "4", "--top-k", "1"])
    assert args.preset == "training" and args.experts == 4 and args.top_k == 1
    assert args.steps is None and args.lr is None and not args.gated
    args = p.parse_args(["train", "--steps", "0", "--lr", "3e-3", "--gated", "--renormalize"])
    assert args.steps == 0 and args.lr == 3e-3 and args.gated and args.renormalize
    for bad in (["train", "--lr", "0"], ["train", "--preset", "huge"], ["train", "--tokens", "0"]):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(bad)
        assert exc.value.code == 2, bad


def test_layer_config_and_defaults():
    assert measure.layer_config("seed-moe") == dict(
        tokens=2048, d_model=2048, n_experts=16, top_k=8, hidden=1024, gated=False,
        renormalize=False,
    )  # fmt: skip
    cfg = measure.layer_config("training", tokens=128, gated=True)
    assert (cfg["tokens"], cfg["n_experts"], cfg["hidden"], cfg["gated"]) == (128, 128, 768, True)
    with pytest.raises(ValueError):
        measure.layer_config("nope")
    assert measure.default_lr(64) == pytest.approx(0.01)


def test_rel_err():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert measure.rel_err(ref.clone(), ref) == 0.0
    assert measure.rel_err(torch.tensor([1.0, -4.0, 3.0]), ref) == pytest.approx(0.25)
    assert measure.rel_err(None, ref) == math.inf
    assert measure.rel_err(ref[:2], ref) == math.inf
    assert measure.rel_err(torch.tensor([1.0, math.nan, 2.0]), ref) == math.inf
    assert measure.rel_err(ref, None) is None
    assert measure.rel_err(torch.tensor([0.5]), torch.zeros(1)) == 0.5  # zero ref: absolute


def test_cli_prints_table_and_writes_json(train_run):
    stdout, doc, out = train_run
    assert "# torch" in stdout  # the environment header
    assert "grad_router_err" in stdout and "bitwise" in stdout
    assert "# graph, every impl measured: " + measure.CPU_GRAPH_STATUS in stdout
    assert "# loss torch at steps 0," in stdout
    assert f"# wrote {out / 'train.json'}" in stdout
    assert f"# wrote {out / 'train.png'}" in stdout or not HAS_MPL
    assert doc["schema"] == SCHEMA and doc["command"] == "train"
    assert doc["columns"] == measure.COLUMNS
    assert [r["impl"] for r in doc["rows"]] == IMPLS
    for r in doc["rows"]:
        assert set(r) == set(measure.COLUMNS)
    extra = doc["extra"]
    assert extra["tokens"] == 64 and extra["dtype"] == "float32" and extra["steps"] == STEPS
    assert extra["layer"] == dict(
        d_model=64, n_experts=8, top_k=2, hidden=32, gated=False, renormalize=False
    )
    assert extra["compile_backend"] == "aot_eager" and extra["lr"] == pytest.approx(0.01)
    assert extra["error_measure"] == measure.ERROR_MEASURE
    if HAS_MPL:
        assert extra["plot"] == str(out / "train.png") and (out / "train.png").stat().st_size > 0
    assert doc["args"]["command"] == "train"


def test_baseline_and_torch_rows(train_run):
    rows = _rows(train_run[1])
    base, tor = rows["baseline"], rows["torch"]
    # the baseline in fp32 is the reference itself: no error, repeatable, not fullgraph-compilable
    assert base["status"] == "ok", base["status"]
    for col in ("y_err", *measure.ERR_COLUMNS.values()):
        assert base[col] == 0.0, col
        assert 0.0 <= tor[col] < 1e-5, (col, tor[col])
    assert base["bitwise"] is True and tor["bitwise"] is True
    assert base["compile_status"].startswith("expected: ") and base["compiled_ms"] is None
    assert base["eager_ms"] > 0 and base["peak_mem_gib"] is None  # CPU: no allocator figures
    # torch: differentiable, sync-free, compiled forward and backward
    assert tor["status"] == "ok" and tor["compile_status"] == "ok", tor
    assert tor["eager_ms"] > 0 and tor["compiled_ms"] > 0 and tor["compile_s"] > 0
    assert tor["speedup"] == pytest.approx(tor["eager_ms"] / tor["compiled_ms"])
    for r in (base, tor):
        assert r["graph_ms"] is None and r["graph_status"] == measure.CPU_GRAPH_STATUS


def test_loss_decreases(train_run):
    doc = train_run[1]
    curves = doc["extra"]["loss_curves"]
    rows = _rows(doc)
    for impl in ("baseline", "torch"):
        curve = curves[impl]
        assert len(curve) == STEPS and all(math.isfinite(v) for v in curve)
        assert curve[-1] < 0.8 * curve[0], curve
        assert sum(curve[-3:]) < sum(curve[:3]), curve
        assert rows[impl]["loss_first"] == curve[0] and rows[impl]["loss_last"] == curve[-1]
    # same start, inputs and targets: fp32 rounding alone separates the two curves
    for a, b in zip(curves["baseline"], curves["torch"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.parametrize(
    ("impl", "tol"), [("triton_bf16", 2e-2), ("triton_fp32", 1e-5), ("mxfp8", 0.2)]
)
def test_kernel_impls_as_they_stand(train_run, impl, tol):
    """Whatever the impl's backward does today: a row that says it cannot backpropagate, or one
    measured like the others (fp32 CPU run; mxfp8 quantises, bf16 rounds its output)."""
    row = _rows(train_run[1])[impl]
    works = _backward_works(impl)
    if not works:
        assert row["status"].startswith("no backward: " if works is False else "unavailable: ")
        assert row["eager_ms"] is None and row["grad_x_err"] is None
        assert impl not in train_run[1]["extra"]["loss_curves"]
        return
    assert row["status"] == "ok", row["status"]
    for col in ("y_err", *measure.ERR_COLUMNS.values()):
        assert 0.0 <= row[col] < tol, (col, row[col])
    assert row["bitwise"] is True  # the moe-kernels paths are deterministic
    assert row["eager_ms"] > 0 and row["compile_status"] == "ok"
    curve = train_run[1]["extra"]["loss_curves"][impl]
    assert len(curve) == STEPS and curve[-1] < 0.8 * curve[0]


def test_fbgemm_row(train_run):
    row = _rows(train_run[1])["fbgemm"]
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        assert row["status"].startswith("unavailable: ") and "fbgemm_gpu" in row["status"]
        assert row["eager_ms"] is None and row["bitwise"] is None


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom: no backward here")


def test_backward_failure_and_non_repeatability_are_caught(monkeypatch):
    """A backward that raises fails its own row only; noise in the output shows in bitwise."""
    from moe_model import MoELayer

    real = MoELayer.forward

    def patched(self, x):
        y = real(self, x)
        if self.impl == "torch":
            return _Boom.apply(y)
        if self.impl == "triton_fp32":  # stands for a non-deterministic implementation
            return y + 1e-3 * torch.rand_like(y)
        return y

    monkeypatch.setattr(MoELayer, "forward", patched)
    res = measure.run(
        device="cpu",
        impls=["torch", "triton_fp32", "baseline"],
        warmup=1,
        iters=1,
        steps=2,
        compile=False,
        progress=False,
    )
    rows = {r["impl"]: r for r in res.rows}
    assert rows["torch"]["status"] == "no backward: RuntimeError: boom: no backward here"
    assert rows["torch"]["eager_ms"] is None and "torch" not in res.extra["loss_curves"]
    if _backward_works("triton_fp32"):
        assert rows["triton_fp32"]["bitwise"] is False
        assert rows["triton_fp32"]["y_err"] > 0
    base = rows["baseline"]
    assert base["status"] == "ok" and base["bitwise"] is True and base["eager_ms"] > 0
    assert base["compile_status"] == "skipped: --no-compile"
    assert len(res.extra["loss_curves"]["baseline"]) == 2


def test_report_renders_train_section(train_run, tmp_path):
    _, doc, out = train_run
    text = report.markdown_report(out)
    assert "### train-tiny-" + "+".join(IMPLS) in text
    assert "| impl | eager_ms | compiled_ms | graph_ms |" in text
    assert f"Convergence run ({STEPS} AdamW steps)" in text
    assert "| step | " + " | ".join(doc["extra"]["loss_curves"]) + " |" in text
    if HAS_MPL:
        assert f"![moe-bench train loss curves]({(out / 'train.png').as_posix()})" in text
    assert f"* errors (*_err): {measure.ERROR_MEASURE}" in text
    # through the CLI too, and without the figure no image link
    (tmp_path / "train.json").write_text(json.dumps(doc))
    md = tmp_path / "BENCH.md"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["report", "--results", str(tmp_path), "--out", str(md)]) == 0
    page = md.read_text()
    assert "Convergence run" in page and "![" not in page


def test_loss_rows_and_format_rows():
    rows, cols = train_report.loss_rows({"a": [4.0, 3.0, 2.0, 1.0], "b": [5.0, 1.0]}, points=3)
    assert cols == ["step", "a", "b"]
    assert rows == [
        {"step": 0, "a": 4.0, "b": 5.0},
        {"step": 2, "a": 2.0, "b": None},  # b stopped early
        {"step": 3, "a": 1.0, "b": None},
    ]
    assert train_report.loss_rows({}) == ([], ["step"])
    text = train_report.format_rows(
        [
            {"impl": "a", "status": "ok", "compile_status": "ok", "graph_status": "skipped: x"},
            {"impl": "b", "status": "ok", "compile_status": "failed: y", "graph_status": "ok"},
        ],
        ["impl", "status", "compile_status", "graph_status"],
    )
    assert "compile_status" not in text.splitlines()[0]
    assert "# compiled, b: failed: y" in text and "# graph, a: skipped: x" in text
    assert "# compiled, a" not in text and "# graph, b" not in text
