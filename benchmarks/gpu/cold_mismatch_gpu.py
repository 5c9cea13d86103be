"""Which side is wrong where a compiled call from a cold process differs from eager (issue 44's
device run): route's backward with renormalize + valid_token_count, and the MXFP8 grouped GEMM's
weight gradient. Each compiled first (fresh process), then eager, both against a float64 oracle.

    PYTHONPATH=packages/moe-kernels/src python3 benchmarks/gpu/cold_mismatch_gpu.py
"""

from __future__ import annotations

import torch

import moe_kernels as mk
from moe_kernels.reference.routing import route_backward_reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def route_case(T=256, E=8, K=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(T, E, generator=g, device="cuda").softmax(-1)
    vtc = torch.tensor([T // 2], device="cuda")

    def f(s, v):
        return mk.route(s, K, renormalize=True, valid_token_count=v)

    def run(fn):
        s = scores.clone().requires_grad_()
        plan = fn(s, vtc)
        (0.5 * plan.weights.square().sum()).backward()
        return plan, s.grad

    pc, gc = run(torch.compile(f, fullgraph=True))
    pe, ge = run(f)
    ref = route_backward_reference(pe.weights.double(), pe.inverse, pe.expert_indices,
                                   scores.double(), 0, E, 1.0, True, None, 1, 1)  # fmt: skip
    same_plan = all(torch.equal(a, b) for a, b in zip(pc, pe, strict=True))
    diff = (gc != ge).nonzero()
    print(f"route renorm vtc: plan equal {same_plan}; grads differ at {diff.shape[0]} elements "
          f"(rows {diff[:, 0].unique().tolist()[:10]}); compiled vs f64 {rel(gc, ref):.2e}, "
          f"eager vs f64 {rel(ge, ref):.2e}; max |compiled-eager| "
          f"{float((gc - ge).abs().max()):.2e}")  # fmt: skip


def mxfp8_case(M=256, E=8, K=256, N=128, rows=32):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    b = (torch.randn(E, K, N, generator=g, device="cuda") * K**-0.5).bfloat16()
    ends = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows).contiguous()

    def run(fn):
        aa, bb = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(aa, bb, ends)
        (0.5 * out.float().square().sum()).backward()
        return out, aa.grad, bb.grad

    oc, gac, gbc = run(torch.compile(mk.mxfp8_grouped_mm, fullgraph=True))
    oe, gae, gbe = run(mk.mxfp8_grouped_mm)
    # unquantised float64 oracle: dB[e] = a_e^T dY_e with dY = out (eager's)
    starts = torch.cat([ends.new_zeros(1), ends]).tolist()
    dy = oe.double()
    ref_b = torch.stack(
        [a[s:t].double().T @ dy[s:t] for s, t in zip(starts[:-1], starts[1:], strict=True)]
    )
    print(
        f"mxfp8 M={M} E={E} rows/expert={rows}: out equal {torch.equal(oc, oe)}, "
        f"dA equal {torch.equal(gac, gae)}, dB equal {torch.equal(gbc, gbe)}; dB vs "
        f"unquantised f64: compiled {rel(gbc, ref_b):.2e}, eager {rel(gbe, ref_b):.2e}"
    )


def wgrad_case(P=480, E=8, K=256, N=128, rows=32, transposed=True):
    g = torch.Generator(device="cuda").manual_seed(2)
    if transposed:  # (P, K) views of (K, P) tensors, as the MXFP8 backward passes them
        dy = torch.randn(K, P, generator=g, device="cuda").bfloat16().t()
        x = torch.randn(N, P, generator=g, device="cuda").bfloat16().t()
    else:
        dy = torch.randn(P, K, generator=g, device="cuda").bfloat16()
        x = torch.randn(P, N, generator=g, device="cuda").bfloat16()
    offs = torch.arange(0, E + 1, device="cuda", dtype=torch.int64) * rows

    def f(dy, x, offs):
        return mk.grouped_weight_grad(dy, x, offs)

    c = torch.compile(f, fullgraph=True)(dy, x, offs)
    e = f(dy, x, offs)
    o = offs.tolist()
    ref = torch.stack(
        [dy[s:t].double().T @ x[s:t].double() for s, t in zip(o[:-1], o[1:], strict=True)]
    )
    print(
        f"grouped_weight_grad P={P} E={E} rows={rows} transposed={transposed}: equal "
        f"{torch.equal(c, e)}; compiled {rel(c, ref):.2e}, eager {rel(e, ref):.2e}"
    )


if __name__ == "__main__":
    route_case()
    mxfp8_case()
    mxfp8_case(M=4096, E=8, rows=512)
    for tr in (True, False):
        for rows in (32, 200):
            wgrad_case(P=rows * 8 + 64, rows=rows, transposed=tr)
