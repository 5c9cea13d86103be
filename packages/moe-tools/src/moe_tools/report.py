"""``moe-bench report``: one markdown page from one folder of saved results.

The folder holds current data: ``<machine>/<name>.json``, one file per published command and
machine (``moe-bench <command> --save <folder>``), and pytest-benchmark's JSON (``nox -s
benchmarks``). The page has an index (each result, its date and commit), then per machine per
command one section: when and on what it ran, the command line, and the body the command's own
module renders (``Command.markdown``). A ``README.md`` in the folder is put at the top of the page
(what the data is, where its history lives). Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_tools.command import Command, UsageError, input_dir, markdown_rows, output_path
from moe_tools.commands import BY_NAME, MEASURING
from moe_tools.env import versions_line
from moe_tools.results import RESULTS, documents, is_pytest_benchmark
from moe_tools.tables import Row, markdown_table

ORDER = {c.name: i for i, c in enumerate(MEASURING)}


def _pytest_benchmark_groups(doc: Mapping[str, Any]) -> dict[str, list[Row]]:
    """pytest-benchmark results as rows, one table per test function (its own extra_info)."""
    groups: dict[str, list[Row]] = {}
    for b in doc.get("benchmarks", []):
        stats = b.get("stats", {})
        name = str(b.get("name"))
        row: Row = {
            "benchmark": name,
            "median_ms": 1e3 * stats["median"] if "median" in stats else None,
            "min_ms": 1e3 * stats["min"] if "min" in stats else None,
            "rounds": stats.get("rounds"),
        }
        for k, v in (b.get("extra_info") or {}).items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                row[k] = v
        groups.setdefault(name.split("[")[0], []).append(row)
    return groups


def _env(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A document's environment (pytest-benchmark keeps ours under machine_info.moe_bench)."""
    if is_pytest_benchmark(doc):
        mi = doc.get("machine_info", {})
        return {"date": doc.get("datetime"), **(mi.get("moe_bench") or {})}
    return dict(doc.get("env") or {})


def _when(env: Mapping[str, Any]) -> tuple[str, str]:
    """('2026-12-02 05:26 UTC', 'abc1234' / 'abc1234+' (uncommitted changes) / 'not recorded')."""
    date = str(env.get("date") or "?").replace("T", " ")[:16]
    commit = env.get("commit")
    text = commit[:7] + ("+" if env.get("dirty") else "") if commit else "not recorded"
    return (f"{date} UTC" if date != "?" else date), text


def _measured_on(env: Mapping[str, Any]) -> str:
    gpu = env.get("gpu")
    where = f"{gpu} ({env.get('gpu_memory_gib')} GiB)" if gpu else f"{env.get('os', '?')} (CPU)"
    parts = [
        f"torch {env.get('torch')}" + (f" (CUDA {env['cuda']})" if env.get("cuda") else ""),
        f"triton {env.get('triton') or '-'}",
        versions_line(env),
    ]
    return f"{where}; " + ", ".join(p for p in parts if p)


def _section(path: Path, doc: Mapping[str, Any], name: str) -> list[str]:
    """The heading, when / where / which commit, the command line, the command's own body."""
    env = _env(doc)
    date, commit = _when(env)
    parts = [f"### {name}", "", f"{date}, commit {commit}, {_measured_on(env)}."]
    provenance = doc.get("provenance")
    if isinstance(provenance, Mapping):
        parts += ["", *(f"* {k.replace('_', ' ')}: {v}" for k, v in provenance.items())]
    if is_pytest_benchmark(doc):
        parts += ["", "```bash", "nox -s benchmarks", "```"]
        for group, rows in _pytest_benchmark_groups(doc).items():
            parts += ["", f"`{group}`:", "", markdown_table(rows)]
        return parts
    parts += ["", "```bash", str(doc.get("cmdline")), "```", ""]
    command = BY_NAME.get(str(doc.get("command")))
    parts.append((command.markdown if command else markdown_rows)(doc, path))
    return parts


def _sort_key(item: tuple[Path, dict[str, Any], str]) -> tuple[Any, ...]:
    path, doc, name = item
    command = "pytest-benchmark" if is_pytest_benchmark(doc) else str(doc.get("command"))
    return (ORDER.get(command, len(ORDER)), name)


def markdown_report(folder: str | Path, *, title: str | None = None) -> str:
    """The page for every result under ``folder`` (UsageError: no such folder, or no result)."""
    root = Path(folder)
    if not root.is_dir():
        what = "a file, not a folder" if root.exists() else "no such folder"
        raise UsageError(f"--results {root.as_posix()}: {what}")
    if not os.access(root, os.R_OK | os.X_OK):
        raise UsageError(f"--results {root.as_posix()}: cannot read it: permission denied")
    found = list(documents(root))
    if not found:
        raise UsageError(f"--results {root.as_posix()}: no moe-bench or pytest-benchmark JSON file")
    machines: dict[str, list[tuple[Path, dict[str, Any], str]]] = {}
    for path, doc in found:
        rel = path.relative_to(root)
        machine = rel.parts[0] if len(rel.parts) > 1 else "."
        name = str(doc.get("name") or path.stem)
        machines.setdefault(machine, []).append((path, doc, name))
    parts = [f"# {title or 'Benchmarks'}", ""]
    intro = root / "README.md"
    try:
        if intro.is_file():
            parts += [intro.read_text(encoding="utf-8").strip(), ""]
    except (OSError, UnicodeDecodeError):  # an unreadable README.md: the page without it
        pass
    parts.append(
        f"Generated by `moe-bench report --results {root.as_posix()}` from {len(found)} result "
        "file(s): each the latest run of its command on its machine."
    )
    for machine, items in sorted(machines.items()):
        items.sort(key=_sort_key)
        index = []
        for _, doc, name in items:
            date, commit = _when(_env(doc))
            index.append({"result": f"[{name}](#{_anchor(name)})", "date": date, "commit": commit})
        parts += ["", f"## {machine}", "", markdown_table(index, ["result", "date", "commit"])]
        for path, doc, name in items:
            parts += ["", *_section(path, doc, name)]
    return "\n".join(parts) + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces to '-', punctuation but '-' and '_' gone."""
    text = heading.strip().lower().replace(" ", "-")
    return "".join(c for c in text if c.isalnum() or c in "-_")


# ----------------------------------------------------------------------------------------------
# the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--results",
        type=input_dir,
        default=str(RESULTS),
        metavar="DIR",
        help=f"the folder of saved results (default: {RESULTS.as_posix()})",
    )
    p.add_argument(
        "--out", type=output_path, metavar="PATH", help="write the page here (default: print it)"
    )
    p.add_argument("--force", action="store_true", help="let --out replace an existing file")
    p.add_argument("--title", default=None, help="the page's title")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not args.force:
        raise UsageError(f"--out {args.out} exists: add --force to replace it")
    text = markdown_report(args.results, title=args.title)
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:  # checked before rendering; the disk filled, a race
        print(f"moe-bench report: error: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


COMMAND = Command(
    name="report",
    help="a markdown page from one folder of saved results (never overwrites without --force)",
    add_arguments=add_arguments,
    run=run,
    measures=False,
)
