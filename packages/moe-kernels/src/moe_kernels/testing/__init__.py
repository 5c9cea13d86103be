"""Test helpers for this package and code built on it: guard regions around tensors
(``guarded``), every public op with small plain-torch arguments (``op_problems``, ``naive_plan``),
compiled-from-a-cold-process checks (``cold_compile``, ``run_fresh``), and whether sm_90a kernels
compile here (``sm90_compiler_missing``), where the ops run on a device (``execution_path``), the
tolerance rules shared with ``moe-bench verify`` (``ULP``, ``bound_violations``,
``reference_bound``); checks on a CUDA device (``moe_kernels.testing.gpu``: no host sync,
poisoned outputs, bitwise equality with NaN == NaN, CUDA-graph replay, compiled code)."""

from moe_kernels._dispatch import execution_path
from moe_kernels.testing.bits import (
    assert_int,
    assert_quant,
    assert_same_bits,
    assert_weights,
    assert_within_ulps,
    check_plan,
    check_shuffling,
    int_bits,
)
from moe_kernels.testing.cold import (
    FreshRun,
    cold_compile,
    cold_main,
    fresh_runs,
    run_fresh,
    same_bits,
    tensors_of,
)
from moe_kernels.testing.gpu import (
    bits_equal,
    capture,
    cloned,
    compile_fresh,
    forbid_host_sync,
    full_run,
    gpu_test_device,
    inductor_code,
    launched_by_inductor,
    poison,
    replay_mismatches,
)
from moe_kernels.testing.guards import GUARD_BYTE, Guarded, guarded
from moe_kernels.testing.harness import GuardHarness
from moe_kernels.testing.inputs import make_scores
from moe_kernels.testing.launches import (
    IEEE_DIV_PTX,
    ROUTING_PLANS,
    SELECTION_PLANS,
    compile_launches,
    written_arguments,
)
from moe_kernels.testing.mxfp8_values import SPECIAL_CASES, special_table
from moe_kernels.testing.oracles import *  # noqa: F403 (the oracles, listed in oracles.__all__)
from moe_kernels.testing.oracles import __all__ as _ORACLES
from moe_kernels.testing.problems import Problem, Sizes, naive_plan, naive_shuffle, op_problems
from moe_kernels.testing.sm90 import RegisterUse, register_use, sm90_compiler_missing
from moe_kernels.testing.tolerance import (
    E4M3_STEP,
    ULP,
    BoundCheck,
    bound_violations,
    reference_bound,
)

__all__ = [
    "E4M3_STEP",
    "GUARD_BYTE",
    "ULP",
    "BoundCheck",
    "bound_violations",
    "reference_bound",
    "FreshRun",
    "GuardHarness",
    "Guarded",
    "Problem",
    "Sizes",
    "bits_equal",
    "capture",
    "cloned",
    "compile_fresh",
    "cold_compile",
    "cold_main",
    "execution_path",
    "forbid_host_sync",
    "fresh_runs",
    "full_run",
    "gpu_test_device",
    "guarded",
    "inductor_code",
    "launched_by_inductor",
    "naive_plan",
    "naive_shuffle",
    "op_problems",
    "poison",
    "replay_mismatches",
    "run_fresh",
    "same_bits",
    "sm90_compiler_missing",
    "RegisterUse",
    "register_use",
    "tensors_of",
    # independent oracles, bit-equality checks, sm_90a launch compiles, the MXFP8 table
    "IEEE_DIV_PTX",
    "ROUTING_PLANS",
    "SELECTION_PLANS",
    "SPECIAL_CASES",
    "assert_int",
    "assert_quant",
    "assert_same_bits",
    "assert_weights",
    "assert_within_ulps",
    "check_plan",
    "check_shuffling",
    "compile_launches",
    "int_bits",
    "make_scores",
    "special_table",
    "written_arguments",
    *_ORACLES,
]
