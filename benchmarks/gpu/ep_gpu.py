"""Expert parallelism on two GPUs (issue 24): ``ExpertParallelMoE`` against one GPU's
``MoELayer`` on the same tokens, both exchange modes, at the seed and training shapes: forward
and backward equality, no host sync in the padded mode, timings (eager, and the padded mode
replayed from a CUDA graph) beside the single-GPU layer, the padded forward captured in a CUDA
graph and replayed on new inputs, and the device guard (the layer and its tensors on cuda:r
while the current device is the other GPU).

    export PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/gpu/ep_gpu.py \\
        [--shapes=seed,train] [--impls=triton_bf16,torch] [--capacity-factor=1.25]

``--dry-run``: two ranks spawned on the CPU (gloo), tiny shapes, the CUDA-only sections skipped.
Shapes: seed = 2048 tokens per rank, E=16, top-8, d_model 2048, hidden 1024; train = 16384,
E=128, top-8, 2048, 768 (bf16 experts, SiLU; the gated rows SwiGLU). Each rank holds its own
tokens; the single-GPU layer holds all E experts and runs one rank's tokens.
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
from common import FAILS, capture, check, forbid_host_sync, same_bits

from moe_model import ExpertParallelMoE, MoELayer
from moe_tools.timing import graph_time_fn, time_fn

SHAPES = {  # name: (tokens per rank, experts, top_k, d_model, hidden)
    "seed": (2048, 16, 8, 2048, 1024),
    "train": (16384, 128, 8, 2048, 768),
}
TINY = {"seed": (24, 8, 2, 64, 32), "train": (40, 8, 2, 64, 48)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def check_all(name: str, ok: bool, detail: str = "") -> None:
    """``common.check`` of ``ok`` on every rank, printed once (rank 0)."""
    ok = agree(ok)
    if dist.get_rank() == 0:
        check(name, ok, detail)
    elif not ok:
        FAILS.append(name)


def agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    t = torch.tensor([0.0 if ok else 1.0], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() == 0)


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


def equality(shape, impl, gated, mode, dtype, dry) -> None:
    """y, dx and the local experts' gradients against one GPU's layer (all E experts)."""
    W, r = dist.get_world_size(), dist.get_rank()
    full = make_layer(shape, impl, gated, dtype, dry)
    E, k = full.n_experts, full.top_k
    cf = E / k  # C = T: nothing dropped, so exact
    ep = ExpertParallelMoE(copy.deepcopy(full), mode=mode, capacity_factor=cf)
    xs = [tokens(shape, full.d_model, dtype, dry, s) for s in range(W)]
    tag = f"{shape} {impl} gated={gated} {mode}"
    with torch.no_grad():
        with forbid_host_sync(mode == "padded" and DEVICE.type == "cuda"):
            y = ep(xs[r])
        y_ref = full(xs[r])
    bit = agree(same_bits(y, y_ref))
    err = worst(rel_err(y, y_ref))
    check_all(f"{tag}: forward", err <= 2e-2, f"bitwise={bit}, rel err {err:.2e}")
    if impl in ("fbgemm",):
        return
    full.requires_grad_(True)
    ep.requires_grad_(True)
    dy = torch.cos(torch.arange(xs[r].numel(), device=DEVICE, dtype=torch.float32)).view_as(xs[r])
    x = xs[r].clone().requires_grad_()
    (ep(x).float() * dy).sum().backward()
    whole = torch.cat(xs).requires_grad_()
    dys = torch.cat([dy] * W)
    (full(whole).float() * dys).sum().backward()
    lo, hi, T = ep.expert_start, ep.expert_end, xs[r].shape[0]
    errs = {
        "dx": rel_err(x.grad, whole.grad[r * T : (r + 1) * T]),
        "d in_proj": rel_err(ep.in_proj.grad, full.in_proj.grad[lo:hi]),
        "d out_proj": rel_err(ep.out_proj.grad, full.out_proj.grad[lo:hi]),
    }
    errs = {n: worst(e) for n, e in errs.items()}
    detail = ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
    check_all(f"{tag}: backward", all(e <= 2e-2 for e in errs.values()), detail)


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


def graph_replay(shape, impl, dtype, dry) -> None:
    """The padded forward captured once, replayed on new tokens copied into its input."""
    if DEVICE.type != "cuda":
        say("  skipped: CUDA graphs need CUDA")
        return
    r = dist.get_rank()
    full = make_layer(shape, impl, False, dtype, dry).requires_grad_(False)
    ep = ExpertParallelMoE(copy.deepcopy(full), mode="padded", capacity_factor=1.25)
    x = tokens(shape, full.d_model, dtype, dry, r)
    with torch.no_grad():
        graph, y_static = capture(lambda: ep(x), warmup=2)
        new = tokens(shape, full.d_model, dtype, dry, r + 17)
        want = ep(new).clone()
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
    check_all(f"{shape} {impl}: padded graph replay == eager", same_bits(y_static, want))


def device_guard(impl, dtype, dry) -> None:
    """Layer and tokens on cuda:r, current device the other GPU: the same bits, nothing
    allocated on the current device."""
    if DEVICE.type != "cuda" or torch.cuda.device_count() < 2:
        say("  skipped: needs two CUDA devices")
        return
    r = dist.get_rank()
    other = torch.device("cuda", (DEVICE.index + 1) % torch.cuda.device_count())
    full = make_layer("seed", impl, True, dtype, dry).requires_grad_(True)
    for mode in ("dropless", "padded"):
        ep = ExpertParallelMoE(copy.deepcopy(full), mode=mode, capacity_factor=2.0)
        x = tokens("seed", full.d_model, dtype, dry, r).requires_grad_()
        y_home = ep(x)
        y_home.float().sum().backward()
        g_home = x.grad.clone()
        x.grad = None
        torch.cuda.synchronize(DEVICE)
        before = torch.cuda.memory_allocated(other)
        torch.cuda.set_device(other)
        try:
            y = ep(x)
            y.float().sum().backward()
            torch.cuda.synchronize(DEVICE)
            after = torch.cuda.memory_allocated(other)
            current = torch.cuda.current_device()
        finally:
            torch.cuda.set_device(DEVICE)
        ok = same_bits(y, y_home) and same_bits(x.grad, g_home) and after == before
        detail = f"(current device {current}, {after - before} bytes allocated on it)"
        check_all(f"device guard {mode}", ok and current == other.index, detail)


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
    say("\n## equality with one GPU's layer (nothing dropped)")
    for shape in shapes:
        for impl in impls:
            for gated in (False, True):
                for mode in ("dropless", "padded"):
                    equality(shape, impl, gated, mode, dtype, dry)
    say(f"\n## forward times (capacity_factor {args.capacity_factor})")
    for shape in shapes:
        for impl in impls:
            timings(shape, impl, dtype, dry, args.capacity_factor)
    say("\n## the padded forward in a CUDA graph")
    for shape in shapes:
        graph_replay(shape, impls[0], dtype, dry)
    say("\n## device guard")
    device_guard(impls[0], dtype, dry)
    passed = agree(not FAILS)
    say(f"\n# {'all checks passed' if passed else 'FAILED: ' + ', '.join(FAILS)}")
    if not dry:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
