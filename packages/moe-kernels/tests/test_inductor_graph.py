"""Under ``torch.compile`` every op's kernels reach Inductor's graph as launches it emits itself,
writing only their own fresh outputs (no copies), on a machine without a GPU.

``_dispatch.register_op`` traces an op's implementation into the graph where its kernels run on
CUDA; Inductor then lowers each ``wrap_triton`` launch. A launch whose argument Inductor's TTIR
analysis believes written, while the tensor is an input or a view of a shared buffer, gets a
copy before it (and after it, for a graph input): host time and device passes on every call
(session 16 found 18 such copies per ``route`` call). Here the CPU stands in for CUDA: the
kernels are traced (not run) for an sm_90 target, and the graph is read right after Inductor's
reinplacing and the lowering of the functional launches, where every launch must be a mutation
node and no ``clone`` / ``copy`` / ``*_scatter`` node may remain. Skipped under the interpreter
(whose ops stay opaque) and where this torch or Triton lacks the pieces.

The second half runs Inductor to the end (``module_of``): it writes its module, imports it, and
Triton compiles each kernel's source as Inductor embeds it for sm_90a (a kernel constant that
the module mangles, like the multi-line PTX string torch 2.11 wrote as an unterminated literal,
fails there), for every op and every routing plan, with static sizes and with symbolic ints (a
``top_k`` or an expert range made dynamic, dynamic shapes), where the op must stay opaque rather
than fail. The run stops at the module's first launch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_kernels._dispatch import INTERPRET
from moe_kernels.testing import ROUTING_PLANS, SELECTION_PLANS

pytestmark = [
    pytest.mark.skipif(INTERPRET, reason="ops are opaque under the interpreter"),
    # torch 2.14's Inductor says so of the CPU tensors standing in for CUDA: true, and expected
    pytest.mark.filterwarnings("ignore:Could not find an active CPU backend:UserWarning"),
]

T, E, K, D, H = 64, 16, 8, 256, 128


class _Stop(Exception):
    """Raised once the graph is read: nothing is lowered to code for the stand-in device."""


class _Sm90:
    """A Triton driver answering only the target: what the TTIR analysis asks for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def graph_of(monkeypatch):
    """``graph_of(fn, *args)``: the node targets of fn's post-grad graph, as strings."""
    import triton

    import moe_kernels._dispatch as dispatch
    from moe_kernels._triton import grouped_mm
    from moe_kernels._triton.routing import launch as routing_launch
    from moe_kernels._triton.routing.plan import Device

    try:
        import torch._inductor.fx_passes.post_grad as post_grad

        lower = post_grad.decompose_triton_kernel_wrapper_functional
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"no post-grad lowering of triton launches here: {exc}")
    monkeypatch.setattr(dispatch, "_BACKEND", "triton")  # CPU tensors run the launchers
    monkeypatch.setattr(dispatch, "_traced_kernels", lambda args: True)
    monkeypatch.setattr(routing_launch, "device_of", lambda index: Device(sm_count=132))
    monkeypatch.setattr(grouped_mm, "_device_limits", lambda index: (227 * 1024, True))
    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90())
    seen: list[str] = []

    def read(graph):
        lower(graph)
        seen.extend(str(n.target) for n in graph.nodes if n.op == "call_function")
        raise _Stop

    monkeypatch.setattr(post_grad, "decompose_triton_kernel_wrapper_functional", read)

    def run(fn, *args, dynamic=False):
        seen.clear()
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:  # noqa: PT011 - _Stop, wrapped by Inductor
            torch.compile(fn, fullgraph=True, dynamic=dynamic)(*args)
        if not any(isinstance(e, _Stop) for e in _chain(info.value)):
            raise info.value
        return list(seen)

    with torch._inductor.config.patch(fx_graph_cache=False):  # post-grad runs on every compile
        yield run
    torch._dynamo.reset()


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _plan():
    from moe_kernels.reference.routing import route_reference

    scores = torch.randn(T, E).softmax(-1)
    return scores, route_reference(scores, K, None, 0, E, False)


def _cases():
    import moe_kernels as mk
    from moe_kernels.reference import mxfp8 as ref_mx

    g = torch.Generator().manual_seed(0)
    scores, plan = _plan()
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = torch.randn(E, H, D, generator=g).bfloat16()
    ys = torch.randn(T * K, D, generator=g).bfloat16()
    data, scale = ref_mx.to_mxfp8(ys, "rceil")
    ends = plan.offsets[1:].to(torch.int32)

    def scatter(out, y, tok):
        mk.scatter_add_dense_tokens(out, y, tok)
        return out

    def padded_scatter(src, counts, tok, out):
        mk.scatter_add_padded_tokens(src, counts, tok, out)
        return out

    ep, per_rank = 4, T * K // 4
    counts_EP = torch.full((ep, E // ep), per_rank // (E // ep), dtype=torch.int32)
    return {
        "silu_mul": (lambda a, b: mk.silu_mul(a, b), (x[:, : D // 2], x[:, D // 2 :])),
        "silu_mul_quant": (
            lambda a, b, u: mk.silu_mul_quant(a, b, u),
            (x[:, : D // 2], x[:, D // 2 :], torch.tensor([1200.0])),
        ),
        "gather_scale_quant_dense_tokens": (
            lambda a, t, e, s: mk.gather_scale_quant_dense_tokens(a, t, e, s),
            (x, plan.token_indices, plan.expert_indices, scores),
        ),
        "combine_shuffling": (lambda a, c: mk.combine_shuffling(a, c), (ys, counts_EP)),
        "split_shuffling": (
            lambda a, c: mk.split_shuffling(a, c, 1, 3, is_padded=True),
            (ys, counts_EP),
        ),
        "scatter_add_padded_tokens": (
            padded_scatter,
            (
                ys.view(ep, T * K // ep, D)[:, : T * K // ep],
                torch.full((E,), 2, dtype=torch.int32),
                plan.token_indices[: T * K // ep],
                torch.zeros(T * K // ep, D).bfloat16(),
            ),
        ),  # fmt: skip
        "router_scores": (lambda a, w: mk.router_scores(a, w), (x, torch.randn(E, D))),
        "route": (lambda s: mk.route(s, K, renormalize=True), (scores,)),
        "route_many_tokens": (lambda s: mk.route(s, 2), (torch.randn(50000, E).softmax(-1),)),
        "index_shuffling": (lambda s: mk.index_shuffling(s, top_k=K), (scores.bfloat16(),)),
        "dispatch": (lambda a, p: mk.dispatch(a, p), (x, plan)),
        "combine": (lambda y, p: mk.combine(y, p), (ys, plan)),
        "gather_grouped_mm": (
            lambda a, w, p: mk.gather_grouped_mm(
                a, w, p.offsets, p.token_indices, activation="silu"
            ),
            (x, w1, plan),
        ),
        "scatter_add_dense_tokens": (scatter, (torch.zeros(T, D), ys, plan.token_indices)),
        "to_mxfp8": (lambda a: mk.to_mxfp8(a), (ys,)),
        "to_mxfp8_dim1": (lambda a: mk.to_mxfp8_dim1(a), (ys,)),
        "from_mxfp8": (lambda d, s: mk.from_mxfp8(d, s), (data, scale)),
        "to_blocked_per_group_2d": (lambda s, e: mk.to_blocked_per_group_2d(s, e), (scale, ends)),
        "qk_norm_rope": (_rope, _rope_args(g)),
    }


def _rope(q, k, v, wq, wk, cos, sin, k_cache, v_cache, slots):
    """The attention prologue of a commit pass: the cache (a graph input) written in place."""
    import moe_kernels as mk

    out = mk.qk_norm_rope(q, k, v, wq, wk, cos, sin, k_cache, v_cache, 1, slots)
    return out, k_cache, v_cache


def _rope_args(g: torch.Generator) -> tuple:
    n, heads, kv, dh = 32, 4, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv) * dh, generator=g).bfloat16()
    q, k, v = qkv.split([heads * dh, kv * dh, kv * dh], dim=1)
    cache = torch.zeros(2, kv, 3, n, dh, dtype=torch.bfloat16)
    return (q, k, v, torch.ones(dh), torch.ones(dh), torch.rand(n, dh // 2),
            torch.rand(n, dh // 2), cache, cache.clone(), torch.tensor([2, 0]))  # fmt: skip


CASES = list(_cases())


@pytest.mark.parametrize("name", CASES)
def test_launches_are_inductor_mutations_without_copies(graph_of, name):
    fn, args = _cases()[name]
    targets = graph_of(fn, *args)
    launches = [t for t in targets if "triton_kernel_wrapper" in t]
    assert launches, f"no kernel launch reached the graph: {targets}"
    assert all("triton_kernel_wrapper_mutation" in t for t in launches), launches
    copies = [t for t in targets if any(w in t for w in ("clone", "copy", "scatter"))]
    assert not copies, f"copies around the launches: {copies}"
    assert not any("moe_kernels" in t for t in targets), "an op stayed opaque"


@pytest.mark.parametrize("name", ["route", "dispatch", "gather_grouped_mm"])
def test_symbolic_sizes_keep_the_op_opaque(graph_of, name):
    """Under dynamic shapes the launchers cannot choose plans and grids: the op stays whole."""
    fn, args = _cases()[name]
    targets = graph_of(fn, *args, dynamic=True)
    assert any(t.startswith(f"moe_kernels.{name}") for t in targets), targets
    assert not any("triton_kernel_wrapper" in t for t in targets), targets


# --------------------------------------------------------------------------------------------
# Inductor's module, written and imported


class _Ran(Exception):
    """Raised by the first launch of the compiled module: Inductor's own (``CachingAutotuner.run``)
    or an opaque op's (the stand-in driver asked for a device or stream)."""

    def __init__(self, opaque: bool) -> None:
        super().__init__("opaque op launched" if opaque else "Inductor launched a kernel")
        self.opaque = opaque


class _Sm90Runtime(_Sm90):
    def get_current_device(self):
        raise _Ran(opaque=True)

    def get_current_stream(self, *args):
        raise _Ran(opaque=True)


@pytest.fixture
def module_of(monkeypatch):
    """``module_of(fn, *args, dynamic=False)`` -> (kernels Triton compiled for sm_90a from the
    module's sources, whether the first launch was an opaque op's)."""
    import triton
    from triton.backends.compiler import GPUTarget

    import moe_kernels._dispatch as dispatch
    from moe_kernels._triton import grouped_mm
    from moe_kernels._triton.routing import launch as routing_launch
    from moe_kernels._triton.routing.plan import Device

    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        CachingAutotuner._make_launchers  # noqa: B018 - the seams this fixture uses
        CachingAutotuner.run  # noqa: B018
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"this torch's Inductor lacks the seams used here: {exc}")
    monkeypatch.setattr(dispatch, "_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "_traced_kernels", lambda args: True)
    monkeypatch.setattr(routing_launch, "device_of", lambda index: Device(sm_count=132))
    monkeypatch.setattr(grouped_mm, "_device_limits", lambda index: (227 * 1024, True))
    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Runtime())
    compiled: list[str] = []
    real_compile = triton.compile

    def compile_sm90(src, target=None, options=None):  # noqa: ANN001, ANN202
        options = {**(options or {}), "debug": False}  # as test_compile_sm90 compiles them
        kernel = real_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        compiled.append(getattr(src.fn, "__name__", str(src.fn)))
        return kernel

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN202
        raise _Ran(opaque=False)

    _cpu_stands_for_sm90(monkeypatch)
    monkeypatch.setattr(triton, "compile", compile_sm90)
    monkeypatch.setattr(CachingAutotuner, "_make_launchers", lambda self: None)  # no driver
    monkeypatch.setattr(CachingAutotuner, "run", launch)

    def run(fn, *args, dynamic=False, compiled_fn=None):
        compiled.clear()
        _forget_compiled_modules()  # a module or kernel loaded before is not compiled again
        if compiled_fn is None:
            torch._dynamo.reset()
            compiled_fn = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        with pytest.raises(Exception) as info:  # noqa: PT011 - _Ran, maybe wrapped by torch
            compiled_fn(*args)
        ran = next((e for e in _chain(info.value) if isinstance(e, _Ran)), None)
        if ran is None:
            raise info.value
        return list(compiled), ran.opaque

    # no worker (the patches reach none), no FX graph cache (a cached module skips code generation)
    with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False):
        yield run
    torch._dynamo.reset()


def _cpu_stands_for_sm90(monkeypatch) -> None:
    """torch 2.14 checks a launch's backend options (``num_warps``, ...) against the tensors'
    device: there the CPU answers as sm_90a (each seam found by name, absent in older torch)."""
    from torch._dynamo import device_interface
    from triton.backends.compiler import GPUTarget

    cpu = getattr(device_interface, "CpuInterface", None)
    if hasattr(cpu, "raise_if_triton_unavailable"):
        answer = staticmethod(lambda device=None: None)
        monkeypatch.setattr(cpu, "raise_if_triton_unavailable", answer)
    try:
        from torch._inductor.runtime import triton_helpers
    except ImportError:
        return
    real = getattr(triton_helpers, "get_backend_options_for_target", None)
    if real is not None:
        sm90 = GPUTarget("cuda", 90, 32)
        monkeypatch.setattr(triton_helpers, "get_backend_options_for_target",
                            lambda target, options=None: real(sm90, options))  # fmt: skip


def _forget_compiled_modules() -> None:
    """Inductor's in-process caches of loaded modules and compiled kernels, cleared (each found
    by name: these internals move between torch versions)."""
    from torch._inductor import async_compile, codecache

    for owner, name in ((codecache, "PyCodeCache"), (async_compile, "CompiledTritonKernels")):
        clear = getattr(getattr(owner, name, None), "cache_clear", None)
        if clear is not None:
            clear()


@pytest.mark.parametrize("name", CASES)
def test_inductor_module_imports_and_compiles(module_of, name):
    """Every op's launches, as Inductor writes them, compile for sm_90a and run from its module."""
    fn, args = _cases()[name]
    kernels, opaque = module_of(fn, *args)
    assert kernels and not opaque, (kernels, opaque)


def _routing_call(plan, route):
    """(fn, scores) of one routing plan of ``test_compile_sm90``, on uninitialised scores."""
    T, E, k, start, end, kind, renorm, *sel = plan
    dtype = (torch.float32, torch.bfloat16, torch.float16)[kind]
    scores = torch.empty(T, E, dtype=dtype)
    if not route:
        return (lambda s: mk_().index_shuffling(s, start, end, None, k)), scores
    opts = {}
    if sel:
        bias, n_groups, topk_groups, scaled = sel
        opts = dict(n_groups=n_groups, topk_groups=topk_groups, scale=2.5 if scaled else 1.0,
                    bias=torch.zeros(E) if bias else None)  # fmt: skip
    return (lambda s: mk_().route(s, k, expert_index_start=start, expert_index_end=end,
                                  renormalize=renorm, **opts)), scores  # fmt: skip


def mk_():
    import moe_kernels

    return moe_kernels


def _routing_plans():
    plans = ROUTING_PLANS
    return [(p, False) for p in plans] + [(p, True) for p in plans + SELECTION_PLANS]


@pytest.mark.slow  # ~2 minutes of Triton compiles on two cores: the newest torch's session only
@pytest.mark.parametrize(("plan", "route"), _routing_plans(), ids=str)
def test_every_routing_plan_runs_from_inductors_module(module_of, plan, route):
    """Inductor launches every plan's kernels, but for the ``columns`` plans, which stay one
    opaque op (``launch.traceable``: Inductor's TTIR analysis of that kernel takes minutes)."""
    fn, scores = _routing_call(plan, route)
    kernels, opaque = module_of(fn, scores)
    if _placement(plan, route) == "columns":
        assert opaque and not kernels, kernels
        return
    assert not opaque and "place_kernel" in kernels, kernels
    assert any(k.startswith("topk_") for k in kernels), kernels


def _placement(plan, route) -> str:
    """The plan family the chooser picks for a ``ROUTING_PLANS`` entry on a 132-SM device."""
    from moe_kernels._routing_outputs import Selection
    from moe_kernels._triton.routing.launch import problem_of
    from moe_kernels._triton.routing.plan import Device, choose_plan

    T, E, k, start, end, kind, renorm, *sel = plan
    dtype = (torch.float32, torch.bfloat16, torch.float16)[kind]
    selection = None
    if sel:
        bias, n_groups, topk_groups, scaled = sel
        selection = Selection(torch.zeros(E) if bias else None, n_groups, topk_groups,
                              2.5 if scaled else 1.0)  # fmt: skip
    p = problem_of(torch.empty(T, E, dtype=dtype), k, None, start, end, renorm, route, selection)
    return choose_plan(p, Device(sm_count=132)).placement


def test_columns_plans_stay_opaque_and_others_are_traced(module_of):
    """The plan decides: 16-bit scores over 128 experts, top_k=8 (columns) keep route and
    index_shuffling whole; the same call over fp32 scores (rows) is traced."""
    import moe_kernels as mk

    for dtype, columns in ((torch.bfloat16, True), (torch.float32, False)):
        scores = torch.empty(4096, 128, dtype=dtype)
        for fn in (lambda s: mk.route(s, 8), lambda s: mk.index_shuffling(s, top_k=8)):
            kernels, opaque = module_of(fn, scores)
            assert opaque == columns and bool(kernels) != columns, (dtype, kernels)


@pytest.mark.parametrize("name", ["route", "index_shuffling", "dispatch", "combine"])
def test_dynamic_shapes_keep_the_op_opaque_in_the_module(module_of, name):
    fn, args = _cases()[name]
    kernels, opaque = module_of(fn, *args, dynamic=True)
    assert opaque and not kernels, kernels


def test_symbolic_routing_ints_keep_the_op_opaque(module_of):
    """One compiled function called with several top_k, expert ranges and valid counts (as
    FBGEMM's tests call index_shuffling): never an error. Ints dynamo makes symbolic (here all
    of them, the scores static) reach the op, which stays opaque; the direct op call skips the
    argument checks, whose isinstance tests would specialise them."""
    ops = torch.ops.moe_kernels
    scores = torch.empty(64, 128, dtype=torch.bfloat16)
    torch._dynamo.mark_static(scores)
    torch._dynamo.reset()
    fns = {
        "index_shuffling": lambda s, k, a, b, c: ops.index_shuffling(s, a, b, c, k),
        "route": lambda s, k, a, b, c: ops.route(s, k, c, a, b, False, None, 1, 1, 1.0),
    }
    for name, fn in fns.items():
        compiled = torch.compile(fn, fullgraph=True, dynamic=True)
        for k, start, end, vtc in ((1, 0, 128, None), (2, 32, 64, torch.tensor([7])),
                                   (8, 0, 16, torch.tensor([64], dtype=torch.int64))):  # fmt: skip
            kernels, opaque = module_of(None, scores, k, start, end, vtc, compiled_fn=compiled)
            assert opaque and not kernels, (name, k, start, end, kernels)


def test_recompiles_with_new_top_k_and_ranges_run(module_of):
    """The public functions called with several top_k and expert ranges by one compiled
    function: every recompile's module runs (launched by Inductor or opaque), none fails."""
    import moe_kernels as mk

    scores = torch.empty(1, 128, dtype=torch.bfloat16)  # FBGEMM's num_tokens=1 calls
    compiled = torch.compile(
        lambda s, k, a, b: mk.index_shuffling(s, a, b, None, k), fullgraph=True
    )
    torch._dynamo.reset()
    for k, start, end in ((1, 0, 128), (2, 0, 128), (4, 16, 80), (8, 0, 64)):
        module_of(None, scores, k, start, end, compiled_fn=compiled)
