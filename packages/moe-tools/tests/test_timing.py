"""The timer and memory helpers, on CPU (CUDA paths are exercised by the GPU benchmark run)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from moe_tools import timing


def test_percentile_interpolates_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert timing.percentile(xs, 0) == 1.0
    assert timing.percentile(xs, 100) == 5.0
    assert timing.percentile(xs, 50) == 3.0
    assert timing.percentile(xs, 90) == pytest.approx(4.6)
    assert timing.percentile([7.0], 99) == 7.0
    assert math.isnan(timing.percentile([], 50))


def test_timing_summary():
    t = timing.Timing([4.0, 1.0, 3.0, 2.0])
    assert t.median_ms == 2.5
    assert t.mean_ms == 2.5
    assert t.total_ms == 10.0
    assert t.p99_ms == pytest.approx(3.97)
    assert math.isnan(timing.Timing().median_ms)


def test_time_fn_calls_warmup_then_iters_and_measures_each_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = timing.time_fn(fn, "cpu", warmup=2, iters=5)
    assert len(calls) == 7
    assert len(t.times_ms) == 5
    assert all(ms >= 1.95 for ms in t.times_ms)  # each bracket covers (at least) its 2 ms sleep


def test_event_timer_on_cpu_brackets_each_block():
    timer = timing.EventTimer("cpu")
    for s in (0.001, 0.004):
        with timer:
            time.sleep(s)
    times = timer.result().times_ms
    assert len(times) == 2
    # sleep() guarantees a lower bound only: each bracket covers at least its sleep
    assert times[0] >= 0.95 and times[1] >= 3.95


def test_bench_us_on_cpu_is_microseconds():
    x = torch.randn(1000)
    us = timing.bench_us(lambda: time.sleep(0.001) or x.clone(), "cpu", cpu_iters=3)
    assert us >= 950.0  # microseconds: at least the 1 ms sleep


def test_memory_is_none_on_cpu():
    timing.reset_peak_memory("cpu")
    assert timing.memory_gib("cpu") == (None, None)
    assert timing.peak_memory_gib("cpu") == (None, None)


def test_default_device_matches_cuda_availability():
    assert timing.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
