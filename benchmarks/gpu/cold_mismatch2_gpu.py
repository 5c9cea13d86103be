"""Which piece of the MXFP8 weight gradient differs compiled vs eager (issue 44 device run).

PYTHONPATH=packages/moe-kernels/src python3 benchmarks/gpu/cold_mismatch2_gpu.py
"""

from __future__ import annotations

import torch

import moe_kernels as mk
from moe_kernels import _mxfp8_train as tr


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(name, fn, *args):
    torch._dynamo.reset()
    c = torch.compile(fn, fullgraph=True)(*args)
    e = fn(*args)
    cs = c if isinstance(c, (tuple, list)) else (c,)
    es = e if isinstance(e, (tuple, list)) else (e,)
    res = []
    for x, y in zip(cs, es, strict=True):
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        eq = torch.equal(x, y)
        res.append(
            "eq"
            if eq
            else f"DIFF rel {rel(x.float(), y.float()):.2e} strides {x.stride()} vs {y.stride()}"
        )
    print(f"{name}: {res}", flush=True)


M, E, K, N, rows = 256, 8, 256, 128, 32
g = torch.Generator(device="cuda").manual_seed(1)
a = torch.randn(M, K, generator=g, device="cuda").bfloat16()
dy = torch.randn(M, N, generator=g, device="cuda").bfloat16()
ends = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows).contiguous()
src, valid, starts = tr.padded_rows(ends, M)
ap = tr._gather_padded(a, src, valid)
check("padded_rows", lambda o: tr.padded_rows(o, M), ends)
check("gather_padded", tr._gather_padded, a, src, valid)
check("to_mxfp8_dim1(input)", mk.to_mxfp8_dim1, ap)
check("to_mxfp8_dim1(in-graph)", lambda x: mk.to_mxfp8_dim1(x * 1.0), ap)
check("to_mxfp8(in-graph)", lambda x: mk.to_mxfp8(x * 1.0), ap)
d, s = mk.to_mxfp8_dim1(ap)
check("from_mxfp8(input)", lambda d, s: mk.from_mxfp8(d, s, torch.bfloat16), d, s)
check("dequantized dim1 (input)", lambda x: tr._dequantized(x, True), ap)
check("dequantized dim1 (in-graph)", lambda x: tr._dequantized(x * 1.0, True), ap)
check("dequantized dim0 (in-graph)", lambda x: tr._dequantized(x * 1.0, False), ap)
check(
    "gather + dequantized",
    lambda a, s, v: tr._dequantized(tr._gather_padded(a, s, v), True),
    a,
    src,
    valid,
)
at = tr._dequantized(ap, True)
dyt = tr._dequantized(tr._gather_padded(dy, src, valid), True)
check("wgrad(input .t())", lambda x, y, o: mk.grouped_weight_grad(x.t(), y.t(), o), at, dyt, starts)
check(
    "wgrad(in-graph .t())",
    lambda x, y, o: mk.grouped_weight_grad((x * 1.0).t(), (y * 1.0).t(), o),
    at,
    dyt,
    starts,
)
check(
    "wgrad(dequant in-graph)",
    lambda x, y, o: mk.grouped_weight_grad(
        tr._dequantized(x, True).t(), tr._dequantized(y, True).t(), o
    ),
    ap,
    tr._gather_padded(dy, src, valid),
    starts,
)
check("grad_weight", lambda d_, a_, o: tr.grad_weight(d_, a_, o, torch.bfloat16), dy, a, ends)
