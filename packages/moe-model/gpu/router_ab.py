"""The seed-moe rollout with each router (one H200 run): the kernel implementations'
``moe_kernels.router_scores`` against the torch formula, same process, same weights.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 packages/moe-model/gpu/router_ab.py            # H200 (~5 min)
DRY=1 python3 packages/moe-model/gpu/router_ab.py          # CPU smoke run, tiny sizes

Rows, for ``triton_bf16`` (``AB_IMPL`` to change): ``moe-bench rollout``'s figures with compile
and CUDA graphs (256 frames on the GPU), first with the kernel router (the default for E <= 32),
then with the torch formula (``moe_model.moe.KERNEL_ROUTER_IMPLS`` emptied), then (``AB_AGAIN=1``)
the kernel router once more, a drift check. The layer alone: ``gpu/layer_breakdown.py``.
"""

from __future__ import annotations

import os

import torch

import moe_model.moe as moe
from moe_tools import rollout

DRY = os.environ.get("DRY", "0") == "1"
DEV = torch.device("cpu" if DRY else "cuda")
IMPL = os.environ.get("AB_IMPL", "triton_bf16")
KERNEL = moe.KERNEL_ROUTER_IMPLS


def one(label: str, impls: tuple[str, ...]) -> None:
    moe.KERNEL_ROUTER_IMPLS = impls
    torch._dynamo.reset()
    r = rollout.run(
        device=DEV,
        preset="tiny" if DRY else "seed-moe",
        frames=4 if DRY else 256,
        impl=IMPL,
        compile=not DRY,
        cuda_graph=not DRY,
        progress=False,
    ).rows[0]
    print(
        f"{label:14} rollout {r['fps']:7.1f} fps  frame median {r['frame_ms_median']:.3f} ms  "
        f"VRAM {r['vram_f16_gib']} -> {r['vram_last_gib']} GiB  {r['status']}",
        flush=True,
    )


def main() -> None:
    print(f"torch {torch.__version__}, impl {IMPL}")
    one("kernel router", KERNEL)
    one("torch router", ())
    if os.environ.get("AB_AGAIN") == "1":
        one("kernel again", KERNEL)


if __name__ == "__main__":
    main()
