"""Where the MoE layer's time goes (one H200 run): the seed-moe layer at 2048 tokens, bf16,
compiled with fullgraph and replayed in a CUDA graph, per router variant, beside its two grouped
GEMMs alone; then a per-kernel profile of the compiled layer as built.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/layer_breakdown.py            # H200
DRY=1 python3 benchmarks/gpu/layer_breakdown.py          # CPU smoke run, tiny sizes

Router variants: ``torch`` (the router's torch formula, ``softmax(F.linear(x.float(), w))``),
``router_scores`` (moe-kernels' fused kernel, launcher default) and the kernel launcher with each
``RouterConfig`` in ``configs()`` (its ``config`` argument). The layer body is the impl's three
steps (``moe_model.IMPLS[impl]``: route, experts, combine, the layer's local exchange between
them) on the variant's scores: no method or module global is replaced. Each variant is checked:
its output against the ``torch`` variant's (max |diff|, and how many tokens route differently),
and a second call bitwise equal to the first.
"""

from __future__ import annotations

import os

import torch
from common import graph_us, torch_router_scores

from moe_model import IMPLS, MoELayer
from moe_model.moe import LOCAL_EXCHANGE

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


def router_variants(layer: MoELayer) -> dict:
    """name -> the scores (T, E) fp32 of x (T, D) by that router (in a dry run the configs fall
    back to the launcher's default: the CPU path takes no launch config)."""
    from moe_kernels import router_scores
    from moe_kernels._triton import router as tri

    w, score_fn = layer.router.weight, layer.score_fn
    default = lambda x_TD: router_scores(x_TD, w, score_fn=score_fn)  # noqa: E731
    variants = {"torch": lambda x_TD: torch_router_scores(x_TD, w, score_fn)}
    variants["router_scores"] = default
    for name, cfg in configs().items():
        variants[name] = default if DRY else (
            lambda x_TD, cfg=cfg: tri.router_scores(x_TD, w, score_fn == "sigmoid", cfg)
        )  # fmt: skip
    return variants


def time_us(fn, calls: int = 10) -> float:
    """Device time per call, us: ``calls`` calls in one CUDA graph, median of 50 replays."""
    return graph_us(fn, calls, 50, DRY)


def main() -> None:
    torch.manual_seed(0)
    layer = MoELayer(D, E, K, H, impl=IMPL).to(DEV)
    layer.in_proj.data = layer.in_proj.data.bfloat16()
    layer.out_proj.data = layer.out_proj.data.bfloat16()
    x = torch.randn(T, D, device=DEV).bfloat16()
    print(f"torch {torch.__version__}, layer T={T} D={D} E={E} k={K} H={H} bf16, impl {IMPL}")
    with torch.no_grad():
        impl = IMPLS[layer.impl]

        def forward(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
            """MoELayer.run's steps (no shared experts here) on the given scores."""
            plan = impl.route(scores_TE, layer.top_k, layer.route_options())
            rows_TD = x_TD.to(impl.rows_dtype(x_TD.dtype, layer.in_proj.dtype))
            sent = LOCAL_EXCHANGE.to_experts(rows_TD, plan, False)
            ys = impl.experts(sent.rows, layer.in_proj, layer.out_proj, layer.gated, False)
            return impl.combine(*LOCAL_EXCHANGE.from_experts(ys, sent, False), x_TD)

        variants = router_variants(layer)
        ref_choice = variants["torch"](x).topk(K, dim=-1).indices.sort(dim=-1).values
        y_ref = None
        for name, scores in variants.items():
            torch._dynamo.reset()
            try:

                def body(x_TD, scores=scores):
                    return forward(layer, x_TD, scores(x_TD))

                f = torch.compile(body, fullgraph=True, backend="eager" if DRY else "inductor")
                y = f(x).clone()
                y2 = f(x).clone()
                choice = scores(x).topk(K, dim=-1).indices.sort(dim=-1).values
                moved = int((choice != ref_choice).any(dim=-1).sum())
                if y_ref is None:
                    y_ref = y
                diff = float((y.float() - y_ref.float()).abs().max())
                layer_us = time_us(lambda f=f: f(x))
                router_us = time_us(lambda scores=scores: scores(x))
                print(
                    f"  {name:16} layer {layer_us:7.1f} us  router alone {router_us:6.1f} us  "
                    f"max|y - y_torch| {diff:.3g}  tokens routed differently {moved}  "
                    f"repeat bitwise {torch.equal(y, y2)}",
                    flush=True,
                )
            except Exception as exc:  # keep going: report the variant
                print(f"  {name:16} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)

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

                print(
                    f"  two GEMMs alone, {label:15} {time_us(gemms):7.1f} us (10 per graph), "
                    f"{time_us(gemms, calls=1):7.1f} us (1 per graph)  (torch._grouped_mm)"
                )
            torch._dynamo.reset()
            f = torch.compile(layer, fullgraph=True)
            one = time_us(lambda: f(x), calls=1)
            print(f"  layer as built (its own router)   {one:7.1f} us (1 per graph)")

        if not DRY:  # per-kernel profile of the compiled layer as built, 10 calls
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
