"""A ``moe-bench`` command as one object (its arguments, its run, its result's name, markdown and
plot), and the argument types the commands share. ``cli.py`` loops over the commands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_tools.results import Result
from moe_tools.tables import format_value, markdown_table

Checkpoint = Callable[[Result], object]  # saves a partial result (a long sweep's progress)


class UsageError(ValueError):
    """A bad argument found after parsing (the CLI prints it as one line, exit status 2)."""


def scalars_line(extra: Mapping[str, Any]) -> str | None:
    """'key: value, ...' of a result's scalar extras (its settings), or None."""
    scalars = {k: v for k, v in extra.items() if isinstance(v, (int, float, str))}
    return ", ".join(f"{k}: {format_value(v)}" for k, v in scalars.items()) or None


def markdown_rows(doc: Mapping[str, Any], path: Path) -> str:
    """A saved result's rows as a markdown table, then its scalar extras on one line, then its
    notes."""
    parts = [markdown_table(doc.get("rows", []), doc.get("columns"))]
    extra = doc.get("extra") or {}
    if scalars_line(extra):
        parts += ["", scalars_line(extra)]
    notes = extra.get("notes") or []
    if notes:
        parts += ["", *(f"* {n}" for n in notes)]
    return "\n".join(parts)


@dataclass(frozen=True)
class Command:
    """One sub-command of ``moe-bench``.

    * ``add_arguments(parser)``: its own options (the common ones come from the CLI when
      ``measures``: ``--device``, ``--json``, ``--save``, ``--seed``, ``--no-progress``).
    * ``run(args, checkpoint)``: measure and return a :class:`Result` (``checkpoint`` saves a
      partial one); raise :class:`UsageError` (or ValueError / TypeError) for bad arguments.
    * ``result_name(args)``: the saved file's name (one per published command line).
    * ``markdown(doc, path)``: the body of ``moe-bench report``'s section for a saved result.
    * ``plot(result, path)``: the ``--plot`` figure (None: the command has no ``--plot``).
    * ``prepare(args)``: called first, before anything is printed (``ep``: quiet torchrun's
      other ranks).
    * ``measures=False``: a command that measures nothing (``report``); ``run`` returns the exit
      status itself.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[..., Any]
    result_name: Callable[[argparse.Namespace], str] = lambda args: args.command
    markdown: Callable[[Mapping[str, Any], Path], str] = markdown_rows
    plot: Callable[[Result, str], Path] | None = None
    prepare: Callable[[argparse.Namespace], None] | None = None
    measures: bool = True


# ----------------------------------------------------------------------------------------------
# argument types: each raises argparse.ArgumentTypeError, which the parser reports as one line
# naming the argument


def device(text: str) -> torch.device:
    """cpu, cuda, cuda:N or auto (CUDA when present); a CUDA device must exist here."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"not a device: {text!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N or auto, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {n} CUDA device(s)")
    return dev


INT64_MAX = 2**63 - 1  # a count or size must fit a torch size (int64)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes


def integer(lo: int, hi: int, what: str = "an integer") -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} in [{lo}, {hi}], got {value}")
        return value

    return parse


positive = integer(1, INT64_MAX, "a positive integer")
non_negative = integer(0, INT64_MAX, "a non-negative integer")
seed = integer(*SEED_RANGE, "a 64-bit seed")


def derived_seed(value: int) -> int:
    """A seed computed from ``--seed`` (seed + 1, seed * 1000 + rank) wrapped into torch's range
    (torch.manual_seed takes a negative seed as its 64-bit two's complement: the same stream)."""
    return value % 2**64


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def csv(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def int_csv(text: str) -> list[int]:
    return [positive(item) for item in csv(text)]


def choices_csv(known: Sequence[str] | Callable[[], Sequence[str]]) -> Callable[[str], list[str]]:
    """A comma-separated list whose items must be among ``known`` (or what it returns)."""

    def parse(text: str) -> list[str]:
        names = list(known() if callable(known) else known)
        items = csv(text)
        bad = [i for i in items if i not in names]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))}; choose from {', '.join(names)}"
            )
        return items

    return parse


def writable_error(text: str | os.PathLike[str], *, folder: bool = False) -> str | None:
    """Why ``text`` (a file to write, or with ``folder`` a folder to write into) cannot be
    written, or None. Rules: not empty; a file path is not a folder, a folder path is not a
    file; the path itself, when it exists, and the nearest existing folder above it (the
    missing ones are created) are writable."""
    if not os.fspath(text):
        return "empty path"
    path = Path(text)
    try:
        if folder and path.exists() and not path.is_dir():
            return f"{str(path)!r} is a file, not a folder"
        if not folder and path.is_dir():
            return f"{str(path)!r} is a folder"
        if path.exists() and not os.access(path, os.W_OK):
            return f"cannot write {str(path)!r}: permission denied"
        probe = path.absolute().parent
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            return f"cannot write under {str(probe)!r}: not a folder"
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"cannot write under {str(probe)!r}: permission denied"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte
        return f"cannot write {str(path)!r}: {exc}"
    return None


def output_path(text: str) -> str:
    """A file to write (--json, --plot, --out): checked before measuring."""
    problem = writable_error(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_dir(text: str) -> str:
    """A folder to write into (--save): checked before measuring."""
    problem = writable_error(text, folder=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def input_dir(text: str) -> str:
    """A folder to read (--results): not empty (whether it exists is the command's check)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")


def dtype_of(name: str | None, device: torch.device) -> torch.dtype:
    """The ``--dtype`` value as a torch dtype (default: bf16 on CUDA, fp32 on CPU)."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def plot_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--plot", metavar="PNG", type=output_path, help=what)
