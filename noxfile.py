"""Developer sessions: ``tests`` (every torch version), ``benchmarks``, ``lint``, ``build``.

Kernel tests run twice: on the torch reference path, then on the Triton kernels through the
interpreter (``TRITON_INTERPRET=1``), so CI exercises the kernels without a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ("moe-kernels", "moe-model", "moe-tools")

# torch version -> the triton that torch release was built against (pip's name differs on Windows).
TORCH_TRITON = {
    "2.9.1": ("triton==3.5.1", "triton-windows>=3.5,<3.6"),
    "2.13.0": ("triton==3.8.0", "triton-windows>=3.8,<3.9"),
}
TORCH_VERSIONS = list(TORCH_TRITON)

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "virtualenv"


def _install_torch(session: nox.Session, torch_version: str) -> None:
    linux, windows = TORCH_TRITON[torch_version]
    session.install(f"torch=={torch_version}", windows if sys.platform == "win32" else linux)


def _install_packages(session: nox.Session, *extras: str) -> None:
    """The three packages from their local paths (editable), plus test tools."""
    args = []
    for pkg in PACKAGES:
        args += ["-e", str(ROOT / "packages" / pkg)]
    session.install(*args, "pytest>=7", "hypothesis>=6", "numpy", *extras)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """Every package's tests; kernel tests on the reference path and in Triton's interpreter."""
    _install_torch(session, torch)
    _install_packages(session)
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", *session.posargs]
    env_ref = {"TRITON_INTERPRET": "0"}
    session.run(*pytest, "packages/moe-kernels/tests", env=env_ref)
    session.run(*pytest, "packages/moe-kernels/tests", env={"TRITON_INTERPRET": "1"})
    session.run(*pytest, "packages/moe-model/tests", env=env_ref)
    session.run(*pytest, "packages/moe-tools/tests", env=env_ref)


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The pytest-benchmark suite in packages/moe-tools/benchmarks (tiny sizes on CPU, full sizes
    on CUDA); JSON into benchmarks/results/<machine>-<date>/ (render it with
    ``moe-bench report --results benchmarks/results/<dir> --out BENCHMARKS.md``)."""
    torch = os.environ.get("MOE_BENCH_TORCH", TORCH_VERSIONS[-1])
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
    linux, windows = TORCH_TRITON[TORCH_VERSIONS[-1]]
    pip = [py, "-m", "pip", "install", "-q"]
    session.run(*pip, f"torch=={TORCH_VERSIONS[-1]}", external=True)
    session.run(*pip, str(wheel), external=True)
    session.run(py, str(ROOT / ".ci" / "check_kernels_wheel.py"), external=True)
