"""Where the MoE layer's time goes (one H200 run): the seed-moe layer at 2048 tokens, bf16,
compiled with fullgraph and replayed in a CUDA graph, per router variant, beside its two grouped
GEMMs alone; then a per-kernel profile of the compiled layer.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 packages/moe-model/gpu/layer_breakdown.py            # H200
DRY=1 python3 packages/moe-model/gpu/layer_breakdown.py          # CPU smoke run, tiny sizes

Router variants (``layer.scores`` replaced on the instance): ``torch`` (the layer's formula,
``softmax(F.linear(x.float(), w))``), ``router_scores`` (moe-kernels' fused kernel, launcher
default) and ``router_scores`` with each config in ``LAYER_ROUTER_CONFIGS``. Each variant is
checked: its output against the ``torch`` variant's (max |diff|, and how many tokens route
differently), and a second replay bitwise equal to the first.
"""

from __future__ import annotations

import os
import time
import types

import torch

from moe_model import MoELayer
from moe_tools.timing import graph_time_fn

DRY = os.environ.get("DRY", "0") == "1"
DEV = torch.device("cpu" if DRY else "cuda")
T, D, E, K, H = (64, 64, 4, 2, 32) if DRY else (2048, 2048, 16, 8, 1024)
IMPL = os.environ.get("LAYER_IMPL", "triton_bf16")


def configs():
    from moe_kernels._triton.router import RouterConfig as C

    a3 = {"acc3": True, "dot": False}
    pf = {**a3, "prefetch": True}
    return {
        "acc3 8x128 pf": C(8, 128, 4, 3, **pf),
        "acc3 16x64 pf": C(16, 64, 4, 3, **pf),
        "acc3 8x64 pf": C(8, 64, 4, 3, **pf),
        "acc3 4x128 pf": C(4, 128, 4, 3, **pf),
    }


def with_router(layer: MoELayer, cfg) -> MoELayer:
    """The layer's scores from ``router_scores`` (cfg None: the launcher's default)."""
    from moe_kernels import router_scores
    from moe_kernels._triton import router as tri

    def scores(self, x_TD):
        if cfg is None or DRY:
            return router_scores(x_TD, self.router.weight, score_fn=self.score_fn)
        return tri.router_scores(x_TD, self.router.weight, self.score_fn == "sigmoid", cfg)

    layer.scores = types.MethodType(scores, layer)
    return layer


def time_ms(fn) -> float:
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return graph_time_fn(fn, DEV, warmup=3, iters=50, calls=10).median_ms


def main() -> None:
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, impl=IMPL).to(DEV)
    layer.in_proj.data = layer.in_proj.data.bfloat16()
    layer.out_proj.data = layer.out_proj.data.bfloat16()
    x = torch.randn(T, D, device=DEV).bfloat16()
    print(f"torch {torch.__version__}, layer T={T} D={D} E={E} k={K} H={H} bf16, impl {IMPL}")
    with torch.no_grad():
        ref_choice = layer.scores(x).topk(K, dim=-1).indices.sort(dim=-1).values
        variants = {"torch": None, "router_scores": "default", **configs()}
        y_ref = None
        for name, cfg in variants.items():
            if cfg is None:
                layer.__dict__.pop("scores", None)
            else:
                with_router(layer, None if cfg == "default" else cfg)
            torch._dynamo.reset()
            try:
                f = torch.compile(layer, fullgraph=True, backend="eager" if DRY else "inductor")
                y = f(x).clone()
                y2 = f(x).clone()
                choice = layer.scores(x).topk(K, dim=-1).indices.sort(dim=-1).values
                moved = int((choice != ref_choice).any(dim=-1).sum())
                if y_ref is None:
                    y_ref = y
                diff = float((y.float() - y_ref.float()).abs().max())
                ms = time_ms(lambda f=f: f(x))
                r_ms = time_ms(lambda: layer.scores(x))
                print(
                    f"  {name:16} layer {ms * 1e3:7.1f} us  router alone {r_ms * 1e3:6.1f} us  "
                    f"max|y - y_torch| {diff:.3g}  tokens routed differently {moved}  "
                    f"repeat bitwise {torch.equal(y, y2)}",
                    flush=True,
                )
            except Exception as exc:  # keep going: report the variant
                print(f"  {name:16} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        layer.__dict__.pop("scores", None)

        if not DRY and hasattr(torch, "_grouped_mm"):
            # The two expert GEMMs alone on random rows, with the groups split evenly (what
            # `moe-bench matrix` times) and with the layer's own group sizes for this x; 10
            # calls per graph (as the layer above) and 1 call per graph (as the matrix).
            from moe_kernels import route

            rows = T * K
            xs = torch.randn(rows, D, device=DEV).bfloat16()
            h = torch.randn(rows, H, device=DEV).bfloat16()
            even = (torch.arange(1, E + 1, device=DEV) * rows // E).to(torch.int32)
            mine = route(layer.scores(x), K).offsets[1:].to(torch.int32)
            w_in, w_out = layer.in_proj.mT, layer.out_proj.mT
            for label, offs in (("even groups", even), ("layer's groups", mine)):

                def gemms(offs=offs):
                    torch._grouped_mm(xs, w_in, offs=offs)
                    torch._grouped_mm(h, w_out, offs=offs)

                one = graph_time_fn(gemms, DEV, warmup=3, iters=50, calls=1).median_ms
                print(
                    f"  two GEMMs alone, {label:15} {time_ms(gemms) * 1e3:7.1f} us "
                    f"(10 per graph), {one * 1e3:7.1f} us (1 per graph)  (torch._grouped_mm)"
                )
            torch._dynamo.reset()
            f = torch.compile(layer, fullgraph=True)
            one = graph_time_fn(lambda: f(x), DEV, warmup=3, iters=50, calls=1).median_ms
            print(f"  layer (torch router)              {one * 1e3:7.1f} us (1 per graph)")

        if not DRY:  # per-kernel profile of the compiled layer (torch router), 10 calls
            torch._dynamo.reset()
            f = torch.compile(layer, fullgraph=True)
            for _ in range(3):
                f(x)
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    f(x)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
