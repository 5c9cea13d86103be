"""Developer sessions: ``tests`` (every torch version, and the newest Triton), ``quick`` (a few
minutes' slice of it: one torch), ``interop`` (Hugging Face transformers on our kernels),
``benchmarks``, ``gpu`` (the GPU tests, on a CUDA machine), ``lint``, ``build``.

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
# folder under packages/ -> distribution name. PyPI's "moe-kernels" is an unrelated project
# (the same import name, moe_kernels): ours is "moe-kernels-triton".
DISTRIBUTIONS = {
    "moe-kernels": "moe-kernels-triton",
    "moe-model": "moe-model",
    "moe-tools": "moe-tools",
}
PACKAGES = tuple(DISTRIBUTIONS)

# torch version -> the triton that torch release was built against (pip's name differs on Windows).
# Newest first: ``nox -s tests`` runs the newest torch on PyPI first (what a fresh install gets).
TORCH_TRITON = {
    "2.14.1": ("triton==3.8.0", "triton-windows>=3.8,<3.9"),  # it requires triton ~= 3.8.0
    "2.13.0": ("triton==3.8.0", "triton-windows>=3.8,<3.9"),
    "2.9.1": ("triton==3.5.1", "triton-windows>=3.5,<3.6"),
}
TORCH_VERSIONS = list(TORCH_TRITON)
NEWEST_TORCH = TORCH_VERSIONS[0]
# A CPU build of torch that pins no Triton (PyPI's Linux builds of 2.14 require triton ~= 3.8):
# the session of the newest Triton runs beside it. This machine kind has its wheel on disk.
CPU_TORCH = "2.13.0"
# ``triton`` of a tests session: "pinned" (the torch release's own, what its CUDA builds run) or
# "latest" (the newest Triton on PyPI, what ``pip install moe-kernels-triton`` beside a CPU torch
# pulls). Each session: (kernel tests on the reference path, kernel tests in the interpreter,
# moe-model and moe-tools tests).
# * The newest torch runs everything but the interpreter; with its pinned Triton 3.8 the
#   reference-path run also compiles every GPU launch plan for sm_90a (test_compile_sm90.py),
#   and the optional packages are installed there (EXTRAS), so the plot and interop tests run.
# * The interpreter runs with the newest Triton (beside torch 2.13.0) and with the oldest
#   supported (torch 2.9.1's 3.5, whose interpreter needs workarounds of its own); the older one
#   leaves out the tests marked ``slow`` (the largest interpreter problems, and the reference
#   run's Inductor compiles of every routing plan): CI stays within its 25 minutes on two cores.
#   torch 2.13.0's reference path and model tests are not run: 2.9.1 and 2.14.1 bracket it.
TEST_MATRIX = {
    (NEWEST_TORCH, "pinned"): (True, False, True),
    (CPU_TORCH, "latest"): (False, True, False),
    **{(v, "pinned"): (True, True, True) for v in TORCH_VERSIONS[2:]},
}
# The session that installs the optional packages: matplotlib (the plot tests) and transformers
# (moe-model's ``hf`` extra: tests/test_hf.py and examples/hf_moe_backend.py; skipped elsewhere).
EXTRAS = (NEWEST_TORCH, "pinned")
EXTRA_PACKAGES = ("matplotlib", "transformers>=5,<6")

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


def _has_torch(session: nox.Session, torch_version: str) -> bool:
    """Whether the session's venv (a reused one: ``quick``) holds torch ``torch_version``."""
    query = "import importlib.metadata as m; print(m.version('torch'))"
    out = session.run("python", "-c", query, silent=True, success_codes=[0, 1]) or ""
    return out.strip().split("\n")[-1].split("+")[0] == torch_version  # 2.14.1, 2.14.1+cpu


def _install_torch(session: nox.Session, torch_version: str, triton: str = "pinned") -> None:
    """torch and its triton (or the newest Triton); skips the session (see CUDA_TORCH_PEAK_GIB)
    where a CUDA build would not fit on the disk (and is not installed already)."""
    requirements = _torch_requirements(torch_version, triton)
    free_gib = shutil.disk_usage(session.virtualenv.location).free / 2**30
    if (
        free_gib < CUDA_TORCH_PEAK_GIB
        and not _has_torch(session, torch_version)
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
    _install_packages(session, *(EXTRA_PACKAGES if (torch, triton) == EXTRAS else ()))
    workers = os.environ.get("MOE_TEST_WORKERS", "2")
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *session.posargs]
    env_ref = {"TRITON_INTERPRET": "0"}
    if reference:  # older torch: the ``slow`` sm_90a compiles (every routing plan) left out
        marks = [] if torch == NEWEST_TORCH else ["-m", "not slow"]
        session.run(*pytest, *marks, "packages/moe-kernels/tests", env=env_ref)
    if interpreter:
        marks = [] if triton == "latest" else ["-m", "not slow"]
        session.run(*pytest, *marks, "packages/moe-kernels/tests", env={"TRITON_INTERPRET": "1"})
    if others:
        session.run(*pytest, "packages/moe-model/tests", env=env_ref)
        session.run(*pytest, "packages/moe-tools/tests", env=env_ref)


# ``quick`` leaves out of its reference run the kernel tests that start fresh processes or
# compile with Inductor (they check imports and compiled graphs, and take most of that run's time
# on two cores), and runs in the interpreter only these files: the routing, token-movement and
# SwiGLU ops. The examples cover the other ops (those of moe_kernels in the interpreter too).
QUICK_SKIP = (
    "test_inductor_graph.py",
    "test_no_triton.py",
    "test_cold_compile_ops.py",
    "test_import_clean.py",
)
QUICK_INTERPRETER = ("test_routing.py", "test_tokens.py", "test_swiglu.py")


@nox.session(reuse_venv=True)
def quick(session: nox.Session) -> None:
    """A few minutes' check that the packages work, in one venv kept between runs: the newest
    torch (``NEWEST_TORCH``) with its pinned Triton; the examples (tests/test_examples.py), the
    kernel tests on the reference path but ``QUICK_SKIP`` and the ``slow`` ones, and the
    ``QUICK_INTERPRETER`` files in the interpreter. ``nox -s tests`` is the whole matrix."""
    _install_torch(session, NEWEST_TORCH)
    _install_packages(session)
    workers = os.environ.get("MOE_TEST_WORKERS", "2")
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *session.posargs]
    kernels = "packages/moe-kernels/tests"
    skip = [f"--ignore={kernels}/{name}" for name in QUICK_SKIP]
    examples = "packages/moe-tools/tests/test_examples.py"
    session.run(*pytest, "-m", "not slow", *skip, examples, kernels, env={"TRITON_INTERPRET": "0"})
    if HAS_TRITON_WHEELS:
        files = [f"{kernels}/{name}" for name in QUICK_INTERPRETER]
        session.run(*pytest, "-m", "not slow", *files, env={"TRITON_INTERPRET": "1"})


@nox.session(reuse_venv=True)
def interop(session: nox.Session) -> None:
    """transformers' MoE models on the ``"moe_kernels"`` experts backend (moe_model.hf): the
    parity tests against HF's eager experts and the example, newest torch, reference path.
    ``tests`` runs the same files in its newest-torch session."""
    _install_torch(session, NEWEST_TORCH)
    _install_packages(session, "transformers>=5,<6")
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", *session.posargs,
        "packages/moe-model/tests/test_hf.py", "packages/moe-model/tests/test_hf_blocks.py",
        "packages/moe-tools/tests/test_examples.py",
        "-k", "test_hf or hf_moe_backend", env={"TRITON_INTERPRET": "0"},
    )  # fmt: skip


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The pytest-benchmark suite in packages/moe-tools/benchmarks (tiny sizes on CPU, full sizes
    on CUDA); JSON into build/benchmarks/<machine>/pytest-benchmark.json. To publish it as this
    machine's current data (which ``moe-bench report`` renders): ``MOE_BENCH_SAVE=benchmarks/results
    nox -s benchmarks``."""
    torch = os.environ.get("MOE_BENCH_TORCH", NEWEST_TORCH)
    _install_torch(session, torch)
    _install_packages(session, "pytest-benchmark>=4", "tqdm", "matplotlib")
    machine = session.run(
        "python", "-c", "from moe_tools.env import machine_slug; print(machine_slug())", silent=True
    )
    save = Path(os.environ.get("MOE_BENCH_SAVE", "build/benchmarks"))
    out = (save if save.is_absolute() else ROOT / save) / machine.strip().splitlines()[-1]
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


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU tests (``-m gpu``: packages/*/tests/gpu and the ``gpu`` cases elsewhere) in this
    interpreter, nothing installed: the three packages' sources on PYTHONPATH, as on the device
    machine. ``MOE_GPU_FULL=1`` adds the large cases; posargs go to pytest (``-k``, ``-x``)."""
    src = os.pathsep.join(str(ROOT / "packages" / pkg / "src") for pkg in PACKAGES)
    session.run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
        *session.posargs, "packages/moe-kernels/tests", "packages/moe-model/tests",
        "packages/moe-tools/tests/test_examples.py",
        env={"PYTHONPATH": src, "TRITON_INTERPRET": "0"}, external=True,
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _fresh_venv(session: nox.Session, name: str) -> list[str]:
    """A new venv under the session's tmp folder; its ``python -m pip install -q`` command."""
    venv = Path(session.create_tmp()) / name
    session.run(sys.executable, "-m", "venv", "--clear", str(venv), external=True)
    py = str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))
    return [py, "-m", "pip", "install", "-q"]


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of the three packages into dist/, then two fresh venvs prove the
    installs (beside torch 2.13.0 and its Triton):
    1. moe-kernels-triton's wheel alone imports, declares torch and Triton only, and runs an op;
    2. moe-model's wheel, with stand-ins of PyPI's unrelated ``moe-kernels`` (0.1.1, 0.8.2)
       offered to pip and not our kernels wheel, is refused (nothing provides
       moe-kernels-triton); with dist/ offered too, moe-model's and moe-tools' wheels take our
       moe-kernels-triton, never the stand-ins, and a layer and ``moe-bench verify`` run."""
    session.install("build>=1")
    dist = ROOT / "dist"
    for pkg in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT / "packages" / pkg))
    wheels = {
        pkg: str(sorted(dist.glob(f"{name.replace('-', '_')}-*.whl"))[-1])
        for pkg, name in DISTRIBUTIONS.items()
    }
    base = _torch_requirements(CPU_TORCH)

    pip = _fresh_venv(session, "kernels-only")
    session.run(*pip, *base, external=True)
    session.run(*pip, wheels["moe-kernels"], external=True)
    session.run(pip[0], str(ROOT / ".ci" / "check_kernels_wheel.py"), external=True)

    decoys = Path(session.create_tmp()) / "decoys"
    session.run("python", str(ROOT / ".ci" / "decoy_wheels.py"), str(decoys))
    pip = _fresh_venv(session, "model-and-tools")
    session.run(*pip, *base, "safetensors>=0.4", "tqdm>=4", external=True)
    offline = ["--no-index", "--find-links", str(decoys)]
    refused = session.run(
        *pip, *offline, wheels["moe-model"], external=True, success_codes=[1], silent=True
    )
    if "moe-kernels-triton" not in (refused or ""):
        session.error(f"moe-model's wheel without ours should be refused; pip said: {refused}")
    session.log("moe-model without our kernels wheel: refused, the stand-ins not taken")
    session.run(
        *pip, *offline, "--find-links", str(dist), wheels["moe-model"], wheels["moe-tools"],
        external=True,
    )  # fmt: skip
    session.run(pip[0], str(ROOT / ".ci" / "check_install.py"), external=True)
