"""Every routing plan the chooser keeps, run in Triton's interpreter at small sizes (forced by
``Constraints`` where the chooser picks it only for larger problems), bit-exact against the naive
oracle: route and index_shuffling, ties, NaN / +-inf / -0.0 rows, expert ranges, valid counts,
strided rows. Skipped unless ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

from moe_kernels._dispatch import use_triton
from moe_kernels._triton.routing.plan import INTERPRETER, Constraints, choose_plan
from moe_kernels.testing import check_plan, check_shuffling, make_scores, oracle_route_plan

pytestmark = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="Triton kernels run on CPU only when interpreted"
)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
C = Constraints


def _vtc(valid, dtype=torch.int32):
    return None if valid is None else torch.tensor([valid], dtype=dtype)


def _run(x, k, start, end, valid, renorm, constraints, route, one_buffer=False):
    from moe_kernels._triton.routing.launch import run

    return run(x, k, _vtc(valid), start, end, renorm, route, constraints, one_buffer)


# (id, T, E, k, start, end, valid, dtype, kind, layout, renormalize, constraints, want)
# ``want``: (placement, topk) the forced plan must have, so no case silently tests another plan
PLANS = [
    # ranked: bitmask ranks in A, scattered stores in C; the scan launched or in C
    ("ranked-scan", 75, 11, 3, 2, 9, 70, FP32, "ties", "col", True,
     C(placement="ranked", block_t=8, sub=2, scan_in_c=False), ("ranked", "rounds")),
    ("ranked-4", 40, 20, 12, 0, 20, None, BF16, "special", "row", False,
     C(placement="ranked", block_t=4, scan_in_c=True), ("ranked", "rounds")),
    # sorted by tl.sort after rounds of row maxima (top_k > 8), several blocks a program
    ("sorted-rounds", 75, 20, 12, 3, 17, 60, FP32, "special", "strided", True,
     C(placement="sorted", block_t=8, sub=2, scan_in_c=False), ("sorted", "rounds")),
    ("sorted-rounds-16", 33, 24, 9, 0, 24, None, FP16, "ties", "row", False,
     C(placement="sorted", block_t=16, scan_in_c=True), ("sorted", "rounds")),
    # per-thread insertion: int64 keys (fp32), fp32 keys + merge (16-bit, k 5..8), int32 keys
    ("insert-fp32", 66, 40, 8, 0, 40, None, FP32, "special", "row", True,
     C(placement="sorted"), ("sorted", "insert")),
    ("insert-fkey-merge", 66, 128, 8, 0, 128, None, BF16, "special", "row", False,
     C(placement="sorted"), ("sorted", "insert")),
    ("insert-fkey", 75, 11, 3, 2, 9, 70, FP16, "ties", "col", False,
     C(placement="sorted", block_t=16, sub=2, scan_in_c=False), ("sorted", "insert")),
    ("insert-int-merge", 30, 130, 6, 65, 130, None, BF16, "special", "row", False,
     C(placement="sorted"), ("sorted", "insert")),
    ("insert-5", 9, 5, 5, 0, 5, None, FP16, "special", "row", False,
     C(placement="sorted"), ("sorted", "insert")),
    # counted ranks (<= 16 local experts): full, and ranges of 1 and 4
    ("counted", 45, 30, 6, 3, 19, 40, BF16, "special", "row", False,
     C(placement="counted"), ("counted", "insert")),
    ("counted-1", 37, 9, 3, 2, 3, None, FP32, "ties", "row", True,
     C(placement="counted", block_t=8, sub=2, topk="rounds", scan_in_c=False),
     ("counted", "rounds")),
    ("counted-4", 70, 128, 8, 32, 36, 0, FP16, "ties", "row", False,
     C(placement="counted"), ("counted", "insert")),
    # prefix sums (index_shuffling, 16-32 local experts)
    ("prefix-32", 130, 32, 8, 0, 32, None, BF16, "special", "row", False,
     C(placement="prefix"), ("prefix", "insert")),
    ("prefix-17", 90, 256, 4, 100, 117, 77, FP32, "special", "row", False,
     C(placement="prefix", scan_in_c=False), ("prefix", "insert")),
    # columns: A places the pairs; C writes them, or D after a scan launch (groups of 2)
    ("columns-C", 100, 64, 5, 3, 59, 70, BF16, "special", "row", False,
     C(placement="columns"), ("columns", "threshold")),
    ("columns-D", 300, 128, 8, 0, 128, None, FP16, "ties", "pad", False,
     C(placement="columns", scan_in_c=False, runs_group=2), ("columns", "threshold")),
    ("columns-D-range", 300, 128, 1, 40, 100, 290, BF16, "randn", "pad", False,
     C(placement="columns", scan_in_c=False, runs_group=2), ("columns", "threshold")),
    ("columns-none", 70, 128, 3, 10, 100, 0, FP16, "special", "row", False,
     C(placement="columns"), ("columns", "threshold")),
]  # fmt: skip
SLOW = {"columns-D", "columns-D-range"}  # the interpreter's largest columns problems


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else []) for c in PLANS],
)
def test_plan_matches_oracle(case):
    name, T, E, k, start, end, valid, dtype, kind, layout, renorm, constraints, want = case
    x = make_scores(T, E, dtype, kind, seed=T + E + k, layout=layout)
    ops = (False,) if want[0] == "prefix" else (True, False)  # prefix: index_shuffling only
    for route in ops:
        if route and want[0] == "columns" and renorm:
            continue
        p = choose_plan(_problem(x, k, valid, start, end, renorm and route, route), INTERPRETER,
                        constraints)  # fmt: skip
        assert (p.placement, p.topk) == want
        oracle = oracle_route_plan(x, k, start, end, valid, renorm and route)
        # outputs in one buffer (eager calls) for route, apart (custom-op calls) for the other
        got = _run(x, k, start, end, valid, renorm and route, constraints, route, route)
        (check_plan if route else check_shuffling)(got, oracle)


def _problem(x, k, valid, start, end, renorm, route):
    from moe_kernels._triton.routing.launch import problem_of

    return problem_of(x, k, _vtc(valid), start, end, renorm, route)


def test_columns_need_pairs_of_aligned_rows():
    """A row stride that is odd (in 16-bit elements) cannot be read as int32 pairs: the chooser
    takes a row family, and forcing the columns plan raises."""
    x = make_scores(70, 64, FP16, "ties", seed=3, layout="odd")
    p = choose_plan(_problem(x, 8, None, 0, 64, False, False), INTERPRETER, C(placement="sorted"))
    assert p.placement == "sorted"
    with pytest.raises(ValueError, match="columns"):
        _run(x, 8, 0, 64, None, False, C(placement="columns"), False)
