"""Results as data: what a command returns, the JSON document it saves, where saved results live.

Published results are current data: one file per command and machine,
``<folder>/<machine>/<name>.json`` (``--save FOLDER``; the name comes from the command's
arguments), overwritten when the command is run again. ``moe-bench report`` renders a folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_tools.tables import Row, columns_of

SCHEMA = "moe-bench/2"  # /1: the same document without name, commit and our versions in env
SCHEMAS = ("moe-bench/1", SCHEMA)
RESULTS = Path("benchmarks") / "results"  # the repository's folder of published results


@dataclass
class Result:
    """What a command returns: its rows, the columns to print (in order), and extra data that is
    not a row (a ceiling, a per-frame series), all JSON-able. ``text``, when set, is printed
    instead of the rows' table (a sweep's compact pivot); the JSON keeps the rows."""

    command: str
    rows: list[Row]
    columns: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    text: str | None = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/inf
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (torch.device, torch.dtype, Path)):
        return str(value)
    return value


def make_document(
    command: str,
    rows: Sequence[Mapping[str, Any]],
    env: Mapping[str, Any],
    *,
    name: str | None = None,
    columns: Sequence[str] | None = None,
    args: Mapping[str, Any] | None = None,
    cmdline: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of a result: rows plus the environment (date, commit, versions)."""
    return _jsonable(
        {
            "schema": SCHEMA,
            "command": command,
            "name": name or command,
            "cmdline": cmdline if cmdline is not None else " ".join(["moe-bench", *sys.argv[1:]]),
            "args": dict(args or {}),
            "env": dict(env),
            "columns": columns_of(rows, columns),
            "rows": [dict(r) for r in rows],
            "extra": dict(extra or {}),
        }
    )


def write_json(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write ``document`` (strict JSON, indented) to ``path``, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False) + "\n")
    return out


def load(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it cannot be read or is not an object."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_pytest_benchmark(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` is pytest-benchmark's JSON (``nox -s benchmarks``)."""
    return "benchmarks" in doc and "machine_info" in doc


def documents(folder: str | os.PathLike[str]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(path, document) of every moe-bench or pytest-benchmark JSON file under ``folder``, in
    path order; other files are skipped."""
    for path in sorted(Path(folder).rglob("*.json")):
        doc = load(path) if path.is_file() else None
        if doc is not None and (doc.get("schema") in SCHEMAS or is_pytest_benchmark(doc)):
            yield path, doc


def slug(*parts: object) -> str:
    """A file-name-safe result name from its parts: 'matrix', 'seed-moe', ['torch', 'triton_bf16']
    -> 'matrix-seed-moe-torch+triton_bf16'; None and empty parts are left out."""
    words = []
    for part in parts:
        if part is None or part == [] or part == "":
            continue
        text = "+".join(map(str, part)) if isinstance(part, (list, tuple)) else str(part)
        words.append(re.sub(r"[^A-Za-z0-9_.+=,-]", "_", text))
    return "-".join(words)


def saved_path(folder: str | os.PathLike[str], machine: str, name: str) -> Path:
    """Where ``--save folder`` writes: ``folder/<machine>/<name>.json``."""
    return Path(folder) / machine / f"{name}.json"
