"""``import moe_kernels`` prints no warning, numpy installed or not (a kernels-only install has
torch and Triton only; torch itself warns at import where numpy is missing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_IMPORT = """
import sys
if {hide_numpy}:
    sys.modules["numpy"] = None  # `import numpy` now raises ImportError, as when not installed
import warnings
warnings.simplefilter("error")
import moe_kernels
"""


@pytest.mark.parametrize("hide_numpy", [True, False], ids=["no-numpy", "numpy"])
def test_import_warns_nothing(hide_numpy):
    code = _IMPORT.format(hide_numpy=hide_numpy)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and not run.stderr.strip(), run.stderr[-2000:]
