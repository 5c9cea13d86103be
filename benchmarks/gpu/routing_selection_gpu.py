"""route's selection options on the GPU (issue 23): kernel A 'grouped' timed in CUDA graphs
against plain ``route`` at the same shape.

Timing (``--skip=time`` to leave out): device time per call in a CUDA graph of 10 calls, for
plain route and route with bias + groups (+ scale + renormalize as DeepSeek-V3 has them), over
T x E x k x dtype; the ratio (to plain route, no options) is the issue's target (<= 1.2x at
T=65536 and 2^20, E=256, k=8). ``variants``: kernel A's two selection variants forced through
``Constraints``. Bit for bit against the reference, no host sync, graph replay:
``tests/gpu/test_routing_gpu.py``.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/routing_selection_gpu.py [--skip=time,variants] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import graph_us

from moe_kernels import route


def scores_of(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.sigmoid(torch.randn(T, E, device="cuda", generator=g)).to(dtype)


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
        x = scores_of(T, E, dtype, 1)
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
                x = scores_of(T, E, dtype, 2)
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
    ap.add_argument("--skip", default="", help="comma list of: time, variants")
    ap.add_argument("--quick", action="store_true", help="time E=256 and E=64 only")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if "time" not in skip:
        time_all(args.quick)
    if "variants" not in skip:
        time_variants()
    sys.exit(0)


if __name__ == "__main__":
    main()
