"""``moe-bench verify``: every public op of moe-kernels (the op registry) on random problems,
against (a) its torch reference twin in ``moe_kernels.reference`` and (b) an independent naive
oracle (loops and float64, in ``moe_tools.ops``), plus a determinism check (two calls, bitwise);
then every MoE implementation against the baseline layer.

Where the kernels run (CUDA, or Triton's interpreter under ``TRITON_INTERPRET=1``), (a) checks
kernel against reference: bit for bit where the contract says so (``OpSpec.reference_tol``
otherwise; the interpreter's documented bf16 / fp8 rounding slack on top). On a CPU without the
interpreter the ops *are* their reference, so (a) does not apply (``vs_reference`` is empty) and
(b) is what checks them.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_kernels.testing import E4M3_STEP, ULP, execution_path, reference_bound
from moe_tools import command as cmd
from moe_tools import tables
from moe_tools.ops import REGISTRY, CheckFailed, OpSpec
from moe_tools.ops.spec import Problem, bitwise_equal, expect_equal, expect_within
from moe_tools.results import Result, slug
from moe_tools.tables import Row, short_error
from moe_tools.timing import default_device

COLUMNS = ["check", "shape", "vs_reference", "vs_oracle", "deterministic", "status"]
MOE_CHECK = "moe"  # every MoELayer impl against the baseline layer
CHECKS = (*REGISTRY, MOE_CHECK)
REFERENCE_NOTE = (
    "CPU: the ops ran their torch reference, so vs_reference does not apply; the independent "
    "oracle (vs_oracle) checks them (TRITON_INTERPRET=1 runs the Triton kernels instead)"
)


@dataclass
class Ctx:
    device: torch.device
    gen: torch.Generator  # on the CPU: the same values on every device
    rng: random.Random
    path: str  # "triton", "interpreter" or "reference" (moe_kernels.testing.execution_path)

    @property
    def large(self) -> bool:
        return self.device.type == "cuda"


def _reference_slack(t: torch.Tensor, path: str) -> float:
    """The interpreter's documented rounding (bf16 stores truncate, fp8 casts a step off)."""
    if path != "interpreter":
        return 0.0
    return E4M3_STEP if t.dtype == torch.float8_e4m3fn else ULP.get(t.dtype, 0.0)


def vs_reference(
    spec: OpSpec,
    out: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
    path: str,
    problem: Problem | None = None,
) -> float:
    """Largest difference of the op's outputs from its reference's; raises CheckFailed beyond
    ``spec.reference_tol`` (rtol, atol relative to the largest reference value). In the
    interpreter, an op whose oracle bounds its roundings (``spec.bound``) is held to that rule
    instead (``reference_bound``): its truncated bf16 intermediates move the result by more than
    a step of the output, inside the bound."""
    if len(out) != len(want):
        raise CheckFailed(f"{len(out)} outputs, the reference gives {len(want)}")
    if path == "interpreter" and spec.bound is not None and problem is not None:
        _, bound = spec.bound(problem)
        return expect_within(
            "output 0 vs reference", out[0], want[0].double(), reference_bound(bound)
        )
    worst = 0.0
    for i, (got, ref) in enumerate(zip(out, want, strict=True)):
        rtol, atol = spec.reference_tol if got.is_floating_point() else (0.0, 0.0)
        scale = (
            float(ref.detach().float().abs().nan_to_num(posinf=0, neginf=0).max())
            if ref.numel() and got.is_floating_point()
            else 0.0
        )
        rel = rtol + _reference_slack(got, path)
        worst = max(
            worst, expect_equal(f"output {i} vs reference", got, ref, rel=rel, atol=atol * scale)
        )
    return worst


def check_op(spec: OpSpec, ctx: Ctx) -> Row:
    """One random problem of ``spec``: the op twice, its reference, its oracle."""
    row = _row(spec.name, "-")
    problem = spec.make(spec.draw(ctx.rng, ctx.large), ctx.gen, ctx.device)
    row["shape"] = problem.label
    try:
        out = spec.outputs(spec.op(), problem)
        row["deterministic"] = bitwise_equal(out, spec.outputs(spec.op(), problem))
        if ctx.path != "reference":
            want = spec.outputs(spec.reference, problem)
            row["vs_reference"] = vs_reference(spec, out, want, ctx.path, problem)
        row["vs_oracle"] = spec.oracle(problem, out)
    except CheckFailed as exc:
        row["status"] = f"FAIL: {exc}"
        return row
    row["status"] = "pass" if row["deterministic"] else "FAIL: not deterministic"
    return row


def moe_rows(ctx: Ctx) -> list[Row]:
    """Every MoELayer impl on one layer and input vs the baseline: relative max error."""
    try:
        from moe_model import MOE_IMPLS
        from moe_tools.matrix import build_layer
    except Exception as exc:
        return [_row(MOE_CHECK, "-", status=f"unavailable: {short_error(exc)}")]
    cuda = ctx.device.type == "cuda"
    d, E, k, h, T = (512, 16, 4, 256, 512) if cuda else (64, 8, 2, 32, 48)
    dtype = torch.bfloat16 if cuda else torch.float32
    default_tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    # mxfp8, fp8: e4m3 data, ~2^-4 relative per element; triton_bf16: its combine writes bf16
    tolerances = {"mxfp8": 0.1, "fp8": 0.1, "triton_bf16": 1e-2}
    shape = f"T={T} d={d} E={E} k={k} h={h} {str(dtype).removeprefix('torch.')}"
    sizes = dict(d_model=d, n_experts=E, top_k=k, hidden=h, gated=False, score_fn="softmax")
    layer = build_layer(sizes, ctx.device, dtype, seed=ctx.rng.randint(0, 2**31 - 1))
    x = torch.randn(T, d, generator=ctx.gen).to(device=ctx.device, dtype=dtype)
    rows = []
    with torch.no_grad():
        y_base = layer(x).double()
        scale = float(y_base.abs().max()) or 1.0
        for impl in MOE_IMPLS:
            if impl == "baseline":
                continue
            try:
                layer.impl = impl
                y, again = layer(x), layer(x)
            except Exception as exc:
                rows.append(_row(f"moe:{impl}", shape, status=f"unavailable: {short_error(exc)}"))
                continue
            det = bitwise_equal((y,), (again,))
            err = float((y.double() - y_base).abs().max()) / scale
            tol = tolerances.get(impl, default_tol)
            status = "pass"
            if err > tol:
                status = f"FAIL: rel error {err:.3g} > {tol:g}"
            elif not det:
                status = "FAIL: not deterministic"
            rows.append(_row(f"moe:{impl}", shape, vs_oracle=err, deterministic=det, status=status))
    return rows


def _row(check: str, shape: str, **kw: Any) -> Row:
    row: Row = {c: None for c in COLUMNS}
    row.update(check=check, shape=shape, **kw)
    return row


def run(
    *,
    device: torch.device | str | None = None,
    shapes: int | None = None,
    ops: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Result:
    """Rows of pass / FAIL / unavailable, ``shapes`` random problems per op (default 8 on CUDA,
    3 on a CPU); ``extra["failed"]`` counts the failures."""
    device = torch.device(device) if device is not None else default_device()
    unknown = sorted(set(ops or ()) - set(CHECKS))
    if unknown:
        raise cmd.UsageError(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    shapes = shapes or (8 if device.type == "cuda" else 3)
    path = execution_path(device)
    ctx = Ctx(device, torch.Generator().manual_seed(seed), random.Random(seed), path)
    jobs = [
        (spec, i)
        for name, spec in REGISTRY.items()
        if ops is None or name in ops
        for i in range(shapes)
    ]
    rows: list[Row] = []
    for spec, _ in tables.progress(jobs, enabled=progress, desc="verify", unit="check"):
        try:
            rows.append(check_op(spec, ctx))
        except (ImportError, AttributeError) as exc:
            rows.append(_row(spec.name, "-", status=f"unavailable: {short_error(exc)}"))
        except Exception as exc:
            rows.append(_row(spec.name, "-", status=f"FAIL: {short_error(exc)}"))
    if ops is None or MOE_CHECK in ops:
        rows.extend(moe_rows(ctx))
    failed = sum(str(r["status"]).startswith("FAIL") for r in rows)
    passed = sum(r["status"] == "pass" for r in rows)
    notes = [f"{passed} passed, {failed} failed, {len(rows) - passed - failed} unavailable"]
    if path == "reference":
        notes.append(REFERENCE_NOTE)
    extra = {"failed": failed, "passed": passed, "path": path, "notes": notes}
    return Result("verify", rows, COLUMNS, extra)


# ----------------------------------------------------------------------------------------------
# the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes", type=cmd.positive, help="random problems per op (default: 8 on CUDA, 3 on CPU)"
    )
    p.add_argument(
        "--ops",
        type=cmd.choices_csv(CHECKS),
        help=f"only these checks: public op names, or {MOE_CHECK} (every MoELayer impl)",
    )


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    return run(
        device=args.device,
        shapes=args.shapes,
        ops=args.ops,
        seed=args.seed,
        progress=not args.no_progress,
    )


COMMAND = cmd.Command(
    name="verify",
    help="every moe-kernels op vs its reference and an independent oracle; exit 1 on a failure",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=lambda args: slug("verify", args.ops),
)
