"""``moe-bench ep``: ``moe_model.ExpertParallelMoE`` per exchange mode and world size, against the
single-device ``MoELayer``.

Every rank holds ``tokens`` tokens of its own (as in data parallelism) and E / W experts; the
single-device row is the full layer (all E experts) on one rank's tokens. Per (shape, world
size, mode): the forward's median time (``ep_ms``, the slowest rank's median, eager, no
autograd), the single-device layer's (``single_ms``, rank 0), the rows sent to other ranks
(``sent_mib``: dispatched rows plus the expert outputs sent back, mean per rank per forward,
the padding of the padded mode included), the pairs dropped (``dropped``, the group's total per
forward), the largest error against the single-device layer on the same tokens (``max_err``,
``max |a - b| / max |b|`` over the ranks) and whether every rank's output equals it bit for bit.

Two ways to run it. Under ``torchrun`` (``WORLD_SIZE`` set) every process is one rank and the
world size is torchrun's: ``torchrun --nproc-per-node 2 -m moe_tools.cli ep``. Otherwise the
command launches each of ``world_sizes`` itself (``torch.multiprocessing`` spawn, a local
process group: NCCL on CUDA with one GPU per rank, gloo on CPU) and collects rank 0's rows:
``moe-bench ep --device cpu --world-sizes 1,2 --shapes tiny`` is CI's smoke test.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moe_tools import command as cmd
from moe_tools.results import Result, slug
from moe_tools.tables import Row, short_error
from moe_tools.timing import default_device, time_fn

# tokens per rank and the layer; seed-moe and training are moe_tools.train's shapes
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(tokens=32, d_model=64, n_experts=8, top_k=2, hidden=32),
    "seed-moe": dict(tokens=2048, d_model=2048, n_experts=16, top_k=8, hidden=1024),
    "training": dict(tokens=16384, d_model=2048, n_experts=128, top_k=8, hidden=768),
}
MODES = ("dropless", "padded")
COLUMNS = [
    "shape",
    "tokens",
    "world",
    "mode",
    "ep_ms",
    "single_ms",
    "vs_single",
    "sent_mib",
    "dropped",
    "max_err",
    "bitwise",
    "status",
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def under_torchrun() -> bool:
    """Whether this process is one rank of a launcher's group (``WORLD_SIZE`` in the env)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def quiet_other_ranks(args: Any) -> None:
    """Under torchrun only rank 0 prints and writes JSON (--json, --save; the CLI calls this
    first)."""
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        args.json = args.save = None
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)


def run(
    *,
    device: torch.device | str | None = None,
    shapes: Sequence[str] | None = None,
    tokens: int | None = None,
    modes: Sequence[str] | None = None,
    world_sizes: Sequence[int] | None = None,
    capacity_factor: float = 1.25,
    impl: str | None = None,
    dtype: torch.dtype | None = None,
    warmup: int | None = None,
    iters: int | None = None,
    seed: int = 0,
) -> Result:
    """Measure every (shape, world size, mode); rank 0's rows (one per combination)."""
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    params = dict(
        device=device.type,
        shapes=list(shapes or (["seed-moe", "training"] if cuda else ["tiny"])),
        tokens=tokens,
        modes=list(modes or MODES),
        capacity_factor=float(capacity_factor),
        impl=impl or ("triton_bf16" if cuda else "triton_fp32"),
        dtype=str(dtype or (torch.bfloat16 if cuda else torch.float32)).removeprefix("torch."),
        warmup=warmup or (5 if cuda else 1),
        iters=iters or (20 if cuda else 3),
        seed=seed,
    )
    bad = [s for s in params["shapes"] if s not in SHAPES] + [
        m for m in params["modes"] if m not in MODES
    ]
    if bad:
        raise cmd.UsageError(f"unknown shapes/modes {bad}: shapes {list(SHAPES)}, modes {MODES}")
    extra: dict[str, Any] = {k: v for k, v in params.items() if k != "device"}
    extra["notes"] = [
        "tokens: per rank; single_ms: the full layer on one rank's tokens; dropless reads "
        "the split sizes on the host once per forward, padded never",
    ]
    if under_torchrun():
        if world_sizes:
            raise cmd.UsageError("under torchrun the world size is torchrun's: drop --world-sizes")
        world = int(os.environ["WORLD_SIZE"])
        host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_group(params, [world], device, host_ranks, "torchrun's world size")
        rows = _group_rows(params)
        extra["world_sizes"] = [world]
        return Result("ep", rows, COLUMNS, extra)
    world_sizes = list(world_sizes or ([1, 2] if not cuda else _cuda_worlds()))
    check_group(params, world_sizes, device, max(world_sizes), "--world-sizes")
    extra["world_sizes"] = world_sizes
    rows: list[Row] = []
    for world in world_sizes:
        rows += _spawned_rows(params, world)
    return Result("ep", rows, COLUMNS, extra)


def check_group(
    params: dict[str, Any],
    world_sizes: Sequence[int],
    device: torch.device,
    host_ranks: int,
    flag: str,
) -> None:
    """UsageError before any rank starts: a world size above every shape's expert count (each
    rank holds E / W experts), or a shape whose layer and tokens would not fit ``device`` (on
    the CPU ``host_ranks`` ranks share it; on CUDA each rank has its GPU)."""
    from moe_tools.matrix import layer_bytes
    from moe_tools.memory import GIB, check_fits

    most = max(SHAPES[s]["n_experts"] for s in params["shapes"])
    for world in world_sizes:
        if world > most:
            raise cmd.UsageError(
                f"{flag} {world}: more ranks than experts ({most} at most for "
                f"{', '.join(params['shapes'])}); each rank holds E / W of them"
            )
    ranks = host_ranks if device.type == "cpu" else 1
    dtype = getattr(torch, params["dtype"])
    for shape in params["shapes"]:
        sizes = {k: v for k, v in SHAPES[shape].items() if k != "tokens"}
        tokens = params["tokens"] or SHAPES[shape]["tokens"]
        weights, activations = layer_bytes(sizes, tokens, dtype)  # the full layer and its copy
        check_fits(
            f"ep's {shape} layer at {tokens} tokens per rank",
            ranks * (2 * weights + activations),
            device,
            f"{ranks} rank(s) x (2 x {weights / GIB:.1f} GiB of weights, about "
            f"{activations / GIB:.1f} GiB of activations)",
            f"Fewer --tokens or a smaller {flag}.",
        )


def _cuda_worlds() -> list[int]:
    n = torch.cuda.device_count()
    return [w for w in (1, 2, 4, 8) if w <= n]


def _spawned_rows(params: dict[str, Any], world: int) -> list[Row]:
    """One local group of ``world`` processes; rank 0 writes its rows to a file we read."""
    if params["device"] == "cuda" and world > torch.cuda.device_count():
        return [
            _row(params, s, world, m, f"unavailable: {world} GPUs needed")
            for s in params["shapes"]
            for m in params["modes"]
        ]
    experts = {s: SHAPES[s]["n_experts"] for s in params["shapes"]}
    if all(e % world for e in experts.values()):  # no rank would measure: start none
        return [
            _row(params, s, world, m, f"unavailable: E={experts[s]} not divisible by {world}")
            for s in params["shapes"]
            for m in params["modes"]
        ]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # the group meets in a file: no port to pick
        store = Path(tmp, "store").as_uri()
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_spawned_rank, args=(world, store, params, out), nprocs=world, join=True)
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def _spawned_rank(rank: int, world: int, store: str, params: dict[str, Any], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    rows = _group_rows(params, store)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(rows, f)


def _group_rows(params: dict[str, Any], init_method: str | None = None) -> list[Row]:
    """This process's rank of the group in the env (RANK, WORLD_SIZE; ``init_method`` or
    torchrun's MASTER_ADDR / MASTER_PORT): every (shape, mode); rank 0's rows."""
    import torch.distributed as dist

    cuda = params["device"] == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (KINDS.md)
        torch.cuda.set_device(device)
    else:  # one thread a rank: CPU rows are a smoke test (and OpenMP spinning ranks crawl)
        torch.set_num_threads(1)
    owner = not dist.is_initialized()
    if owner:
        # torch._dynamo imported while a group exists (the layer's first custom-op call does)
        # keeps the group alive past destroy_process_group; its gloo threads then abort the
        # process at exit, about one run in six (torch 2.13, 2.14): import it first.
        importlib.import_module("torch._dynamo")

        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init_method,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=600),
        )
    try:
        rows = [
            _measure(params, shape, mode, device)
            for shape in params["shapes"]
            for mode in params["modes"]
        ]
        dist.barrier()
    finally:
        if owner:
            dist.destroy_process_group()
    return rows


def _row(params: dict[str, Any], shape: str, world: int, mode: str, status: str) -> Row:
    row: Row = {c: None for c in COLUMNS}
    tokens = params["tokens"] or SHAPES[shape]["tokens"]
    row.update(shape=shape, tokens=tokens, world=world, mode=mode, status=status)
    return row


def _layer(params: dict[str, Any], shape: str, device: torch.device):
    from moe_model import MoELayer

    s = SHAPES[shape]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        layer = MoELayer(s["d_model"], s["n_experts"], s["top_k"], s["hidden"], impl=params["impl"])
    layer = layer.to(device).requires_grad_(False)
    dtype = getattr(torch, params["dtype"])
    for p in (layer.in_proj, layer.out_proj):
        p.data = p.data.to(dtype)
    return layer


def _measure(params: dict[str, Any], shape: str, mode: str, device: torch.device) -> Row:
    """Every rank runs this in lockstep (the same collectives); all ranks return rank 0's row."""
    import torch.distributed as dist

    from moe_model import ExpertParallelMoE

    world, rank = dist.get_world_size(), dist.get_rank()
    row = _row(params, shape, world, mode, "ok")
    tokens = row["tokens"]
    warmup, iters = params["warmup"], params["iters"]
    full = _layer(params, shape, device)
    if full.n_experts % world:
        row["status"] = f"unavailable: E={full.n_experts} not divisible by {world}"
        return row
    gen = torch.Generator().manual_seed(cmd.derived_seed(params["seed"] * 1000 + rank))
    dtype = getattr(torch, params["dtype"])
    x = torch.randn(tokens, full.d_model, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        y_ref = full(x)
        dist.barrier()
        single = None
        if rank == 0:
            single = time_fn(lambda: full(x), device, warmup=warmup, iters=iters).median_ms
        dist.barrier()
        ep = ExpertParallelMoE(
            copy.deepcopy(full), mode=mode, capacity_factor=params["capacity_factor"]
        )
        try:
            y = ep(x)
        except Exception as exc:  # the same on every rank (the checks run before collectives)
            row["status"] = f"failed: {short_error(exc)}"
            return row
        err = (y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max().clamp(min=1e-30)
        bitwise = torch.equal(y, y_ref)
        sent = sum(ep.last_send_rows) - ep.last_send_rows[ep.rank]
        row_bytes = 2 * x.shape[1] * ep.in_proj.element_size()  # rows out, outputs back
        if ep.impl == "baseline":  # x's rows out, fp32 expert outputs back
            row_bytes = x.shape[1] * (x.element_size() + 4)
        stats = torch.tensor(
            [float(err), float(not bitwise), float(sent * row_bytes), float(ep.dropped)],
            dtype=torch.float64,
            device=device,
        )
        ms = time_fn(lambda: ep(x), device, warmup=warmup, iters=iters).median_ms
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst = stats[:2].clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        total = stats[2:].clone()
        dist.all_reduce(total)
    row.update(
        ep_ms=float(t[0]),
        single_ms=single,
        vs_single=(float(t[0]) / single) if single else None,
        sent_mib=float(total[0]) / world / 2**20,
        dropped=int(total[1]),
        max_err=float(worst[0]),
        bitwise=bool(worst[1] == 0),
    )
    return row


# ----------------------------------------------------------------------------------------------
# the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moe_tools.rollout import impl_name

    p.add_argument(
        "--shapes",
        type=cmd.choices_csv(tuple(SHAPES)),
        metavar="S,..",
        help="tiny, seed-moe (2048 tokens per rank, E=16, top-8), training (16384, E=128, "
        "top-8); default: seed-moe,training on CUDA, tiny on CPU",
    )
    p.add_argument("--tokens", type=cmd.positive, help="tokens per rank")
    p.add_argument("--modes", type=cmd.choices_csv(MODES), help="dropless,padded (default: both)")
    p.add_argument(
        "--world-sizes",
        type=cmd.int_csv,
        metavar="W,..",
        help="without torchrun: launch these group sizes (default: 1,2 on CPU, 1,2,4,8 up to "
        "the GPUs on CUDA)",
    )
    p.add_argument("--capacity-factor", type=cmd.positive_float, default=1.25)
    p.add_argument(
        "--impl", type=impl_name, help="MoE impl (default: triton_bf16, CPU triton_fp32)"
    )
    cmd.dtype_option(p)
    p.add_argument("--warmup", type=cmd.positive, help="untimed calls per row")
    p.add_argument("--iters", type=cmd.positive, help="timed calls per row")


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    return run(
        device=args.device,
        shapes=args.shapes,
        tokens=args.tokens,
        modes=args.modes,
        world_sizes=args.world_sizes,
        capacity_factor=args.capacity_factor,
        impl=args.impl,
        dtype=cmd.dtype_of(args.dtype, args.device) if args.dtype else None,
        warmup=args.warmup,
        iters=args.iters,
        seed=args.seed,
    )


COMMAND = cmd.Command(
    name="ep",
    help="ExpertParallelMoE per mode and world size (under torchrun, or spawned)",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=lambda args: slug("ep", args.shapes, args.modes, args.world_sizes, args.impl),
    prepare=quiet_other_ranks,
)
