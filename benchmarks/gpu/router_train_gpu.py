"""The router's forward + backward at training sizes (issue 33): what its fp32 logits cost
beside the library's router and bf16 logits, and how far each is from float64.

Variants (softmax scores (T, E) fp32; backward of a fixed fp32 dS to x (bf16) and w (fp32)):
  fp32 formula   ``softmax(F.linear(x.float(), w))``, torch autograd (TF32 off): the layer's
                 router for more than 32 experts before ``router_scores`` took them
  router_scores  ``moe_kernels.router_scores``: its "fma" Triton kernel up to 32 experts, past
                 that the "split" bf16 tensor-core GEMMs on the weight's three exact bf16 pieces
                 (``moe_kernels._router_split``)
  bf16           ``softmax(F.linear(x, w.bf16()).float())`` (logits rounded to bf16), autograd
Time: a CUDA graph of forward + backward (device time), and of the forward alone, medians.
Error: max |difference| over max |value| against float64 of the same math.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/router_train_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import bench_us

import moe_kernels as mk
from moe_kernels.testing import capture

SHAPES = {"seed": (2048, 2048, 16), "qwen3": (8192, 2048, 128), "sonic": (32768, 4096, 128),
          "sonic_mem": (24576, 1536, 128), "dsv3": (8192, 7168, 256)}  # fmt: skip


VARIANTS = {
    "fp32 formula": lambda x, w: torch.softmax(F.linear(x.float(), w), -1),
    "router_scores": lambda x, w: mk.router_scores(x, w),
    "bf16": lambda x, w: torch.softmax(F.linear(x, w.to(x.dtype)).float(), -1),
}


def main() -> None:
    print(f"{'shape':<10}{'variant':<14}{'fwd+bwd ms':>11}{'fwd ms':>9}{'err s':>9}{'err dx':>9}"
          f"{'err dw':>9}")  # fmt: skip
    for name, (T, D, E) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(E, D, device="cuda", generator=g) / D**0.5
        ds = torch.randn(T, E, device="cuda", generator=g)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        sd = torch.softmax(F.linear(xd, wd), -1)
        sd.backward(ds.double())
        for vname, fn in VARIANTS.items():
            xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()

            def step(fn=fn, xs=xs, ws=ws):
                xs.grad = ws.grad = None
                s = fn(xs, ws)
                s.backward(ds)
                return s.detach()  # (no autograd graph kept alive: capture runs on a side stream)

            s = step()
            errs = [float((a.double() - b).abs().max() / b.abs().max())
                    for a, b in ((s, sd), (xs.grad, xd.grad), (ws.grad, wd.grad))]  # fmt: skip
            ms = bench_us(capture(step, warmup=2)[0].replay) / 1e3
            with torch.no_grad():
                fwd = bench_us(capture(lambda fn=fn: fn(x, w), warmup=2)[0].replay) / 1e3
            print(f"{name:<10}{vname:<14}{ms:>11.3f}{fwd:>9.3f}"
                  + "".join(f"{e:>9.1e}" for e in errs))  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
