"""``moe-bench``: the parser is built from the commands (``moe_tools.commands``, each module owns
its arguments, run, markdown and plot); this file prints, saves and turns errors into exit
statuses: 0 ok, 1 a check failed (``verify``) or memory ran out, 2 a bad argument (one line on
stderr, no traceback; ``MOE_BENCH_TRACEBACK=1`` shows it)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from moe_tools import __version__, report
from moe_tools.command import Command, UsageError, device, output_path
from moe_tools.commands import MEASURING
from moe_tools.env import environment, format_environment
from moe_tools.plots import require_matplotlib
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
        "--device", type=device, default="auto", help="cpu, cuda, cuda:N or auto (default)"
    )
    common.add_argument(
        "--json", type=output_path, metavar="PATH", help="also write the rows and environment here"
    )
    common.add_argument(
        "--save",
        metavar="DIR",
        help="write the result as current data: DIR/<machine>/<name>.json, replacing the last "
        "run of the same command (e.g. --save benchmarks/results)",
    )
    common.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
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
    """Print the environment, run, print the table and notes, write JSON and the plot."""
    if getattr(args, "plot", None):
        try:
            require_matplotlib()  # fail before the measurements, not after
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
    env = environment(args.device)
    print(format_environment(env), flush=True)
    name = command.result_name(args)
    targets = [Path(p) for p in (args.json,) if p]
    if args.save:
        targets.append(saved_path(args.save, env["machine"], name))

    def write(result: Result) -> list[Path]:
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
        return [write_json(path, doc) for path in targets]

    result = command.run(args, write if targets else None)
    print(result.text if result.text is not None else format_table(result.rows, result.columns))
    for line in result.extra.get("notes", []):
        print(f"# {line}")
    for path in write(result):
        print(f"# wrote {path}")
    if command.plot is not None and getattr(args, "plot", None):
        print(f"# wrote {command.plot(result, args.plot)}")
    failed = result.extra.get("failed", 0)
    if failed:
        print(f"# {command.name}: {failed} check(s) FAILED", file=sys.stderr)
        return 1
    return 0


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
