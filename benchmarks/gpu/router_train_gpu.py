"""The router's forward + backward at training sizes (issue 33): what its fp32 logits cost
beside bf16 tensor-core variants, and how far each is from float64.

Variants (softmax scores (T, E) fp32; backward of a fixed fp32 dS to x (bf16) and w (fp32)):
  fp32 formula   ``softmax(F.linear(x.float(), w))``, torch autograd (TF32 off): the layer's
                 router for E > KERNEL_ROUTER_MAX_E today
  kernel         ``moe_kernels.router_scores`` (fp32 FMAs in Triton, torch fp32 backward)
  split bf16     w (and dlogits in backward) split into bf16 pieces hi + mid + lo whose sum is
                 the fp32 value; x is bf16 already, so each product is exact and the three bf16
                 GEMMs (one GEMM on the stacked pieces, fp32 out) give the fp32 logits to
                 fp32-accumulation rounding; dx from (dl_hi, dl_hi, dl_lo) x (w_hi, w_mid, w_hi)
                 (bf16 output), dw from the three pieces of dl against x (fp32 out)
  bf16           ``softmax(F.linear(x, w.bf16()).float())`` (logits rounded to bf16), autograd
Time: a CUDA graph of forward + backward (device time), median. Error: max |difference| over
max |value| against float64 of the same math.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/router_train_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import bench_us, capture

import moe_kernels as mk

SHAPES = {"seed": (2048, 2048, 16), "qwen3": (8192, 2048, 128), "sonic": (32768, 4096, 128),
          "sonic_mem": (24576, 1536, 128), "dsv3": (8192, 7168, 256)}  # fmt: skip


def split3(t: torch.Tensor) -> torch.Tensor:
    """(3, *t.shape) bf16 pieces whose fp32 sum is t (fp32): hi, mid, lo."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


class SplitRouter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        E = w.shape[0]
        w3 = split3(w).reshape(3 * E, -1)
        l3 = torch.mm(x, w3.T, out_dtype=torch.float32)
        logits = (l3[:, :E] + l3[:, E : 2 * E]) + l3[:, 2 * E :]
        s = torch.softmax(logits, -1)
        ctx.save_for_backward(x, w3, s)
        return s

    @staticmethod
    def backward(ctx, ds):
        x, w3, s = ctx.saved_tensors
        E = s.shape[1]
        dl = s * (ds - (ds * s).sum(-1, keepdim=True))
        d3 = split3(dl)  # (3, T, E)
        a = torch.cat([d3[0], d3[0], d3[1]], dim=1)  # (T, 3E)
        b = torch.cat([w3[:E], w3[E : 2 * E], w3[:E]], dim=0)  # (3E, D)
        dx = torch.mm(a, b)
        g3 = torch.mm(d3.transpose(1, 2).reshape(3 * E, -1), x, out_dtype=torch.float32)
        dw = (g3[:E] + g3[E : 2 * E]) + g3[2 * E :]
        return dx, dw


VARIANTS = {
    "fp32 formula": lambda x, w: torch.softmax(F.linear(x.float(), w), -1),
    "kernel": lambda x, w: mk.router_scores(x, w),
    "split bf16": SplitRouter.apply,
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
                return s

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
