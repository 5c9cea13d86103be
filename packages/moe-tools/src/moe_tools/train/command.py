"""The ``moe-bench train`` command: its options, its result's name, and its :class:`Command`
(a plain run is :func:`moe_tools.train.measure.run`, ``--sweep`` :func:`moe_tools.train.sweep.run`).
"""

from __future__ import annotations

import argparse

from moe_tools import command as cmd
from moe_tools.memory import check_top_k
from moe_tools.results import Result, slug
from moe_tools.train import report as train_report
from moe_tools.train import sweep as train_sweep
from moe_tools.train.measure import PRESETS, run


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moe_tools.matrix import impl_names

    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        help="tokens and layer sizes: tiny (64 tokens, E=8, top-2, d_model 64, hidden 32), "
        "seed-moe (2048, E=16, top-8, 2048, 1024), training (16384, E=128, top-8, 2048, 768); "
        "default: seed-moe on CUDA, tiny on CPU",
    )
    p.add_argument("--tokens", type=cmd.positive, help="tokens per step")
    p.add_argument("--d-model", type=cmd.positive, help="model width")
    p.add_argument("--experts", type=cmd.positive, help="number of experts (E)")
    p.add_argument("--top-k", type=cmd.positive, help="experts per token")
    p.add_argument("--hidden", type=cmd.positive, help="expert hidden size")
    p.add_argument("--gated", action="store_true", help="SwiGLU experts (default: SiLU)")
    p.add_argument("--renormalize", action="store_true", help="renormalise the top-k weights")
    p.add_argument(
        "--impls", type=cmd.choices_csv(impl_names), help="comma-separated (default: all)"
    )
    cmd.dtype_option(p)
    p.add_argument("--warmup", type=cmd.positive, help="untimed steps per variant")
    p.add_argument("--iters", type=cmd.positive, help="timed steps per variant")
    p.add_argument(
        "--steps",
        type=cmd.non_negative,
        help="AdamW steps of the convergence run (default: 50 on CUDA, 20 on CPU; 0: none)",
    )
    p.add_argument("--lr", type=cmd.positive_float, help="AdamW lr (default 0.08/sqrt(d_model))")
    p.add_argument("--no-compile", action="store_true", help="no compiled column")
    p.add_argument(
        "--compile-backend",
        metavar="NAME",
        help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)",
    )
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph column")
    roof = p.add_mutually_exclusive_group()
    roof.add_argument("--roofline", action="store_true", default=None,
                      help="forward + backward per mode beside the six grouped GEMMs "
                      "(default on CUDA)")  # fmt: skip
    roof.add_argument("--no-roofline", action="store_false", dest="roofline")
    p.add_argument(
        "--sweep", action="store_true",
        help="forward + backward vs the six grouped GEMMs over a grid of shapes, one axis at a "
        "time around the Qwen3-30B-A3B layer (the size options move the centre; default impls: "
        "triton_bf16, torch)",
    )  # fmt: skip
    p.add_argument(
        "--sweep-axes", type=cmd.choices_csv(tuple(train_sweep.GRID)), metavar="AXIS,..",
        help="--sweep: only these axes of the grid (one 10-minute device call fits one or two)",
    )  # fmt: skip
    cmd.plot_option(p, "every impl's convergence loss curve")


def result_name(args: argparse.Namespace) -> str:
    preset = args.preset or ("seed-moe" if args.device.type == "cuda" else "tiny")
    sizes = ("tokens", "d_model", "experts", "top_k", "hidden")
    shape = [f"{n.replace('_', '-')}={v}" for n in sizes if (v := getattr(args, n))]
    flags = [f for f in ("gated", "renormalize", "sweep") if getattr(args, f)]
    if args.sweep and getattr(args, "sweep_axes", None):
        flags.append("+".join(args.sweep_axes))
    return slug("train", preset, shape, flags, args.impls)


def run_cli(args: argparse.Namespace, checkpoint: cmd.Checkpoint | None = None) -> Result:
    if args.sweep_axes and not args.sweep:
        raise cmd.UsageError("--sweep-axes needs --sweep")
    if args.sweep:
        sizes = dict(tokens=args.tokens, d_model=args.d_model, n_experts=args.experts,
                     top_k=args.top_k, hidden=args.hidden)  # fmt: skip
        modes = ("eager",) + (() if args.no_compile else ("compiled",))
        center = {**train_sweep.CENTER, **{k: v for k, v in sizes.items() if v}}
        check_top_k(center)  # the centre's other points are the grid's, each sized as it runs
        return train_sweep.run(
            device=args.device, dtype=cmd.dtype_of(args.dtype, args.device), impls=args.impls,
            gated=args.gated, modes=modes + (() if args.no_graph else ("graph",)),
            backend=args.compile_backend or "inductor", warmup=args.warmup or 3,
            iters=args.iters or 10, seed=args.seed,
            center=center,
            grid={a: train_sweep.GRID[a] for a in args.sweep_axes} if args.sweep_axes else None,
            plot=args.plot,
        )  # fmt: skip
    return run(
        device=args.device,
        preset=args.preset,
        tokens=args.tokens,
        d_model=args.d_model,
        n_experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        gated=args.gated,
        renormalize=args.renormalize,
        impls=args.impls,
        dtype=cmd.dtype_of(args.dtype, args.device),
        warmup=args.warmup,
        iters=args.iters,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
        compile=not args.no_compile,
        compile_backend=args.compile_backend,
        graph=not args.no_graph,
        roofline=args.roofline,
        plot=args.plot,
    )


COMMAND = cmd.Command(
    name="train",
    help="every MoELayer impl as a training layer: step time, memory, gradients, convergence",
    add_arguments=add_arguments,
    run=run_cli,
    result_name=result_name,
    markdown=train_report.markdown,
    plot=lambda result, path: (
        train_sweep.plot(result.rows, path)
        if result.extra.get("sweep")
        else train_report.plot_loss_curves(
            result.extra.get("loss_curves", {}), path, title=train_report.plot_title(result.extra)
        )
    ),
)
