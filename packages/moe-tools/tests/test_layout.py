"""The package's shape: moe_tools' modules import each other without a cycle (function-level
imports included), read no underscore name of another module and import no private module of
moe_kernels or moe_model (what they need is public: ``moe_kernels.reference``,
``moe_kernels.testing``), and every command module is listed once."""

from __future__ import annotations

import ast
from pathlib import Path

import moe_kernels
import moe_model
import moe_tools
from moe_kernels.testing.layering import private_reads
from moe_tools import cli
from moe_tools.commands import MEASURING

ROOT = Path(moe_tools.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """moe_tools modules imported anywhere in ``path`` (``from moe_tools import x`` names x when x
    is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or {node.module}
    return found


def test_no_import_cycles():
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}
    for name in graph:  # a package imports its own submodules: not a cycle through them
        if paths[name].name == "__init__.py":
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*stack, node, nxt])
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_private_reads():
    others = {m.__name__: Path(m.__file__).parent for m in (moe_kernels, moe_model)}
    assert private_reads(ROOT, others) == []


def test_every_command_once():
    names = [c.name for c in MEASURING]
    assert len(names) == len(set(names)) and set(cli.COMMANDS) == {*names, "report"}
