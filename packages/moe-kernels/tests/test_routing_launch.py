"""The routing launcher's bound relaunch (eager calls after the first of a launch plan pass int
addresses to the compiled handles): it must hand every kernel exactly what the full launch path
hands it. Checked on the CPU with recording stand-ins for the compiled kernels."""

from __future__ import annotations

import pytest
import torch

import moe_kernels._triton.launch as launch
import moe_kernels._triton.routing as R

pytestmark = pytest.mark.skipif(launch._HOOKS is None, reason="this Triton has no launch knobs")


class _Compiled:
    """Stands in for a compiled kernel: records each ``run``."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def run(self, g0, g1, g2, stream, function, metadata, *rest):
        assert (function, metadata) == (self.function, self.packed_metadata)
        self.calls.append((self.name, "run", (g0, g1, g2), rest[3:]))


class _Jit:
    """Stands in for a ``@triton.jit`` function: ``fn[grid](*args, **constexprs)`` records the
    call (constexprs appended in signature order) and returns a ``_Compiled``."""

    def __init__(self, real, name: str, calls: list) -> None:
        self.arg_names, self.name, self.calls = real.arg_names, name, calls

    def __getitem__(self, grid):
        def go(*args, num_warps=None, **constexprs):
            tail = tuple(constexprs[n] for n in self.arg_names[len(args) :])
            grid3 = (*grid, *(1,) * (3 - len(grid)))
            self.calls.append((self.name, "jit", grid3, args + tail))
            return _Compiled(self.name, self.calls)

        return go


class _Stream:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.active
        @staticmethod
        def get_current_stream(dev):
            return 0


@pytest.fixture
def calls(monkeypatch):
    calls: list = []
    kernels = (("_topk_rank", "A"), ("_topk_cols", "A"), ("_scan", "B"), ("_place", "C"),
               ("_expert_runs", "D"))  # fmt: skip
    for attr, name in kernels:
        real = getattr(R, attr).fn
        monkeypatch.setattr(R, attr, launch.FastKernel(_Jit(real, name, calls)))
    monkeypatch.setattr(launch.FastKernel, "enabled", True)
    monkeypatch.setattr(launch, "driver", _Stream)
    monkeypatch.setattr(R, "_BOUND", {})
    return calls


def _normalise(args, is_ptr, base, nbytes, named):
    """Pointers as ("buf", byte offset) inside the one buffer or by name (``named``: address ->
    name, for the inputs); ints as is."""
    out = []
    for a, ptr in zip(args, is_ptr, strict=True):
        if ptr:
            addr = a.data_ptr() if isinstance(a, torch.Tensor) else a
            out.append(("buf", addr - base) if base <= addr <= base + nbytes else named[addr])
        else:
            assert not isinstance(a, torch.Tensor)
            out.append(a)
    return out


CASES = [
    # (T, E, top_k, start, end, dtype, renormalize, vtc, with_weights, with_offsets, with_tcpe,
    #  config)
    (64, 16, 8, 0, 16, torch.bfloat16, False, False, True, True, False, None),  # route
    (64, 16, 8, 0, 16, torch.bfloat16, False, False, False, False, True, None),  # shuffling
    (300, 128, 8, 5, 77, torch.float32, True, True, True, True, False, {"FUSE_SCAN": 0}),
    (4096, 16, 8, 0, 16, torch.float16, False, True, False, False, True, None),  # sorted C
    # index_shuffling's token-column plan (A places the pairs), scan folded into C
    (4096, 128, 8, 3, 120, torch.bfloat16, False, True, False, False, True, {"SORTED": True}),
    # + the scan's launch and D (writes the pairs out by expert, RUNS); route there too
    (70000, 128, 8, 0, 128, torch.bfloat16, False, False, False, False, True, None),
    (70000, 128, 8, 0, 128, torch.bfloat16, False, False, True, True, False, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-{c[5]}")
def test_bound_relaunch_matches_the_full_launch(calls, case):
    T, E, k, start, end, dtype, renorm, with_vtc, ww, wo, wt, config = case
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(T, E, generator=gen).to(dtype)
    vtc = torch.tensor([T - 3], dtype=torch.int32) if with_vtc else None

    def call(scores, vtc):
        return R.routing_triton(
            scores, k, vtc, start, end, renorm, ww, wo, wt, config=config, one_buffer=True
        )

    out1 = call(scores, vtc)
    first = list(calls)
    assert [c[1] for c in first] == ["jit"] * len(first) and len(R._BOUND) == 1
    calls.clear()
    # new inputs of the same kind: the bound launches must read them, not the first ones
    scores2, vtc2 = scores.clone(), None if vtc is None else vtc.clone()
    out2 = call(scores2, vtc2)
    second = list(calls)
    assert [c[1] for c in second] == ["run"] * len(second)
    assert [(c[0], c[2]) for c in second] == [(c[0], c[2]) for c in first]

    plan = next(iter(R._BOUND))[0]
    p = R._launch_plan(*plan)
    assert ("MODE" in p.a) == (E == 128 and dtype == torch.bfloat16)  # the token-column plan
    nbytes = 4 * sum(p.sizes)
    base1, base2 = out1[2].data_ptr(), out2[2].data_ptr()  # expert_indices opens the buffer
    assert base1 != base2  # a new buffer per call
    named1 = {scores.data_ptr(): "scores"}
    named2 = {scores2.data_ptr(): "scores"}
    if vtc is not None:
        named1[vtc.data_ptr()], named2[vtc2.data_ptr()] = "vtc", "vtc"
    for (_, _, _, a1), (_, _, _, a2) in zip(first, second, strict=True):
        is_ptr = [isinstance(a, torch.Tensor) for a in a1]
        assert _normalise(a1, is_ptr, base1, nbytes, named1) == _normalise(
            a2, is_ptr, base2, nbytes, named2
        )
    for o1, o2 in zip(out1, out2, strict=True):  # same outputs, laid out alike in the buffer
        assert (o1 is None) == (o2 is None)
        if o1 is not None:
            assert (o1.shape, o1.dtype, o1.stride()) == (o2.shape, o2.dtype, o2.stride())
            assert o1.data_ptr() - base1 == o2.data_ptr() - base2


def test_bound_relaunch_keys_alignment_strides_and_plan(calls):
    """A call that Triton would specialise differently takes the full path again."""
    buf = torch.randn(4096 * 16 + 8).to(torch.bfloat16)
    aligned = buf[: 4096 * 16].view(4096, 16)
    shifted = buf[1 : 1 + 4096 * 16].view(4096, 16)  # 2-byte offset
    column_major = aligned.t().contiguous().t()
    bound = []
    for scores in (aligned, aligned, shifted, column_major, aligned[:2048]):
        R.routing_triton(scores, 8, None, 0, 16, False, True, True, False, one_buffer=True)
        bound.append(len(R._BOUND))
    # each call but the repeat of the first needs (and binds) a key of its own
    assert bound == [1, 1, 2, 3, 4]
    assert (shifted.data_ptr() % 16, column_major.stride()) == (2, (1, 4096))


def test_custom_op_path_never_binds(calls):
    scores = torch.randn(64, 16)
    for _ in range(2):
        R.routing_triton(scores, 4, None, 0, 16, False, True, True, False)
    assert R._BOUND == {} and {c[1] for c in calls} == {"jit", "run"}


def test_bound_table_is_bounded(calls, monkeypatch):
    monkeypatch.setattr(R, "_MAX_BOUND", 3)
    for T in (16, 32, 48, 64, 80):
        R.routing_triton(torch.randn(T, 8), 2, None, 0, 8, False, True, True, False,
                         one_buffer=True)  # fmt: skip
    # full after 48: starts over with 64, then binds 80
    assert [key[0][0] for key in R._BOUND] == [64, 80]  # T of each bound plan
