"""The backend decision and the eager fast-path rule in ``moe_kernels._dispatch``."""

import warnings

import torch

from moe_kernels import _dispatch
from moe_kernels._dispatch import INTERPRET, eager_direct, op_name, use_triton


def test_use_triton_by_device():
    assert use_triton(torch.device("cuda")) is True
    assert use_triton(torch.device("cpu")) is INTERPRET


def test_op_name():
    assert op_name("route") == "moe_kernels::route"


def test_eager_direct_never_for_cpu_tensors():
    assert eager_direct(torch.zeros(2)) is False
    assert eager_direct(None, torch.zeros(2)) is False


def test_eager_direct_never_under_compile():
    seen = []

    def f(x):
        seen.append(eager_direct())  # no tensors: the rule is decided by the mode alone
        return x + 1

    assert eager_direct() is True  # plain eager, nothing to check
    torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2))
    assert seen == [False]


def test_eager_direct_never_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert eager_direct() is False


def test_sm_major_traces_without_warning(monkeypatch):
    """Dynamo traces the cached capability query (the GEMM rules call it while tracing) with no
    warning: it warned on every compiled layer while the cache was a ``functools.lru_cache``."""
    monkeypatch.setitem(_dispatch._SM_MAJOR, 0, 9)  # a cached sm90 device; no CUDA needed

    def f(x):
        return x * 2 if _dispatch.sm_major(0) >= 9 else x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_sm_major_is_a_trace_time_constant(monkeypatch):
    """From a cold cache, a compiled frame asks the device once, while tracing, and keeps the
    answer as a constant: Dynamo neither traces nor guards the cache dict (filling it inside a
    traced frame failed its guards on CUDA: the layer compiled from a fresh process crashed).
    A later change of the dict therefore neither recompiles nor changes the compiled result."""
    from types import SimpleNamespace

    from torch._dynamo.testing import CompileCounter

    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(major=9)

    monkeypatch.setattr(_dispatch, "_SM_MAJOR", {})  # a cold process
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)

    def f(x):
        return x * 2 if _dispatch.sm_major(0) >= 9 else x

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert asked == [0] and _dispatch._SM_MAJOR == {0: 9}
    _dispatch._SM_MAJOR[0] = 8  # not seen by the compiled frame: no guard on the dict
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert counter.frame_count == 1 and asked == [0]
    assert _dispatch.sm_major(0) == 8  # eager reads the cache
