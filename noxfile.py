"""Developer sessions: ``tests`` (every torch version, and the newest Triton), ``benchmarks``,
``lint``, ``build``.

Kernel tests run on the torch reference path and on the Triton kernels through the interpreter
(``TRITON_INTERPRET=1``), so CI exercises the kernels without a GPU; ``TEST_MATRIX`` says which
session runs which.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ("moe-kernels", "moe-model", "moe-tools")

# torch version -> the triton that torch release was built against (pip's name differs on Windows).
# Newest first: ``nox -s tests`` runs the main version before the older one.
TORCH_TRITON = {
    "2.13.0": ("triton==3.8.0", "triton-windows>=3.8,<3.9"),
    "2.9.1": ("triton==3.5.1", "triton-windows>=3.5,<3.6"),
}
TORCH_VERSIONS = list(TORCH_TRITON)
NEWEST_TORCH = TORCH_VERSIONS[0]
# ``triton`` of a tests session: "pinned" (the torch release's own, what its CUDA builds run) or
# "latest" (the newest Triton on PyPI, what ``pip install moe-kernels`` beside a CPU torch pulls).
# The kernels' interpreter tests run with the newest Triton and with the oldest supported (torch
# 2.9.1's 3.5, whose interpreter needs workarounds of its own); with torch 2.13's pinned 3.8 the
# reference-path run compiles every GPU launch plan for sm_90a instead (test_compile_sm90.py).
# Each session: (kernel tests on the reference path, kernel tests in the interpreter, moe-model
# and moe-tools tests). The older torch's interpreter run leaves out the tests marked ``slow``
# (the largest interpreter problems, which the newest Triton's run keeps): CI stays within its
# 25 minutes on two cores.
TEST_MATRIX = {
    (NEWEST_TORCH, "pinned"): (True, False, True),
    (NEWEST_TORCH, "latest"): (False, True, False),
    **{(v, "pinned"): (True, True, True) for v in TORCH_VERSIONS[1:]},
}

# On Linux x86_64 PyPI's torch wheels are CUDA builds: torch 2.9.1 with its nvidia-* wheels took
# 6.7 GiB installed and peaked at 10.4 GiB of disk while pip installed it without a cache (pip's
# cache keeps another ~3.9 GiB of wheels). A CPU-only machine with less room skips that version's
# session and says why, unless MOE_NOX_STRICT=1, which makes a missing version a failure.
CUDA_TORCH_PEAK_GIB = 11 if os.environ.get("PIP_NO_CACHE_DIR", "") not in ("", "0") else 15

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "virtualenv"


# Triton publishes wheels for Linux (triton) and Windows (triton-windows) only: elsewhere (macOS)
# the sessions install torch alone and run the reference path, as ``pip install moe-kernels`` does.
HAS_TRITON_WHEELS = sys.platform in ("linux", "win32")


def _torch_requirements(torch_version: str, triton: str = "pinned") -> list[str]:
    linux, windows = TORCH_TRITON[torch_version]
    if triton == "latest":
        linux, windows = "triton", "triton-windows"
    if not HAS_TRITON_WHEELS:
        return [f"torch=={torch_version}"]
    return [f"torch=={torch_version}", windows if sys.platform == "win32" else linux]


def _pulls_cuda_wheels(session: nox.Session, requirements: list[str]) -> bool:
    """Whether pip would install nvidia-* wheels for ``requirements`` (a dry-run resolve, which
    reads metadata only); False when the resolve itself fails (the real install then reports)."""
    report = Path(session.create_tmp()) / "torch-resolve.json"
    try:
        session.run(
            "python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
            "--report", str(report), *requirements, silent=True,
        )  # fmt: skip
        names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    except Exception:
        return False
    return any(name.lower().startswith("nvidia-") for name in names)


def _install_torch(session: nox.Session, torch_version: str, triton: str = "pinned") -> None:
    """torch and its triton (or the newest Triton); skips the session (see CUDA_TORCH_PEAK_GIB)
    where a CUDA build would not fit on the disk."""
    requirements = _torch_requirements(torch_version, triton)
    free_gib = shutil.disk_usage(session.virtualenv.location).free / 2**30
    if (
        free_gib < CUDA_TORCH_PEAK_GIB
        and platform.machine() in ("x86_64", "AMD64")
        and _pulls_cuda_wheels(session, requirements)
    ):
        why = (
            f"torch {torch_version} resolves to a CUDA build here (nvidia-* wheels), which needs "
            f"about {CUDA_TORCH_PEAK_GIB} GiB of free disk to install; {free_gib:.1f} GiB are free"
        )
        if os.environ.get("MOE_NOX_STRICT", "0") not in ("", "0"):
            session.error(why)
        session.skip(why)
    session.install(*(["--upgrade"] if triton == "latest" else []), *requirements)
    versions = "import torch; print('torch', torch.__version__)"
    if HAS_TRITON_WHEELS:
        versions += "; import triton; print('triton', triton.__version__)"
    session.run("python", "-c", versions)


def _install_packages(session: nox.Session, *extras: str) -> None:
    """The three packages from their local paths (editable), plus test tools."""
    args = []
    for pkg in PACKAGES:
        args += ["-e", str(ROOT / "packages" / pkg)]
    session.install(*args, "pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "numpy", *extras)


@nox.session
@nox.parametrize("torch,triton", list(TEST_MATRIX))
def tests(session: nox.Session, torch: str, triton: str) -> None:
    """The tests of every package, as ``TEST_MATRIX`` divides them between the sessions. Two
    pytest workers: the interpreter is single-threaded numpy, and CI's machine has two cores."""
    reference, interpreter, others = TEST_MATRIX[(torch, triton)]
    interpreter = interpreter and HAS_TRITON_WHEELS
    _install_torch(session, torch, triton)
    _install_packages(session)
    workers = os.environ.get("MOE_TEST_WORKERS", "2")
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *session.posargs]
    env_ref = {"TRITON_INTERPRET": "0"}
    if reference:
        session.run(*pytest, "packages/moe-kernels/tests", env=env_ref)
    if interpreter:
        marks = [] if torch == NEWEST_TORCH else ["-m", "not slow"]
        session.run(*pytest, *marks, "packages/moe-kernels/tests", env={"TRITON_INTERPRET": "1"})
    if others:
        session.run(*pytest, "packages/moe-model/tests", env=env_ref)
        session.run(*pytest, "packages/moe-tools/tests", env=env_ref)


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The pytest-benchmark suite in packages/moe-tools/benchmarks (tiny sizes on CPU, full sizes
    on CUDA); JSON into benchmarks/results/<machine>-<date>/ (render it with
    ``moe-bench report --results benchmarks/results/<dir> --out BENCHMARKS.md``)."""
    torch = os.environ.get("MOE_BENCH_TORCH", NEWEST_TORCH)
    _install_torch(session, torch)
    _install_packages(session, "pytest-benchmark>=4", "tqdm", "matplotlib")
    folder = session.run(
        "python",
        "-c",
        "from moe_tools.report import results_folder; print(results_folder())",
        silent=True,
    )
    out = ROOT / folder.strip().splitlines()[-1]
    out.mkdir(parents=True, exist_ok=True)
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(ROOT / "packages" / "moe-tools" / "benchmarks"),
        f"--benchmark-json={out / 'pytest-benchmark.json'}",
        "--benchmark-columns=median,min,rounds",
        "--benchmark-sort=name",
        *session.posargs,
        env={"TRITON_INTERPRET": "0"},
    )
    session.log(f"results: {out}")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of all three packages into dist/, then install the moe-kernels wheel
    alone into a fresh venv (beside the CPU torch) and import it."""
    session.install("build>=1")
    dist = ROOT / "dist"
    for pkg in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT / "packages" / pkg))
    wheel = sorted(dist.glob("moe_kernels-*.whl"))[-1]
    venv = Path(session.create_tmp()) / "kernels-only"
    session.run(sys.executable, "-m", "venv", "--clear", str(venv), external=True)
    py = str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))
    pip = [py, "-m", "pip", "install", "-q"]
    session.run(*pip, f"torch=={NEWEST_TORCH}", external=True)
    session.run(*pip, str(wheel), external=True)
    session.run(py, str(ROOT / ".ci" / "check_kernels_wheel.py"), external=True)
