"""The backend decision and the eager fast-path rule in ``moe_kernels._dispatch``."""

import warnings

import torch

from moe_kernels import _dispatch
from moe_kernels._dispatch import INTERPRET, op_name, use_triton
from moe_kernels.activation import expert_activation_op


def test_use_triton_by_device():
    assert use_triton(torch.device("cuda")) is True
    assert use_triton(torch.device("cpu")) is INTERPRET


def test_op_name():
    assert op_name("route") == "moe_kernels::route"


def test_route_never_direct_for_cpu_tensors():
    assert expert_activation_op.route(torch.zeros(2), False) == "op"
    assert expert_activation_op.route(None, torch.zeros(2)) == "op"


def test_route_never_direct_under_compile():
    seen = []

    def f(x):
        seen.append(expert_activation_op.route())  # no tensors: the mode alone decides
        return x + 1

    assert expert_activation_op.route() == "impl"  # plain eager, nothing to check
    torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2))
    assert seen == ["op"]


def test_route_never_direct_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert expert_activation_op.route() == "op"


def test_sm_major_traces_without_warning(monkeypatch):
    """Dynamo traces the cached capability query (the GEMM rules call it while tracing) with no
    warning: it warned on every compiled layer while the cache was a ``functools.lru_cache``."""
    monkeypatch.setitem(_dispatch._SM, 0, 90)  # a cached sm90 device; no CUDA needed

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
        return SimpleNamespace(major=9, minor=0)

    monkeypatch.setattr(_dispatch, "_SM", {})  # a cold process
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)

    def f(x):
        return x * 2 if _dispatch.sm_major(0) >= 9 else x

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert asked == [0] and _dispatch._SM == {0: 90}
    _dispatch._SM[0] = 80  # not seen by the compiled frame: no guard on the dict
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert counter.frame_count == 1 and asked == [0]
    assert _dispatch.sm_major(0) == 8  # eager reads the cache
