"""A package's layering, read from its source: import cycles between its modules and reads of
other modules' underscore names. ``moe_kernels``, ``moe_model`` and ``moe_tools`` each test
themselves with these (a module's private names are its own; a private module, such as
``moe_kernels._triton``, is its package's own: another distribution imports none)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple


class PrivateRead(NamedTuple):
    """``path``:``line`` reads ``name``, private to another module or distribution."""

    path: str
    line: int
    name: str


def _modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of the package whose folder is ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _source(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def import_cycle(root: Path) -> list[str] | None:
    """One import cycle between the package's modules (function-level imports included; a
    package importing its own submodules is not one), as the modules in order, or None."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                src = _source(name, path, node)
                subs = {f"{src}.{a.name}" for a in node.names} & set(mods)
                deps |= subs or ({src} & set(mods))
        deps.discard(name)
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack, node, nxt]
            if nxt not in state and (found := visit(nxt, [*stack, node])):
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [])):
            return found
    return None


def private_reads(root: Path, roots: dict[str, Path] | None = None) -> list[PrivateRead]:
    """Every read in the package at ``root`` of another module's underscore name (``from m
    import _x``, ``m._x`` through an imported module ``m``), and every import of another
    distribution's private module (``moe_kernels._dispatch`` from moe_tools). ``roots``:
    {package: folder} of the other distributions to resolve modules in (default: none, then
    imports from them are judged by their dotted names alone)."""
    own = root.name
    known = {own: root, **(roots or {})}

    def is_module(dotted: str) -> bool:
        top, *rest = dotted.split(".")
        if top not in known:
            return False
        path = known[top].joinpath(*rest)
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    found = []
    for module, path in _modules(root).items():
        tree = ast.parse(path.read_text())
        where = str(path)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _source(module, path, node)
                if src == "__future__" or src.split(".")[0] not in known:
                    continue
                foreign = src.split(".")[0] != own
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if is_module(full):
                        aliases[a.asname or a.name] = full
                        if foreign and _private(full):
                            found.append(PrivateRead(where, node.lineno, full))
                    elif (a.name.startswith("_") and not a.name.startswith("__")) or (
                        foreign and _private(src)
                    ):
                        found.append(PrivateRead(where, node.lineno, full))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top not in known:
                        continue
                    aliases[a.asname or top] = a.name if a.asname else top
                    if top != own and _private(a.name):
                        found.append(PrivateRead(where, node.lineno, a.name))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__"):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *reversed(chain)])
                # a name of another module, or (another distribution's) private module
                submodule = is_module(f"{target}.{node.attr}")
                if is_module(target) and (not submodule or target.split(".")[0] != own):
                    found.append(PrivateRead(where, node.lineno, f"{target}.{node.attr}"))
    return found
