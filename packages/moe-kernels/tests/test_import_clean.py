"""``import moe_kernels`` (and ``moe_model``, where installed) prints no warning, numpy installed
or not (a kernels-only install has torch and Triton only; torch itself warns at import where
numpy is missing); without numpy, the interpreter's kernels say what to install."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_IMPORT = """
import sys
if {hide_numpy}:
    sys.modules["numpy"] = None  # `import numpy` now raises ImportError, as when not installed
import warnings
warnings.simplefilter("error")
import {module}
"""


@pytest.mark.parametrize("module", ["moe_kernels", "moe_model"])
@pytest.mark.parametrize("hide_numpy", [True, False], ids=["no-numpy", "numpy"])
def test_import_warns_nothing(hide_numpy, module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    code = _IMPORT.format(hide_numpy=hide_numpy, module=module)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and not run.stderr.strip(), run.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_interpreter_without_numpy_says_what_to_install():
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch, moe_kernels as mk\n"
        "try:\n    mk.route(torch.rand(4, 3), 2)\n"
        "except RuntimeError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0 and "pip install numpy" in run.stdout, run.stdout + run.stderr
