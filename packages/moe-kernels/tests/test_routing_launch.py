"""The routing launcher's bound relaunch (eager calls after the first of a launch plan pass int
addresses to the compiled handles): it must hand every kernel exactly what the full launch path
hands it. Checked on the CPU with recording stand-ins for the compiled kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the Triton launcher: nothing to test without Triton
import torch

import moe_kernels._triton.launch as launch
import moe_kernels._triton.routing.eager as lane
import moe_kernels._triton.routing.launch as R
import moe_kernels.routing as MR
from moe_kernels import _dispatch
from moe_kernels._triton.routing.plan import Constraints, Device, choose_plan

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
        self.cooperative: list[bool] = []

    def __getitem__(self, grid):
        def go(*args, num_warps=None, launch_cooperative_grid=False, **constexprs):
            tail = tuple(constexprs[n] for n in self.arg_names[len(args) :])
            grid3 = (*grid, *(1,) * (3 - len(grid)))
            self.calls.append((self.name, "jit", grid3, args + tail))
            self.cooperative.append(launch_cooperative_grid)
            return _Compiled(self.name, self.calls)

        return go


class _Stream:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.active
        @staticmethod
        def get_current_stream(dev):
            return 0


NO_COOPERATIVE = Device(sm_count=0)  # a device where no grid is small enough to fuse


@pytest.fixture
def calls(monkeypatch):
    calls: list = []
    kernels = (("_topk_rows", "A"), ("_topk_columns", "A"), ("_scan", "B"), ("_place", "C"),
               ("_expert_runs", "D"), ("_fused", "AC"))  # fmt: skip
    for attr, name in kernels:
        real = getattr(R, attr).fn
        monkeypatch.setattr(R, attr, launch.FastKernel(_Jit(real, name, calls)))
    monkeypatch.setattr(launch.FastKernel, "enabled", True)
    monkeypatch.setattr(launch, "driver", _Stream)
    monkeypatch.setattr(lane, "_BOUND", {})
    monkeypatch.setattr(R, "device_of", lambda index: NO_COOPERATIVE)
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
    # (T, E, top_k, start, end, dtype, renormalize, vtc, route, constraints)
    (64, 16, 8, 0, 16, torch.bfloat16, False, False, True, None),  # route
    (64, 16, 8, 0, 16, torch.bfloat16, False, False, False, None),  # index_shuffling
    (300, 128, 8, 5, 77, torch.float32, True, True, True, Constraints(scan_in_c=False)),
    (4096, 16, 8, 0, 16, torch.float16, False, True, False, Constraints(placement="counted")),
    # the columns plan (A places the pairs), scan folded into C
    (4096, 128, 8, 3, 120, torch.bfloat16, False, True, False, Constraints(placement="columns")),
    # + the scan's launch and D (writes the pairs out by expert); route there too
    (70000, 128, 8, 0, 128, torch.bfloat16, False, False, False, None),
    (70000, 128, 8, 0, 128, torch.bfloat16, False, False, True, None),
]


def _fuse_where_gpu_would(monkeypatch) -> torch.Tensor:
    """Make the CPU launcher take the cooperative launch wherever the plan allows it (no scan or
    D launch; a device with SMs for any grid), with stand-in barrier words; returns them."""
    bar = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(R, "device_of", lambda index: Device(sm_count=1 << 30))
    monkeypatch.setattr(R, "barrier_words", lambda dev, stream: bar)
    return bar


@pytest.mark.parametrize("fused", [False, True], ids=["launches", "fused"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-{c[5]}")
def test_bound_relaunch_matches_the_full_launch(calls, case, fused, monkeypatch):
    T, E, k, start, end, dtype, renorm, with_vtc, route, constraints = case
    bar = _fuse_where_gpu_would(monkeypatch) if fused else None
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(T, E, generator=gen).to(dtype)
    vtc = torch.tensor([T - 3], dtype=torch.int32) if with_vtc else None

    def call(scores, vtc):
        return R.run(scores, k, vtc, start, end, renorm, route, constraints, one_buffer=True)

    out1 = call(scores, vtc)
    first = list(calls)
    assert [c[1] for c in first] == ["jit"] * len(first) and len(lane._BOUND) == 1
    calls.clear()
    # new inputs of the same kind: the bound launches must read them, not the first ones
    scores2, vtc2 = scores.clone(), None if vtc is None else vtc.clone()
    out2 = call(scores2, vtc2)
    second = list(calls)
    assert [c[1] for c in second] == ["run"] * len(second)
    assert [(c[0], c[2]) for c in second] == [(c[0], c[2]) for c in first]

    prob = R.problem_of(scores, k, vtc, start, end, renorm, route)
    plan = choose_plan(prob, R.device_of(0), constraints)
    p = R.launches(prob, plan)
    assert (plan.placement == "columns") == (E == 128 and dtype == torch.bfloat16)
    one = fused and p.scan is None and p.runs is None
    assert [c[0] for c in first] == (["AC"] if one else [c[0] for c in first if c[0] != "AC"])
    nbytes = 4 * sum(p.sizes)
    base1, base2 = out1.expert_indices.data_ptr(), out2.expert_indices.data_ptr()  # buffer start
    assert base1 != base2  # a new buffer per call
    named1 = {scores.data_ptr(): "scores"}
    named2 = {scores2.data_ptr(): "scores"}
    if bar is not None:
        named1[bar.data_ptr()] = named2[bar.data_ptr()] = "barrier"
    if vtc is not None:
        named1[vtc.data_ptr()], named2[vtc2.data_ptr()] = "vtc", "vtc"
    for (_, _, _, a1), (_, _, _, a2) in zip(first, second, strict=True):
        is_ptr = [isinstance(a, torch.Tensor) for a in a1]
        assert _normalise(a1, is_ptr, base1, nbytes, named1) == _normalise(
            a2, is_ptr, base2, nbytes, named2
        )
    assert type(out1) is type(out2)
    for o1, o2 in zip(out1, out2, strict=True):  # same outputs, laid out alike in the buffer
        assert (o1.shape, o1.dtype, o1.stride()) == (o2.shape, o2.dtype, o2.stride())
        assert o1.data_ptr() - base1 == o2.data_ptr() - base2


def _named_args(kernel, args, base, nbytes, named):
    """A recorded call's arguments (runtime, then constexprs) by the kernel's parameter names."""
    is_ptr = [isinstance(a, torch.Tensor) for a in args]
    return dict(zip(kernel.arg_names, _normalise(args, is_ptr, base, nbytes, named), strict=True))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == 4096 or c[0] == 64],
                         ids=lambda c: f"T{c[0]}-E{c[1]}-{c[5]}")  # fmt: skip
def test_fused_launch_hands_a_and_c_what_their_own_launches_get(calls, case, monkeypatch):
    """``fused_kernel`` runs A's and C's bodies: by parameter name, every runtime argument and
    constexpr A and C get in two launches reaches the fused launch with the same value (A's
    ``scr_w_ptr`` as ``a_w_ptr``), and the launch is cooperative."""
    T, E, k, start, end, dtype, renorm, with_vtc, route, constraints = case
    scores = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).to(dtype)
    vtc = torch.tensor([T - 3], dtype=torch.int32) if with_vtc else None
    named = {scores.data_ptr(): "scores"}
    if vtc is not None:
        named[vtc.data_ptr()] = "vtc"

    def launch():
        calls.clear()
        out = R.run(scores, k, vtc, start, end, renorm, route, constraints, one_buffer=True)
        buf = out.expert_indices._base  # expert_indices opens the one buffer
        return {c[0]: c[3] for c in calls}, buf.data_ptr(), 4 * buf.numel()

    two, base2, n2 = launch()
    assert sorted(two) == ["A", "C"]
    lane._BOUND.clear()
    bar = _fuse_where_gpu_would(monkeypatch)
    named[bar.data_ptr()] = "barrier"
    one, base1, n1 = launch()
    assert list(one) == ["AC"] and R._fused.fn.cooperative == [True]
    fused = _named_args(R._fused.fn, one["AC"], base1, n1, named)
    columns = fused["PLACE"] == 4
    ka = R._topk_columns if columns else R._topk_rows
    a = _named_args(ka.fn, two["A"], base2, n2, named)
    c = _named_args(R._place.fn, two["C"], base2, n2, named)
    a["a_w_ptr"] = a.pop("scr_w_ptr")
    for name, value in (*a.items(), *c.items()):
        assert fused[name] == value, name
    assert fused["bar_ptr"] == "barrier" and columns == ("MODE" in a)


def test_bound_relaunch_keys_alignment_strides_and_plan(calls):
    """A call that Triton would specialise differently takes the full path again."""
    buf = torch.randn(4096 * 16 + 8).to(torch.bfloat16)
    aligned = buf[: 4096 * 16].view(4096, 16)
    shifted = buf[1 : 1 + 4096 * 16].view(4096, 16)  # 2-byte offset
    column_major = aligned.t().contiguous().t()
    bound = []
    for scores in (aligned, aligned, shifted, column_major, aligned[:2048]):
        R.run(scores, 8, None, 0, 16, False, True, one_buffer=True)
        bound.append(len(lane._BOUND))
    # each call but the repeat of the first needs (and binds) a key of its own
    assert bound == [1, 1, 2, 3, 4]
    assert (shifted.data_ptr() % 16, column_major.stride()) == (2, (1, 4096))


def test_custom_op_path_never_binds(calls):
    scores = torch.randn(64, 16)
    for _ in range(2):
        R.run(scores, 4, None, 0, 16, False, True)
    assert lane._BOUND == {} and {c[1] for c in calls} == {"jit", "run"}


def test_bound_table_is_bounded(calls, monkeypatch):
    monkeypatch.setattr(lane, "_MAX_BOUND", 3)
    for T in (16, 32, 48, 64, 80):
        R.run(torch.randn(T, 8), 2, None, 0, 8, False, True, one_buffer=True)
    # full after 48: starts over with 64, then binds 80
    assert [key[0][0] for key in lane._BOUND] == [64, 80]  # T of each bound plan


# ---------------------------------------------------------------------------------------------
# The public ops' fast lane (routing/eager.py): tried before the argument checks, so a bound key
# must imply them; checked with CPU tensors let through the lane and the stand-in kernels.


@pytest.fixture
def public(calls, monkeypatch):
    """The public ops on CPU tensors through the eager path and the lane; returns the recorded
    launches and the names of the calls that ran the argument checks."""
    monkeypatch.setattr(MR, "_LANE_ON_CPU", True)
    monkeypatch.setattr(_dispatch, "DIRECT_DEVICES", ("cuda", "cpu"))  # the direct path on CPU
    monkeypatch.setattr(MR, "use_triton", lambda device: True)
    checked: list = []
    check = MR._check
    monkeypatch.setattr(MR, "_check", lambda *a: checked.append(a[1]) or check(*a))
    return calls, checked


def _call(op, scores, vtc, **kw):
    if op == "route":
        return tuple(MR.route(scores, 8, valid_token_count=vtc, **kw))
    return MR.index_shuffling(scores, valid_token_count=vtc, top_k=8, **kw)


@pytest.mark.parametrize("with_vtc", [False, True])
@pytest.mark.parametrize("op", ["route", "index_shuffling"])
def test_public_calls_take_the_lane_once_bound(public, op, with_vtc):
    """The first call checks its arguments and launches through Triton (binding its key); the
    next one of the same kind skips both and relaunches the same kernels on its own tensors,
    with outputs laid out alike."""
    calls, checked = public
    gen = torch.Generator().manual_seed(2)
    scores = [torch.randn(256, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
    vtcs = [torch.tensor([n], dtype=torch.int32) if with_vtc else None for n in (200, 100)]
    out1 = _call(op, scores[0], vtcs[0])
    first = list(calls)
    assert checked and {c[1] for c in first} == {"jit"} and len(lane._BOUND) == 1
    calls.clear(), checked.clear()
    out2 = _call(op, scores[1], vtcs[1])
    second = list(calls)
    assert not checked and {c[1] for c in second} == {"run"}
    assert [(c[0], c[2]) for c in second] == [(c[0], c[2]) for c in first]
    base1, base2 = out1[-1]._base.data_ptr(), out2[-1]._base.data_ptr()
    nbytes = 4 * out1[-1]._base.numel()
    named1, named2 = {scores[0].data_ptr(): "scores"}, {scores[1].data_ptr(): "scores"}
    if with_vtc:
        named1[vtcs[0].data_ptr()], named2[vtcs[1].data_ptr()] = "vtc", "vtc"
    for (_, _, _, a1), (_, _, _, a2) in zip(first, second, strict=True):
        is_ptr = [isinstance(a, torch.Tensor) for a in a1]
        assert _normalise(a1, is_ptr, base1, nbytes, named1) == _normalise(
            a2, is_ptr, base2, nbytes, named2
        )
    assert len(out1) == len(out2) == (6 if op == "route" else 3)
    for o1, o2 in zip(out1, out2, strict=True):
        assert (o1.shape, o1.dtype, o1.stride()) == (o2.shape, o2.dtype, o2.stride())
        assert o1.data_ptr() - base1 == o2.data_ptr() - base2


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(top_k=True), TypeError),  # == 1 and hashes like it: the key must tell them apart
        (dict(top_k=17), ValueError),
        (dict(expert_index_start=2.0), TypeError),
        (dict(expert_index_end=17), ValueError),
        (dict(valid_token_count=torch.tensor([3, 4], dtype=torch.int32)), ValueError),
        (dict(valid_token_count=torch.tensor([3.0])), TypeError),
        (dict(renormalize=1), TypeError),  # route: == True
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else v.__name__,
)
def test_bound_keys_keep_the_argument_checks(public, kw, error):
    """After binding the valid call each variant differs from, the variant still raises."""
    scores = torch.randn(64, 16).to(torch.bfloat16)
    vtc = torch.tensor([50], dtype=torch.int32)
    good = dict(top_k=1, expert_index_start=2, expert_index_end=16, valid_token_count=vtc)
    op = MR.route if "renormalize" in kw else MR.index_shuffling
    if op is MR.route:
        good["renormalize"] = True
    for _ in range(2):  # bind, then hit
        op(scores, **good)
    assert len(lane._BOUND) == 1
    with pytest.raises(error):
        op(scores, **{**good, **kw})


def test_lane_is_off_for_autograd_fake_tensors_and_compilation(public, monkeypatch):
    """The lane's key is None (the full path, through the custom op where it must) for scores
    that need autograd, under a dispatch mode (fake tensors) and while compiling."""
    scores = torch.randn(64, 16)
    args = (None, 8, None, None, False, False)
    assert lane.lane_key(scores, *args) is not None
    assert lane.lane_key(scores.clone().requires_grad_(), *args) is None
    lane_args = (scores, None, 8, None, None, False, False)
    assert MR._fast(*lane_args)[0] is not None
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert MR._fast(*lane_args) == (None, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert MR._fast(*lane_args) == (None, None)
