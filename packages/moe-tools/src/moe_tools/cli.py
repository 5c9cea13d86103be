"""``moe-bench``: the parser is built from the commands (``moe_tools.commands``, each module owns
its arguments, run, markdown and plot); this file prints, saves and turns errors into exit
statuses: 0 ok, 1 a check failed (``verify``), memory ran out or a result could not be written
(it is still printed), 2 a bad argument (one line on stderr naming it, no traceback;
``MOE_BENCH_TRACEBACK=1`` shows it). Every path and number is checked before measuring: the
argument types of ``moe_tools.command`` when parsing, the files a run writes in ``_measure``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from moe_tools import __version__, report, tables
from moe_tools import command as cmd
from moe_tools.command import Command, UsageError
from moe_tools.commands import MEASURING
from moe_tools.env import environment, format_environment
from moe_tools.plots import plot_format_error, require_matplotlib
from moe_tools.results import Result, make_document, saved_path, write_json
from moe_tools.tables import format_table

COMMANDS: dict[str, Command] = {c.name: c for c in (*MEASURING, report.COMMAND)}


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the argument (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--device", type=cmd.device, default="auto", help="cpu, cuda, cuda:N or auto (default)"
    )
    common.add_argument(
        "--json",
        type=cmd.output_path,
        metavar="PATH",
        help="also write the rows and environment here",
    )
    common.add_argument(
        "--save",
        type=cmd.output_dir,
        metavar="DIR",
        help="write the result as current data: DIR/<machine>/<name>.json, replacing the last "
        "run of the same command (e.g. --save benchmarks/results)",
    )
    common.add_argument("--seed", type=cmd.seed, default=0, help="random seed, 64 bits (default 0)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_argument(
        "--wide",
        action="store_true",
        help=f"every column, uncut (default: tables fit {tables.TABLE_WIDTH} characters)",
    )
    return common


def build_parser() -> Parser:
    parser = Parser(
        prog="moe-bench",
        description="Benchmarks and checks for moe-kernels and moe-model: speed, determinism, "
        "drift, rollout throughput and VRAM, kernel bandwidth, published results.",
    )
    parser.add_argument("--version", action="version", version=f"moe-bench {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    common = _common_options()
    for command in COMMANDS.values():
        p = sub.add_parser(
            command.name,
            parents=[common] if command.measures else [],
            help=command.help,
            description=command.help,
        )
        command.add_arguments(p)
    return parser


def _args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items()}


def _measure(command: Command, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check what the run writes, print the environment, run, print the table and notes, then
    write JSON and the plot: a file that cannot be written is one line naming its flag (exit
    status 1), after the result is printed."""
    if getattr(args, "plot", None):
        try:
            require_matplotlib()  # fail before the measurements, not after
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
        problem = plot_format_error(args.plot)
        if problem:
            raise UsageError(problem)
    env = environment(args.device)
    name = command.result_name(args)
    targets = [("--json", Path(args.json))] if args.json else []
    if args.save:
        targets.append(("--save", saved_path(args.save, env["machine"], name)))
    for flag, path in targets:  # --save's <machine>/<name>.json is known only now
        problem = cmd.writable_error(path)
        if problem:
            raise UsageError(f"{flag} {path}: {problem}")
    print(format_environment(env), flush=True)

    def write(result: Result) -> list[tuple[str, Path, OSError | None]]:
        """Write every JSON target: (flag, path, the error or None) each."""
        doc = make_document(
            result.command,
            result.rows,
            env,
            name=name,
            columns=result.columns,
            args=_args_dict(args),
            cmdline=shlex.join(["moe-bench", *argv]),
            extra=result.extra,
        )
        done = []
        for flag, path in targets:
            try:
                done.append((flag, write_json(path, doc), None))
            except OSError as exc:
                done.append((flag, path, exc))
        return done

    # a checkpoint (a sweep's progress) that cannot be written does not stop the run: the final
    # write reports it
    width = None if args.wide else tables.TABLE_WIDTH
    with tables.table_width(width):
        result = command.run(args, write if targets else None)
        print(result.text if result.text is not None else format_table(result.rows, result.columns))
    for line in result.extra.get("notes", []):
        print("\n".join(textwrap.wrap(f"# {line}", width, subsequent_indent="#   ")) if width
              else f"# {line}")  # fmt: skip
    status = 0
    written = write(result)
    if command.plot is not None and getattr(args, "plot", None):
        try:
            written.append(("--plot", command.plot(result, args.plot), None))
        except OSError as exc:
            written.append(("--plot", Path(args.plot), exc))
    for flag, path, exc in written:
        if exc is None:
            print(f"# wrote {path}")
        else:
            print(f"moe-bench {command.name}: error: {flag} {path}: not written: "
                  f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
            status = 1
    failed = result.extra.get("failed", 0)
    if failed:
        print(f"# {command.name}: {failed} check(s) FAILED", file=sys.stderr)
        return 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moe-bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    if command.prepare is not None:
        command.prepare(args)
    try:
        if not command.measures:
            return command.run(args)
        return _measure(command, args, argv)
    except (ValueError, TypeError) as exc:  # UsageError, and the libraries' argument checks
        if os.environ.get("MOE_BENCH_TRACEBACK"):
            raise
        print(f"moe-bench {command.name}: error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        if os.environ.get("MOE_BENCH_TRACEBACK"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        print(f"moe-bench {command.name}: out of memory: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
