"""Without Triton (macOS, or any platform Triton publishes no wheels for): ``import moe_kernels``
and every op's CPU path work, and a call that needs a kernel says what to install.

Each check runs in a fresh interpreter where ``import triton`` fails (``sys.modules["triton"] =
None``, which is what Python does for a package that is not installed), so the Triton this test
session has installed stays out of it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import moe_kernels as mk
from moe_kernels.reference import mxfp8 as RM, routing as RR, tokens as RT
assert "triton" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
"""

_CPU_OPS = """
g = torch.Generator().manual_seed(0)
T, E, k, D, H = 37, 8, 2, 64, 32
scores = torch.randn(T, E, generator=g).softmax(-1)
x = torch.randn(T, D, generator=g)

plan = mk.route(scores, k, renormalize=True)
ref = RR.route_reference(scores, k, None, 0, E, True)
assert all(torch.equal(a, b) for a, b in zip(plan, ref))
counts, exp, tok = mk.index_shuffling(scores, top_k=k)
assert torch.equal(counts, RR.index_shuffling_reference(scores, 0, E, None, k)[0])

xs = mk.dispatch(x, plan)
assert torch.equal(xs, RT.dispatch(x, plan.token_indices, plan.weights, False))
y = mk.combine(xs, plan)
assert torch.equal(y, RT.combine(xs, plan.inverse, plan.weights, True, torch.float32))
g_rows = mk.gather_scale_dense_tokens(x, tok, exp, scores)
assert torch.equal(g_rows, RT.gather_scale_dense_tokens(x, tok, exp, scores))
out = torch.zeros(T, D, dtype=torch.int32)
mk.scatter_add_dense_tokens(out, torch.ones(T * k, D, dtype=torch.int32), tok)
assert int(out.sum()) == T * k * D

w = torch.randn(E, H, D, generator=g)
h = mk.gather_grouped_mm(x, w, plan.offsets, plan.token_indices, activation="silu")
assert h.shape == (T * k, H)
probs = mk.router_scores(x, torch.randn(E, D, generator=g))
assert probs.shape == (T, E)

data, scale = mk.to_mxfp8(x)
assert torch.equal(data.view(torch.uint8), RM.to_mxfp8(x)[0].view(torch.uint8))
assert mk.to_mxfp8_dim1(x[:32])[0].shape == (D, 32)
assert torch.equal(mk.from_mxfp8(data, scale), RM.from_mxfp8(data, scale))
blocked, starts = mk.to_blocked_per_group_2d(scale, torch.tensor([10, 37]))
assert torch.equal(starts, torch.tensor([0, 128, 256], dtype=torch.int32))
assert mk.to_blocked_per_group_3d(scale[None]).shape == (1, 128 * 4)
assert mk.to_blocked(scale).shape == (128, 4)
a = torch.randn(64, 64, generator=g, dtype=torch.bfloat16)
b = torch.randn(2, 64, 32, generator=g, dtype=torch.bfloat16)
assert mk.mxfp8_grouped_mm(a, b, torch.tensor([30, 64], dtype=torch.int32)).shape == (64, 32)

import moe_model
for impl in ("torch", "triton_bf16", "triton_fp32", "mxfp8"):
    layer = moe_model.MoELayer(64, 4, 2, 32, impl=impl)
    assert layer(torch.randn(5, 64, generator=g)).shape == (5, 64)
print("ok")
"""


def _run(code: str, interpret: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": interpret, "MOE_KERNELS_BACKEND": "auto"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PRELUDE + code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cpu_path_runs_without_triton():
    res = _run(_CPU_OPS, "0")
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.parametrize(
    ("interpret", "call", "where"),
    [
        ("1", "mk.route(torch.rand(4, 3), 2)", "TRITON_INTERPRET"),
        ("1", "mk.to_mxfp8(torch.rand(4, 32))", "TRITON_INTERPRET"),
        ("0", "moe_kernels_dispatch.triton_kernels('tokens')", "CUDA tensors"),
    ],
)
def test_a_kernel_call_without_triton_says_what_to_install(interpret, call, where):
    code = f"""
import moe_kernels._dispatch as moe_kernels_dispatch
try:
    {call}
except RuntimeError as exc:
    msg = str(exc)
    assert "pip install triton" in msg and "triton-windows" in msg and {where!r} in msg, msg
    print("ok")
"""
    res = _run(code, interpret)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.stdout, res.stderr)
