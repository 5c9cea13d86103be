"""moe_kernels' layering (``moe_kernels.testing.layering``): no import cycle between its modules,
no module reading another's underscore names (composites call other ops through their public
``KernelOp``). The checks find the cycle and the 19 reads of c46f94e."""

from pathlib import Path

import moe_kernels
from moe_kernels.testing.layering import import_cycle, private_reads

ROOT = Path(moe_kernels.__file__).parent


def test_no_import_cycle():
    assert import_cycle(ROOT) is None


def test_no_private_reads():
    assert private_reads(ROOT) == []
