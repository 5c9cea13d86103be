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


def test_private_reads_finds_each_form(tmp_path):
    """The forms a reader can take, in a package of two modules beside moe_kernels: a name
    imported from another module, an attribute through an imported module, and another
    distribution's private module, imported or reached as an attribute."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\npublic = 2\n")
    (pkg / "b.py").write_text(
        "import moe_kernels\nfrom moe_kernels import reference\nfrom pkg import a\n"
        "from pkg.a import _hidden, public\n"
        "x = a._hidden + a.public + public\n"
        "y = moe_kernels._dispatch.use_triton\n"
        "from moe_kernels._dispatch import INTERPRET\n"
    )
    found = {(r.line, r.name) for r in private_reads(pkg, {"moe_kernels": ROOT})}
    assert found == {(4, "pkg.a._hidden"), (5, "pkg.a._hidden"), (6, "moe_kernels._dispatch"),
                     (7, "moe_kernels._dispatch.INTERPRET")}  # fmt: skip
