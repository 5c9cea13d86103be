"""Test helpers for this package and code built on it: guard regions around tensors
(``guarded``), every public op with small plain-torch arguments (``op_problems``, ``naive_plan``),
compiled-from-a-cold-process checks (``cold_compile``, ``run_fresh``), and whether sm_90a kernels
compile here (``sm90_compiler_missing``), and where the ops run on a device (``execution_path``)."""

from moe_kernels._dispatch import execution_path
from moe_kernels.testing.cold import (
    FreshRun,
    cold_compile,
    cold_main,
    run_fresh,
    same_bits,
    selected,
    tensors_of,
)
from moe_kernels.testing.guards import GUARD_BYTE, Guarded, guarded
from moe_kernels.testing.harness import GuardHarness
from moe_kernels.testing.problems import Problem, Sizes, naive_plan, naive_shuffle, op_problems
from moe_kernels.testing.sm90 import sm90_compiler_missing

__all__ = [
    "GUARD_BYTE",
    "FreshRun",
    "GuardHarness",
    "Guarded",
    "Problem",
    "Sizes",
    "cold_compile",
    "cold_main",
    "execution_path",
    "guarded",
    "naive_plan",
    "naive_shuffle",
    "op_problems",
    "run_fresh",
    "same_bits",
    "selected",
    "sm90_compiler_missing",
    "tensors_of",
]
