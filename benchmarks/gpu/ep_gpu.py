"""Expert parallelism on two GPUs (issue 24): ``ExpertParallelMoE``'s forward times per exchange
mode (eager, and the padded mode replayed from a CUDA graph) beside one GPU's ``MoELayer`` on
the same tokens, at the seed and training shapes, with the bytes each rank sends and the pairs
dropped. Equality with one GPU's layer, no host sync, graph replay and the device guard:
``packages/moe-model/tests/gpu/test_expert_parallel_gpu.py``.

    export PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/gpu/ep_gpu.py \\
        [--shapes=seed,train] [--impls=triton_bf16,torch] [--capacity-factor=1.25]

``--dry-run``: two ranks spawned on the CPU (gloo), tiny shapes, the CUDA graph skipped.
Shapes: seed = 2048 tokens per rank, E=16, top-8, d_model 2048, hidden 1024; train = 16384,
E=128, top-8, 2048, 768 (bf16 experts, SiLU). Each rank holds its own tokens; the single-GPU
layer holds all E experts and runs one rank's tokens.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from moe_model import ExpertParallelMoE, MoELayer
from moe_tools.timing import graph_time_fn, time_fn

SHAPES = {  # name: (tokens per rank, experts, top_k, d_model, hidden)
    "seed": (2048, 16, 8, 2048, 1024),
    "train": (16384, 128, 8, 2048, 768),
}
TINY = {"seed": (24, 8, 2, 64, 32), "train": (40, 8, 2, 64, 48)}


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def make_layer(shape, impl, gated, dtype, dry) -> MoELayer:
    T, E, k, D, H = (TINY if dry else SHAPES)[shape]
    torch.manual_seed(0)
    return MoELayer(D, E, k, H, gated=gated, impl=impl, device=DEVICE, dtype=dtype)


def tokens(shape, D, dtype, dry, rank) -> torch.Tensor:
    T = (TINY if dry else SHAPES)[shape][0]
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, D, generator=gen).to(DEVICE, dtype)


def timings(shape, impl, dtype, dry, cf) -> None:
    """Median forward times: EP eager per mode, the padded mode in a CUDA graph, one GPU."""
    W, r = dist.get_world_size(), dist.get_rank()
    full = make_layer(shape, impl, False, dtype, dry).requires_grad_(False)
    x = tokens(shape, full.d_model, dtype, dry, r)
    warm, iters = (1, 2) if dry else (5, 20)
    with torch.no_grad():
        single = time_fn(lambda: full(x), DEVICE, warmup=warm, iters=iters).median_ms
        for mode in ("dropless", "padded"):
            ep = ExpertParallelMoE(copy.deepcopy(full), mode=mode, capacity_factor=cf)
            ep(x)
            sent = sum(ep.last_send_rows) - ep.last_send_rows[r]
            mib = 2 * sent * full.d_model * ep.in_proj.element_size() / 2**20
            eager = worst(time_fn(lambda ep=ep: ep(x), DEVICE, warmup=warm, iters=iters).median_ms)
            graph = None
            if mode == "padded" and DEVICE.type == "cuda":  # fixed counts: ranks in lockstep
                t = graph_time_fn(lambda ep=ep: ep(x), DEVICE, warmup=2, iters=iters)
                graph = worst(t.median_ms)
            dropped = torch.tensor([float(ep.dropped)], device=DEVICE)
            dist.all_reduce(dropped)
            say(
                f"  {shape} {impl} W={W} {mode:8s} eager {eager:.3f} ms"
                + (f", graph {graph:.3f} ms" if graph is not None else "")
                + f"; one GPU {single:.3f} ms (rank 0: x{eager / single:.2f});"
                f" sent {mib:.3g} MiB (rank 0), dropped {int(dropped.item())} (group)"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="seed,train")
    p.add_argument("--impls", default="triton_bf16,torch")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, 2 spawned ranks")
    args = p.parse_args(argv)
    if args.dry_run and "RANK" not in os.environ:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp, "store").as_uri()
            mp.spawn(_dry_rank, args=(store, argv), nprocs=2, join=True)
        return 0
    return run(args)


def _dry_rank(rank: int, store: str, argv: list[str] | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store, rank=rank, world_size=2)
    os.environ["RANK"] = str(rank)
    try:
        code = main(argv)
    finally:
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


DEVICE = torch.device("cpu")


def run(args: argparse.Namespace) -> int:
    global DEVICE
    dry = args.dry_run
    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (before NCCL)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        DEVICE = torch.device("cuda", local)
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
    dtype = torch.float32 if dry else torch.bfloat16
    shapes, impls = args.shapes.split(","), args.impls.split(",")
    say(f"# ep_gpu: W={dist.get_world_size()} on {DEVICE.type}, NCCL_NVLS_ENABLE="
        f"{os.environ.get('NCCL_NVLS_ENABLE')}")  # fmt: skip
    say(f"\n## forward times (capacity_factor {args.capacity_factor})")
    for shape in shapes:
        for impl in impls:
            timings(shape, impl, dtype, dry, args.capacity_factor)
    if not dry:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
