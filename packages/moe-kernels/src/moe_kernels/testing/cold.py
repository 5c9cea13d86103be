"""Compiled calls from a cold process: ``torch.compile(fullgraph=True)`` of each public op before
any eager call of this package, then the same calls eager, compared bit for bit.

A module-level cache that a traced frame fills on its first call (a device-capability memo, a
launch table) crashes or breaks the graph only there: in a process whose caches an eager call
already filled, the same program compiles. Tests therefore run these checks in a fresh
interpreter (``run_fresh``): ``python -c "from moe_kernels.testing import cold_main;
cold_main()" DEVICE NAME...``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

__all__ = [
    "FreshRun",
    "cold_compile",
    "cold_main",
    "run_fresh",
    "fresh_runs",
    "same_bits",
    "tensors_of",
]


def tensors_of(obj: object) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or nested tuples / lists / NamedTuples of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    return []


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN equals NaN of the same payload; -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def _fresh(args: tuple, grads: Iterable[int]) -> tuple:
    """A new copy of every tensor argument (some ops write theirs), leaves requiring grad at
    ``grads``; other arguments (plans, ints) as they are."""
    want = set(grads)
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().requires_grad_(i in want)
        out.append(a)
    return tuple(out)


def _run(fn, args: tuple, grads: Sequence[int]) -> list[torch.Tensor]:
    """The outputs of ``fn(*args)``, then, where ``grads`` names arguments, their gradients of
    0.5 * sum(out^2) over the floating outputs (backward outside ``fn``: compiled, AOT autograd
    compiles it)."""
    out = tensors_of(fn(*args))
    if not grads:
        return out
    loss = sum(0.5 * o.float().square().sum() for o in out if o.requires_grad)
    loss.backward()
    return out + [args[i].grad for i in grads]


def cold_compile(names: Sequence[str], device: str, seed: int = 0) -> dict[str, str | None]:
    """name -> None where ``op_problems(device)[name]`` compiled with ``fullgraph=True`` ran and
    equals eager bit for bit, else what went wrong. Every compiled call runs before the first
    eager one; the arguments are made with plain torch only."""
    from moe_kernels.testing.problems import op_problems

    problems = op_problems(device, seed)
    unknown = sorted(set(names) - set(problems))
    if unknown:
        raise ValueError(f"unknown op problems {unknown}; known: {sorted(problems)}")
    results: dict[str, str | None] = {}
    compiled: dict[str, list[torch.Tensor]] = {}
    for name in names:
        p = problems[name]
        try:
            fn = torch.compile(p.fn, fullgraph=True)
            compiled[name] = _run(fn, _fresh(p.args, p.grads), p.grads)
        except Exception as exc:  # the failure is the result
            results[name] = f"compiled: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    for name, got in compiled.items():
        p = problems[name]
        want = _run(p.fn, _fresh(p.args, p.grads), p.grads)
        if len(got) != len(want):
            results[name] = f"{len(got)} compiled outputs, {len(want)} eager"
            continue
        bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not same_bits(g, w)]
        results[name] = f"outputs {bad} differ from eager" if bad else None
    return results


def cold_main() -> None:
    """Command line: ``DEVICE NAME...``; prints one line per op (``ok`` or why not), exit 1 on
    any failure."""
    device, *names = sys.argv[1:]
    results = cold_compile(names, device)
    for name, why in results.items():
        print(f"{name}: {'ok' if why is None else 'FAIL ' + why}", flush=True)
    raise SystemExit(1 if any(v is not None for v in results.values()) else 0)


class FreshRun(NamedTuple):
    """A fresh interpreter's exit code and its stdout and stderr together."""

    returncode: int
    output: str


def run_fresh(code: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 900) -> FreshRun:  # fmt: skip
    """``python -c code args...`` in a new interpreter (this one's executable and environment,
    updated by ``env``)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return FreshRun(proc.returncode, proc.stdout)


def fresh_runs(request, param: str, run_one: Callable[[Any], FreshRun], workers: int) -> dict:
    """Value of the parametrised argument ``param`` -> ``run_one(value)``, for a module fixture
    whose tests each check one case run in a fresh process.

    In a plain pytest session: every case that this session runs in the requesting module (after
    ``-k`` / ``-m``), started up front, ``workers`` side by side. In a pytest-xdist worker, which
    collects every case but runs only those it is handed, each case starts when its test asks:
    the workers already run side by side, and starting every case in each of them would start
    each case once per worker (out of GPU memory at ``-n 4``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _OnDemand(run_one)
    cases = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is not request.module or spec is None or param not in spec.params:
            continue
        if spec.params[param] not in cases:
            cases.append(spec.params[param])
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(cases, pool.map(run_one, cases), strict=True))


class _OnDemand(dict):
    """A dict that computes a missing key's value with ``make(key)`` and keeps it."""

    def __init__(self, make: Callable[[Any], FreshRun]):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value
