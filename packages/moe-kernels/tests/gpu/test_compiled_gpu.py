"""``torch.compile(fullgraph=True)`` on the GPU: what Inductor compiled wrong or left opaque once.

* ``route``'s backward with ``renormalize`` and a valid count, compiled, equals eager bit for
  bit (Inductor typed the kernel's Python float argument fp64: about an ulp off on ~10% of the
  elements, docs/compile-cold-start.md), both within fp32 rounding of the float64 reference;
* ``mxfp8_grouped_mm``'s forward and backward compiled equal eager bit for bit, at 32 and 512
  rows per expert, and the weight gradient stays the quantised product (Inductor compiled the
  padded row layout's index arithmetic into other group ids: 0.85 from float64 where eager
  is 0.04);
* ``grouped_weight_grad`` on transposed views (as the MXFP8 backward passes them) and on
  contiguous rows, compiled == eager, both near float64;
* the ops' compiled code launches our kernels itself (no ``torch.ops.moe_kernels`` call left)
  and equals eager (``benchmarks/gpu/compile_gpu.py`` times what that saves); every op with
  ``MOE_GPU_FULL=1``, a few otherwise (``test_cold_compile_ops.py`` compiles every op cold).
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference.routing import route_backward_reference
from moe_kernels.testing import (
    bits_equal,
    compile_fresh,
    full_run,
    gpu_test_device,
    inductor_code,
    launched_by_inductor,
    op_problems,
    tensors_of,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
FULL = pytest.mark.skipif(not full_run(), reason="more compiles: MOE_GPU_FULL=1")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_route_renormalized_backward_compiled_equals_eager():
    T, E, K = 256, 8, 2
    g = torch.Generator(device=DEV).manual_seed(0)
    scores = torch.randn(T, E, generator=g, device=DEV).softmax(-1)
    vtc = torch.tensor([T // 2], device=DEV)

    def f(s, v):
        return mk.route(s, K, renormalize=True, valid_token_count=v)

    def run(fn):
        s = scores.clone().requires_grad_()
        plan = fn(s, vtc)
        (0.5 * plan.weights.square().sum()).backward()
        return plan, s.grad

    plan_c, grad_c = run(compile_fresh(f))
    plan_e, grad_e = run(f)
    assert bits_equal(tuple(plan_c), tuple(plan_e))
    want = route_backward_reference(plan_e.weights.double(), plan_e.inverse, plan_e.expert_indices,
                                    scores.double(), 0, E, 1.0, True)  # fmt: skip
    assert rel(grad_e, want) < 1e-6 and rel(grad_c, want) < 1e-6
    differ = int((grad_c != grad_e).sum())
    assert differ == 0, f"compiled backward differs from eager at {differ} elements"


@pytest.mark.parametrize("rows", [32, 512])
def test_mxfp8_grouped_mm_training_compiled_equals_eager(rows):
    M, E, K, N = rows * 8, 8, 256, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    a = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    b = (torch.randn(E, K, N, generator=g, device=DEV) * K**-0.5).bfloat16()
    ends = (torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * rows).contiguous()

    def run(fn):
        aa, bb = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(aa, bb, ends)
        (0.5 * out.float().square().sum()).backward()
        return out, aa.grad, bb.grad

    compiled = run(compile_fresh(mk.mxfp8_grouped_mm))
    eager = run(mk.mxfp8_grouped_mm)
    for name, c, e in zip(("out", "dA", "dB"), compiled, eager, strict=True):
        assert bits_equal(c, e), f"compiled {name} differs from eager"
    # the unquantised float64 product dB[e] = a_e^T dY_e (dY = out): quantisation only
    o = [0] + ends.tolist()
    dy = eager[0].double()
    want = torch.stack([a[s:t].double().T @ dy[s:t] for s, t in zip(o[:-1], o[1:], strict=True)])
    assert rel(eager[2], want) < 0.1, f"dB {rel(eager[2], want):.2e} from float64"


@pytest.mark.parametrize(
    "transposed,rows",
    [(True, 32), pytest.param(True, 200, marks=FULL), pytest.param(False, 32, marks=FULL),
     pytest.param(False, 200, marks=FULL)],
)  # fmt: skip
def test_grouped_weight_grad_compiled_equals_eager(transposed, rows):
    E, K, N = 8, 256, 128
    P = rows * E + 64
    g = torch.Generator(device=DEV).manual_seed(2)
    if transposed:  # (P, K) views of (K, P) tensors, as the MXFP8 backward passes them
        dy = torch.randn(K, P, generator=g, device=DEV).bfloat16().t()
        x = torch.randn(N, P, generator=g, device=DEV).bfloat16().t()
    else:
        dy = torch.randn(P, K, generator=g, device=DEV).bfloat16()
        x = torch.randn(P, N, generator=g, device=DEV).bfloat16()
    offs = torch.arange(0, E + 1, device=DEV, dtype=torch.int64) * rows

    def f(dy, x, offs):
        return mk.grouped_weight_grad(dy, x, offs)

    got, want = compile_fresh(f)(dy, x, offs), f(dy, x, offs)
    assert bits_equal(got, want)
    o = offs.tolist()
    exact = torch.stack(
        [dy[s:t].double().T @ x[s:t].double() for s, t in zip(o[:-1], o[1:], strict=True)]
    )
    assert rel(want, exact) < 1e-2


DEFAULT_OPS = ("route_renorm_vtc", "gather_grouped_mm_silu")
INLINED_OPS = DEFAULT_OPS + (
    "dispatch", "combine", "to_mxfp8",
    "router_scores", "route", "index_shuffling", "gather_grouped_mm_sorted",
    "gather_scale_dense_tokens", "scatter_add_dense_tokens", "to_mxfp8_dim1", "from_mxfp8",
    "compute_per_group_blocked_scale_offsets", "to_blocked_per_group_2d",
    "to_blocked_per_group_3d", "mxfp8_grouped_mm",
)  # fmt: skip


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT_OPS else pytest.param(n, marks=FULL) for n in INLINED_OPS]
)
def test_compiled_op_launched_by_inductor(name):
    """The forward compiled: Inductor's code launches the kernels (no opaque op), equal to
    eager bit for bit."""
    p = op_problems(DEV)[name]

    def fresh():
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in p.args]

    want = p.fn(*fresh())
    got, code = inductor_code(compile_fresh(p.fn), *fresh())
    assert bits_equal(tensors_of(got), tensors_of(want))
    if ON_GPU:  # on the CPU the ops stay opaque
        assert launched_by_inductor(code), "an opaque torch.ops.moe_kernels call is left"
