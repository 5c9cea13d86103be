"""The measuring commands of ``moe-bench``, in the order the CLI lists them and ``moe-bench
report`` renders their results. A new command: a module with a ``COMMAND``, listed here."""

from __future__ import annotations

from moe_tools import decode, ep, kernels, matrix, rollout, train, verify
from moe_tools.command import Command

MEASURING: tuple[Command, ...] = (
    matrix.COMMAND,
    decode.COMMAND,
    rollout.COMMAND,
    kernels.COMMAND,
    verify.COMMAND,
    train.COMMAND,
    ep.COMMAND,
)
BY_NAME: dict[str, Command] = {c.name: c for c in MEASURING}
