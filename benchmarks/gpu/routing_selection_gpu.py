"""route's selection options on the GPU (issue 23): kernel A 'grouped' bit-exact against the
reference, then timed in CUDA graphs against plain ``route`` at the same shape.

Checks: over dtypes, E (8..1024), top_k, groups (n_groups / topk_groups), bias on and off,
scale, renormalize, expert ranges, valid counts, special values (NaN, +-inf, ties): every
output bitwise equal to ``route_reference`` (NaN equal to NaN); no host sync; a graph replay.
Timing (``--skip=time`` to leave out): device time per call in a CUDA graph of 10 calls, for
plain route and route with bias + groups (+ scale + renormalize as DeepSeek-V3 has them), over
T x E x k x dtype; the ratio (to plain route, no options) is the issue's target (<= 1.2x at
T=65536 and 2^20, E=256, k=8).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/routing_selection_gpu.py [--skip=check,time] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import FAILS, check, forbid_host_sync, graph_us, same_bits

from moe_kernels import route
from moe_kernels.reference.routing import route_reference


def scores_of(T: int, E: int, dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "sigmoid":
        x = torch.sigmoid(torch.randn(T, E, device="cuda", generator=g))
    elif kind == "ties":
        x = torch.randint(-2, 3, (T, E), device="cuda", generator=g).float() * 0.25
    else:  # special values
        x = torch.randn(T, E, device="cuda", generator=g)
        r = torch.rand(T, E, device="cuda", generator=g)
        x = torch.where(r < 0.05, float("nan"), x)
        x = torch.where((r > 0.05) & (r < 0.08), float("-inf"), x)
        x = torch.where((r > 0.08) & (r < 0.1), float("inf"), x)
        x[0] = float("-inf")
    return x.to(dtype)


def check_all() -> None:
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for T, E, k, G, TG in ((4096, 256, 8, 8, 4), (300, 64, 6, 8, 3), (20000, 16, 2, 4, 2),
                               (777, 96, 4, 3, 1), (64, 256, 8, 8, 4), (5000, 8, 2, 8, 2),
                               (1000, 1024, 8, 16, 4), (2048, 60, 4, 12, 3)):  # fmt: skip
            for kind in ("sigmoid", "ties", "special"):
                cases.append((dtype, T, E, k, G, TG, kind))
    for i, (dtype, T, E, k, G, TG, kind) in enumerate(cases):
        x = scores_of(T, E, dtype, kind, seed=i)
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        if kind == "ties":
            bias = torch.randint(-1, 2, (E,), device="cuda", generator=g).float() * 0.25
        variants = [
            dict(bias=bias, n_groups=G, topk_groups=TG, scale=2.5, renormalize=True),
            dict(bias=bias, n_groups=G, topk_groups=TG),
            dict(bias=bias.to(dtype)),
            dict(n_groups=G, topk_groups=TG, scale=0.5),
            dict(
                bias=bias,
                n_groups=G,
                topk_groups=TG,
                renormalize=True,
                expert_index_start=E // 4,
                expert_index_end=E // 2,
                valid_token_count=torch.tensor([T - 3], device="cuda"),
            ),  # fmt: skip
        ]
        for v in variants:
            plan = route(x, k, **v)
            want = route_reference(
                x, k, v.get("valid_token_count"), v.get("expert_index_start", 0),
                v.get("expert_index_end", E), v.get("renormalize", False), v.get("bias"),
                v.get("n_groups", 1), v.get("topk_groups") or v.get("n_groups", 1),
                v.get("scale", 1.0),
            )  # fmt: skip
            ok = all(same_bits(a, b) for a, b in zip(plan, want, strict=True))
            name = f"{str(dtype)[6:]} T={T} E={E} k={k} G={G}/{TG} {kind} {sorted(v)}"
            check(f"bits {name}", ok)
    x = scores_of(65536, 256, torch.float32, "sigmoid", 0)
    bias = torch.randn(256, device="cuda") * 0.1
    kw = dict(bias=bias, n_groups=8, topk_groups=4, scale=2.5, renormalize=True)
    with forbid_host_sync():
        route(x, 8, **kw)
    check("no host sync", True)
    want = route(x, 8, **kw)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        route(x, 8, **kw)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = route(x, 8, **kw)
    graph.replay()
    torch.cuda.synchronize()
    check("graph replay", all(same_bits(a, b) for a, b in zip(out, want, strict=True)))


def time_all(quick: bool) -> None:
    print(f"{'dtype':5} {'E':>4} {'k':>2} {'G':>5} {'T':>8} {'plain us':>9} {'renorm us':>9} "
          f"{'select us':>9} {'ratio':>6}")  # fmt: skip
    shapes = []
    for dtype in (torch.float32, torch.bfloat16):
        for E, k, G, TG in ((256, 8, 8, 4), (128, 8, 1, 1), (64, 6, 8, 3), (16, 2, 1, 1)):
            for T in (64, 4096, 65536, 1 << 18, 1 << 20):
                shapes.append((dtype, E, k, G, TG, T))
    if quick:
        shapes = [s for s in shapes if s[1] in (256, 64)]
    for dtype, E, k, G, TG, T in shapes:
        x = scores_of(T, E, dtype, "sigmoid", 1)
        bias = torch.randn(E, device="cuda") * 0.1
        kw = dict(bias=bias, n_groups=G, topk_groups=TG, scale=2.5, renormalize=True)
        calls = 10 if T <= 65536 else 3
        plain = graph_us(lambda: route(x, k), calls, 10)
        renorm = graph_us(lambda: route(x, k, renormalize=True), calls, 10)
        sel = graph_us(lambda: route(x, k, **kw), calls, 10)
        print(f"{str(dtype)[6:]:5} {E:4} {k:2} {f'{G}/{TG}':>5} {T:8} {plain:9.1f} {renorm:9.1f} "
              f"{sel:9.1f} {sel / plain:6.2f}", flush=True)  # fmt: skip


def time_variants() -> None:
    """Kernel A's two selection variants, forced through ``Constraints`` (the library's one
    override): per-thread insertion (the default for top_k <= 8) against rounds over a tile
    (``block_t`` given), with and without the scan in C."""
    from moe_kernels._routing_outputs import Selection
    from moe_kernels._triton.routing import launch
    from moe_kernels._triton.routing.plan import Constraints

    print(f"{'dtype':5} {'E':>4} {'k':>2} {'T':>6} {'variant':>22} {'us':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for E, k, G, TG in ((256, 8, 8, 4), (64, 6, 8, 3)):
            for T in (64, 512, 4096, 16384):
                x = scores_of(T, E, dtype, "sigmoid", 2)
                sel = Selection(torch.randn(E, device="cuda") * 0.1, G, TG, 2.5)
                variants = {"insert": None}
                for bt in (1, 2, 4):
                    for sub in (1, 4):
                        variants[f"tile b{bt} s{sub}"] = Constraints(block_t=bt, sub=sub)
                for name, c in variants.items():
                    us = graph_us(lambda c=c: launch.run(x, k, None, 0, E, True, True, c,
                                                         selection=sel), 10, 10)  # fmt: skip
                    print(f"{str(dtype)[6:]:5} {E:4} {k:2} {T:6} {name:>22} {us:8.1f}",
                          flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip", default="", help="comma list of: check, time, variants")
    ap.add_argument("--quick", action="store_true", help="time E=256 and E=64 only")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if "check" not in skip:
        check_all()
    if "time" not in skip:
        time_all(args.quick)
    if "variants" not in skip:
        time_variants()
    print(f"# {len(FAILS)} failed checks")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
