"""moe_model's layering: no import cycle, no read of another module's underscore names, no
import of moe_kernels' private modules (``moe_kernels.testing.layering``)."""

from pathlib import Path

import moe_kernels
import moe_model
from moe_kernels.testing.layering import import_cycle, private_reads

ROOT = Path(moe_model.__file__).parent


def test_no_import_cycle():
    assert import_cycle(ROOT) is None


def test_no_private_reads():
    assert private_reads(ROOT, {"moe_kernels": Path(moe_kernels.__file__).parent}) == []
