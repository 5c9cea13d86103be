"""The routing plan chooser alone (``_triton/routing/plan.py``): which plan for which problem,
rule by rule, and the typed override. Pure Python: no Triton, no kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_kernels._triton.routing.plan import (
    INTERPRETER,
    RANKED_MAX_PAIRS,
    SCAN_IN_C_MAX_HIST,
    SCAN_IN_C_MAX_PROGRAMS,
    Constraints,
    Device,
    Problem,
    choose_plan,
)

H200 = Device(sm_count=132)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def problem(T, E, k, dtype=BF16, route=True, start=0, end=None, renormalize=False, words=None):
    words = dtype != FP32 if words is None else words
    end = E if end is None else end
    return Problem(T, E, k, start, end, dtype, route, renormalize, False, words)


def plan(*args, device=H200, constraints=None, **kw):
    return choose_plan(problem(*args, **kw), device, constraints)


# ---------------------------------------------------------------------------------------------
# rule 1: the family


@pytest.mark.parametrize("route", [True, False])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_small_problems_are_ranked(route, dtype):
    for T, k in ((1, 1), (4096, 8), (RANKED_MAX_PAIRS // 2, 2)):
        p = plan(T, 96, k, dtype, route)
        assert (p.placement, p.topk) == ("ranked", "rounds")
    assert plan(RANKED_MAX_PAIRS // 2 + 1, 96, 2, dtype, route).placement != "ranked"


@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_columns_where_each_condition_holds(E, dtype):
    for route, T in ((True, 65536), (False, 65536), (True, 1), (False, 1024)):  # at any size
        p = plan(T, E, 8, dtype, route)
        assert (p.placement, p.topk, p.tokens_per_program) == ("columns", "threshold", 128)
    assert plan(65536, E, 1, dtype).placement == "columns"
    # each condition broken alone
    assert plan(65536, E, 8, FP32).placement == "sorted"
    assert plan(65536, E, 8, dtype, words=False).placement == "sorted"
    assert plan(65536, E, 8, dtype, renormalize=True).placement == "sorted"
    assert plan(65536, E, 8, dtype, route=False, renormalize=True).placement == "columns"
    assert plan(65536, E, 9, dtype).placement == "sorted"
    assert plan(65536, E + 32, 8, dtype).placement == "sorted"


@pytest.mark.parametrize(
    "E, start, end, route, want",
    [
        (16, 0, 16, True, "counted"),  # <= 16 local experts
        (128, 0, 16, True, "counted"),  # the local range counts, not E
        (32, 0, 32, True, "sorted"),
        (8, 0, 8, False, "counted"),  # index_shuffling: counted below 16
        (16, 0, 16, False, "prefix"),  # index_shuffling: prefix sums for 16-32
        (32, 0, 32, False, "prefix"),
        (320, 0, 320, False, "sorted"),
        (256, 100, 117, False, "prefix"),  # 17 local experts pad to 32
    ],
)
def test_row_placements_by_local_experts(E, start, end, route, want):
    p = plan(1 << 20, E, 8, FP32, route, start, end)
    assert p.placement == want and p.topk == "insert"


def test_millions_of_experts_stay_ranked():
    """A sorted placement keys (local expert, index) in 32 bits: 2^24 local experts do not fit."""
    p = plan(100, 1 << 24, 512, FP32)
    assert p.placement == "ranked"


# ---------------------------------------------------------------------------------------------
# rule 2: top-k variants


def test_topk_variants():
    assert plan(1 << 20, 32, 16, BF16).topk == "rounds"  # k > 8
    ins = plan(1 << 20, 32, 8, BF16)
    assert ins.topk == "insert" and ins.fkey and ins.merge
    assert not plan(1 << 20, 32, 4, BF16).merge  # merge: top_k in 5..8
    assert plan(1 << 20, 32, 5, BF16).merge
    assert not plan(1 << 20, 32, 8, FP32).fkey and not plan(1 << 20, 32, 8, FP32).merge
    assert not plan(1 << 20, 256, 8, BF16).fkey  # fp32 keys: <= 128 experts
    assert not plan(1 << 20, 4, 4, BF16).merge


def test_packed_weights():
    assert plan(1 << 20, 32, 8, BF16).pack_w  # route, 16-bit, sorted
    assert plan(1 << 20, 16, 8, FP16).pack_w  # counted too
    assert not plan(1 << 20, 32, 8, BF16, renormalize=True).pack_w
    assert not plan(1 << 20, 32, 8, FP32).pack_w
    assert not plan(1 << 20, 32, 8, BF16, route=False).pack_w
    assert not plan(1 << 20, 320, 8, BF16).pack_w  # 9 expert + 9 index bits > 16


# ---------------------------------------------------------------------------------------------
# rule 3: programs


def test_programs():
    assert plan(1 << 20, 32, 8).tokens_per_program == 64  # insert
    assert plan(1 << 20, 128, 8).n_programs == (1 << 20) // 128  # columns
    ranked = plan(4096, 16, 8)
    assert (ranked.block_t, ranked.sub, ranked.n_programs) == (32, 1, 128)
    fp32 = plan(4096, 128, 8, FP32)
    assert fp32.block_t == 8  # 1024 keys a block for fp32 up to T = 65536
    rounds = plan(1 << 20, 128, 16, FP32)  # k > 8: C sorts about 512 pairs a program
    assert rounds.tokens_per_program * 16 == 512
    many = plan(1 << 20, 128, 8, FP32, constraints=Constraints(placement="ranked"))
    assert many.n_programs <= 4096  # the row families' blocks: at most 4096 programs
    one = plan(100, 16, 2, device=INTERPRETER)  # the interpreter: few, large programs
    assert one.block_t == 32 and one.warps_a == one.warps_c == 1


# ---------------------------------------------------------------------------------------------
# rules 4-6: scan, expert runs, the cooperative launch


def test_scan_in_c_only_where_every_program_reads_a_small_histogram():
    small = plan(4096, 16, 8)
    assert small.scan_in_c and small.n_programs <= SCAN_IN_C_MAX_PROGRAMS
    # 1024 programs of 64 tokens: a 16 x 1024 histogram fits the size bound, but 1024 programs
    # reading it all cost more than a scan launch (the old plan's cliff at T=65536, E=16, k=1)
    cliff = plan(65536, 16, 1)
    assert cliff.n_programs > SCAN_IN_C_MAX_PROGRAMS and not cliff.scan_in_c
    wide = plan(8192, 320, 4, FP32)  # 512 x n_programs entries: over the size bound
    assert 512 * max(2, 1 << (wide.n_programs - 1).bit_length()) > SCAN_IN_C_MAX_HIST
    assert not wide.scan_in_c
    assert plan(1 << 20, 128, 8, start=5, end=5).scan_in_c  # no local experts: nothing to scan


def test_expert_runs_follow_a_scan_launch_of_the_columns_plan():
    big = plan(1 << 20, 128, 8)
    assert big.placement == "columns" and not big.scan_in_c and big.expert_runs
    assert big.runs_group == 128
    assert not plan(1 << 20, 32, 8).expert_runs  # not columns
    assert not plan(8192, 128, 8, constraints=Constraints(placement="columns")).expert_runs


def test_c_warps_grow_with_the_histogram_it_reduces():
    """C reading the whole histogram: a warp per 2048 entries (<= 64 loads a thread, at most 8
    warps); the cooperative launch runs with C's warps for the row families, A's for columns."""
    small = plan(1024, 16, 2, FP32)  # 16 x 128 entries
    assert small.scan_in_c and small.warps_c == 1 and small.warps_fused == small.warps_a == 2
    wide = plan(1024, 128, 2, FP32)  # 128 x 128
    assert wide.scan_in_c and wide.warps_c == wide.warps_fused == 8
    cols = plan(16384, 128, 8)  # 128 x 128, columns: A's 4 warps in the cooperative launch
    assert cols.scan_in_c and cols.warps_c == 8 and cols.warps_fused == cols.warps_a == 4
    assert not plan(1 << 20, 128, 8).scan_in_c and plan(1 << 20, 128, 8).warps_c == 8


def test_cooperative_launch():
    assert plan(4096, 16, 8).cooperative  # scan in C, 128 programs <= 132 SMs
    assert not plan(4096, 16, 8, device=Device(sm_count=100)).cooperative
    assert not plan(4096, 16, 8, device=INTERPRETER).cooperative
    assert not plan(1 << 20, 128, 8).cooperative  # scan and D launches


def _selection(T, E, k, dtype=FP32, bias=True, groups=(1, 1), scaled=False, L=None):
    return Problem(T, E, k, 0, E if L is None else L, dtype, True, True, False, dtype != FP32,
                   bias, *groups, scaled)  # fmt: skip


@pytest.mark.parametrize(
    "prob",
    [
        _selection(65536, 256, 8, groups=(8, 4), scaled=True),  # DeepSeek-V3
        _selection(1 << 20, 256, 8, BF16, groups=(8, 4), scaled=True),
        _selection(65536, 128, 8, BF16),  # would be columns without the bias
        _selection(65536, 16, 2, bias=False, scaled=True),  # scale alone
        _selection(300000, 64, 4, bias=False, groups=(4, 2)),
    ],
    ids=str,
)
def test_selection_options_take_kernel_a_grouped(prob):
    """A bias, a group limit or scaled weights: kernel A 'grouped_insert' (top_k <= 8), a
    sorted placement (counted for <= 16 local experts), weights in fp32 scratch, two launches
    (no cooperative one)."""
    p = choose_plan(prob, H200)
    assert prob.selection and p.topk == "grouped_insert" and p.tokens_per_program == 64
    assert p.placement == ("counted" if prob.L <= 16 else "sorted")
    assert not p.pack_w and not p.cooperative
    assert p.block_t * p.sub <= (128 if p.placement == "counted" else 512)
    assert choose_plan(dataclasses.replace(prob, has_bias=False, n_groups=4, topk_groups=4,
                                           scaled=False), H200).topk[:7] != "grouped"  # fmt: skip


def test_selection_tile_where_insertion_cannot_or_is_slow():
    big = 1 << 16
    assert choose_plan(_selection(big, 64, 12, groups=(4, 2)), H200).topk == "grouped"  # k > 8
    assert choose_plan(_selection(big, 128, 8, groups=(64, 8)), H200).topk == "grouped"
    assert choose_plan(_selection(big, 128, 8, groups=(64, 64)), H200).topk == "grouped_insert"
    for T in (1, 64, 4096):  # up to RANKED_MAX_PAIRS pairs: small programs, one block each
        p = choose_plan(_selection(T, 256, 8, groups=(8, 4)), H200)
        assert p.topk == "grouped" and p.sub == 1 and p.block_t <= 4, (T, p)


def test_selection_constraints():
    prob = _selection(300, 64, 4, groups=(4, 2))
    tile = choose_plan(prob, H200, Constraints(block_t=2, sub=4))
    assert tile.topk == "grouped" and tile.tokens_per_program == 8
    for c in (Constraints(placement="ranked"), Constraints(topk="rounds"),
              Constraints(placement="columns"), Constraints(block_t=64)):  # fmt: skip
        with pytest.raises(ValueError):
            choose_plan(prob, H200, c)


def test_plans_are_frozen_and_repeatable():
    a, b = plan(65536, 64, 5, FP16), plan(65536, 64, 5, FP16)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.n_programs = 1


# ---------------------------------------------------------------------------------------------
# the typed override


def test_constraints_narrow_the_plan():
    c = Constraints(placement="sorted", topk="rounds", block_t=8, sub=2, scan_in_c=False)
    p = plan(100, 20, 3, FP32, constraints=c)
    assert (p.placement, p.topk, p.block_t, p.sub, p.scan_in_c) == ("sorted", "rounds", 8, 2,
                                                                      False)  # fmt: skip
    cols = plan(300, 128, 8, constraints=Constraints(placement="columns", scan_in_c=False,
                                                      runs_group=2))  # fmt: skip
    assert cols.expert_runs and cols.runs_group == 2
    assert plan(300, 20, 3, constraints=Constraints(placement="counted")).placement == "counted"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(placement="bitonic"), "placement"),
        (dict(topk="threshold"), "topk"),
        (dict(block_t=3), "block_t"),
        (dict(block_t=True), "block_t"),
        (dict(sub=0), "sub"),
        (dict(runs_group=512), "runs_group"),
        (dict(scan_in_c=1), "scan_in_c"),
    ],
)
def test_bad_constraints(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Constraints(**kwargs)


@pytest.mark.parametrize(
    "args, kw, c, match",
    [
        ((300, 96, 8), {}, Constraints(placement="columns"), "columns"),  # 96 experts
        ((300, 128, 8), dict(words=False), Constraints(placement="columns"), "columns"),
        ((300, 128, 8, FP32), {}, Constraints(placement="columns"), "columns"),
        ((300, 128, 8), {}, Constraints(placement="columns", block_t=4), "columns"),
        ((300, 32, 16), {}, Constraints(topk="insert"), "insert"),  # k > 8
        ((300, 32, 4), {}, Constraints(placement="ranked", topk="insert"), "insert"),
        ((300, 32, 4), {}, Constraints(placement="prefix"), "prefix"),  # route
        ((300, 32, 4), {}, Constraints(placement="sorted", topk="rounds", block_t=64), "block_t"),
        ((300, 32, 4), {}, Constraints(runs_group=2), "runs_group"),
        (
            (3000, 32, 4),
            {},
            Constraints(placement="counted", block_t=256, topk="insert"),
            "counted",
        ),  # fmt: skip
    ],
)
def test_constraints_the_problem_cannot_meet(args, kw, c, match):
    with pytest.raises(ValueError, match=match):
        plan(*args, constraints=c, **kw)
