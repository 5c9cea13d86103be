"""``moe-bench``: argument parsing only. Each sub-command calls one module's ``run`` and prints the
environment header and the returned rows as a table (and writes JSON / a plot when asked)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_tools import __version__, report

PRESETS = ("tiny", "seed-moe")
TRAIN_PRESETS = ("tiny", "seed-moe", "training")  # moe_tools.train.PRESETS
MOE_PRESETS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")  # moe_model.MOE_PRESETS


def _device(text: str) -> torch.device:
    if text == "auto":
        from moe_tools.timing import default_device

        return default_device()
    try:
        dev = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda, got {text!r}")
    return dev


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _csv(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _int_csv(text: str) -> list[int]:
    return [_positive(item) for item in _csv(text)]


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


SWEEP_DTYPES = ("bf16", "fp32")
SWEEP_ONLY = ("sweep_T", "sweep_E", "sweep_k", "sweep_dtypes", "jobs")


def _sweep_dtypes(text: str) -> list[str]:
    items = _csv(text)
    bad = [d for d in items if d not in SWEEP_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"dtypes must be among {SWEEP_DTYPES}, got {bad}")
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-bench",
        description="Benchmarks and checks for moe-kernels and moe-model: speed, determinism, "
        "drift, rollout throughput and VRAM, kernel bandwidth.",
    )
    parser.add_argument("--version", action="version", version=f"moe-bench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--device", type=_device, default="auto", help="cpu, cuda, cuda:N or auto (default)"
    )
    common.add_argument("--json", metavar="PATH", help="also write the rows and environment here")
    common.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")

    dtype = dict(choices=("bf16", "fp16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")

    p = sub.add_parser("matrix", parents=[common], help="every MoELayer impl: speed and drift")
    p.add_argument(
        "--preset",
        choices=PRESETS + MOE_PRESETS,
        default=None,
        help="the layer: a world model's (tiny, seed-moe) or a published model's with its "
        "routing options (moe_model.MOE_PRESETS); default: seed-moe on CUDA, tiny on CPU",
    )
    p.add_argument(
        "--tokens",
        type=_positive,
        default=None,
        help="tokens per call (default: 2048 on CUDA, 4096 for an MoE preset; 64 on CPU)",
    )
    p.add_argument("--impls", type=_csv, default=None, help="comma-separated (default: all)")
    p.add_argument("--dtype", **dtype)
    p.add_argument("--warmup", type=_positive, default=None, help="untimed calls per variant")
    p.add_argument("--iters", type=_positive, default=None, help="timed calls per variant")
    p.add_argument("--no-compile", action="store_true", help="eager columns only")

    p = sub.add_parser("rollout", parents=[common], help="a world-model rollout: fps and VRAM")
    p.add_argument(
        "--preset", choices=PRESETS, default=None, help="default: seed-moe on CUDA, tiny on CPU"
    )
    p.add_argument(
        "--frames",
        type=_positive,
        default=None,
        help="timed frames (default: 256 on CUDA, 16 on CPU)",
    )
    p.add_argument(
        "--warmup-frames",
        type=int,
        default=None,
        help="untimed frames first (default 8 on CUDA, 2 on CPU)",
    )
    p.add_argument("--impl", default=None, help="MoE implementation (default: the preset's)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (on CUDA with CUDA graphs, unless --no-cuda-graph)",
    )
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=True,
        default=None,
        help="replay every frame from CUDA graphs (default: with --compile on CUDA)",
    )
    graphs.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=False,
        help="no CUDA graphs, even with --compile",
    )
    p.add_argument(
        "--modes",
        type=_csv,
        default=None,
        metavar="M,..",
        help="runtimes measured on one engine, in order: eager, compile (no graphs), graph "
        "(compile + CUDA graphs); replaces --compile / --cuda-graph",
    )
    p.add_argument(
        "--no-images", action="store_true", help="keep each frame's latent: no decode, no copy"
    )
    p.add_argument("--dtype", **dtype)
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile steady frames: device time per kernel category, host time, launches",
    )
    p.add_argument(
        "--profile-frames",
        type=_positive,
        default=None,
        metavar="N",
        help="frames profiled with --profile (default 16 on CUDA, 2 on CPU)",
    )
    p.add_argument(
        "--plot", metavar="PNG", help="per-frame time over the rollout (--profile: the breakdown)"
    )

    p = sub.add_parser("kernels", parents=[common], help="each kernel vs torch and a clone")
    p.add_argument("--quick", action="store_true", help="small shapes (always on CPU)")
    p.add_argument("--ops", type=_csv, default=None, help="only these ops (e.g. route,combine)")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="GB/s against size, with the copy ceiling (--sweep: speedup heatmaps)",
    )
    p.add_argument(
        "--sweep",
        choices=("routing",),
        default=None,
        help="a grid instead of the op list: routing = index_shuffling and route over "
        "T x E x k x dtype, vs torch-native and fbgemm (--ops route narrows it)",
    )
    p.add_argument("--sweep-T", type=_int_csv, metavar="T,..", help="token counts of the sweep")
    p.add_argument("--sweep-E", type=_int_csv, metavar="E,..", help="expert counts of the sweep")
    p.add_argument("--sweep-k", type=_int_csv, metavar="K,..", help="top-k values of the sweep")
    p.add_argument("--sweep-dtypes", type=_sweep_dtypes, metavar="bf16,fp32", help="score dtypes")
    p.add_argument(
        "--jobs",
        type=_non_negative,
        default=0,
        metavar="N",
        help="--sweep on CUDA: compile every plan first in N processes (default 0: inline)",
    )

    p = sub.add_parser("verify", parents=[common], help="every kernel vs its reference")
    p.add_argument(
        "--shapes",
        type=_positive,
        default=None,
        help="random shapes per op (default: 8 on CUDA, 3 on CPU)",
    )
    p.add_argument("--ops", type=_csv, default=None, help="only these checks")

    p = sub.add_parser(
        "train", parents=[common], help="every MoELayer impl training: step time, grads, loss"
    )
    p.add_argument(
        "--preset",
        choices=TRAIN_PRESETS,
        default=None,
        help="tokens and layer sizes: tiny (64 tokens, E=8, top-2, d_model 64, hidden 32), "
        "seed-moe (2048, E=16, top-8, 2048, 1024), training (16384, E=128, top-8, 2048, 768); "
        "default: seed-moe on CUDA, tiny on CPU",
    )
    p.add_argument("--tokens", type=_positive, default=None, help="tokens per step")
    p.add_argument("--d-model", type=_positive, default=None, help="model width")
    p.add_argument("--experts", type=_positive, default=None, help="number of experts (E)")
    p.add_argument("--top-k", type=_positive, default=None, help="experts per token")
    p.add_argument("--hidden", type=_positive, default=None, help="expert hidden size")
    p.add_argument("--gated", action="store_true", help="SwiGLU experts (default: SiLU)")
    p.add_argument("--renormalize", action="store_true", help="renormalise the top-k weights")
    p.add_argument("--impls", type=_csv, default=None, help="comma-separated (default: all)")
    p.add_argument("--dtype", **dtype)
    p.add_argument("--warmup", type=_positive, default=None, help="untimed steps per variant")
    p.add_argument("--iters", type=_positive, default=None, help="timed steps per variant")
    p.add_argument(
        "--steps",
        type=_non_negative,
        default=None,
        help="AdamW steps of the convergence run (default: 50 on CUDA, 20 on CPU; 0: none)",
    )
    p.add_argument(
        "--lr", type=_positive_float, default=None, help="AdamW lr (default 0.08/sqrt(d_model))"
    )
    p.add_argument("--no-compile", action="store_true", help="no compiled column")
    p.add_argument(
        "--compile-backend",
        default=None,
        metavar="NAME",
        help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)",
    )
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph column")
    p.add_argument("--plot", metavar="PNG", help="every impl's convergence loss curve")

    p = sub.add_parser(
        "ep", parents=[common], help="ExpertParallelMoE per mode and world size (torchrun or spawn)"
    )
    p.add_argument(
        "--shapes",
        type=_csv,
        default=None,
        metavar="S,..",
        help="tiny, seed-moe (2048 tokens per rank, E=16, top-8), training (16384, E=128, "
        "top-8); default: seed-moe,training on CUDA, tiny on CPU",
    )
    p.add_argument("--tokens", type=_positive, default=None, help="tokens per rank")
    p.add_argument("--modes", type=_csv, default=None, help="dropless,padded (default: both)")
    p.add_argument(
        "--world-sizes",
        type=_int_csv,
        default=None,
        metavar="W,..",
        help="without torchrun: launch these group sizes (default: 1,2 on CPU, 1,2,4,8 up to "
        "the GPUs on CUDA)",
    )
    p.add_argument("--capacity-factor", type=_positive_float, default=1.25)
    p.add_argument("--impl", default=None, help="MoE impl (default: triton_bf16, CPU triton_fp32)")
    p.add_argument("--dtype", **dtype)
    p.add_argument("--warmup", type=_positive, default=None, help="untimed calls per row")
    p.add_argument("--iters", type=_positive, default=None, help="timed calls per row")

    p = sub.add_parser("report", help="markdown page from saved JSON results")
    p.add_argument(
        "--results",
        required=True,
        action="append",
        metavar="DIR",
        help="folder of JSON results (repeat it for several, in the order to list them)",
    )
    p.add_argument("--out", default="BENCHMARKS.md", metavar="PATH", help="markdown to write")
    p.add_argument("--title", default=None)
    return parser


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _run(
    args: argparse.Namespace, checkpoint: Callable[[report.Result], object] | None = None
) -> report.Result:
    progress = not args.no_progress
    if args.command == "matrix":
        from moe_tools import matrix

        return matrix.run(
            device=args.device,
            preset=args.preset,
            tokens=args.tokens,
            impls=args.impls,
            dtype=_dtype(args.dtype, args.device),
            warmup=args.warmup,
            iters=args.iters,
            seed=args.seed,
            progress=progress,
            compile=not args.no_compile,
        )
    if args.command == "rollout":
        from moe_tools import rollout

        return rollout.run(
            device=args.device,
            preset=args.preset,
            frames=args.frames,
            warmup_frames=args.warmup_frames,
            impl=args.impl,
            compile=args.compile,
            cuda_graph=args.cuda_graph,
            dtype=_dtype(args.dtype, args.device),
            seed=args.seed,
            progress=progress,
            profile=args.profile,
            modes=args.modes,
            images=not args.no_images,
            profile_frames=args.profile_frames,
        )
    if args.command == "train":
        from moe_tools import train

        return train.run(
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
            dtype=_dtype(args.dtype, args.device),
            warmup=args.warmup,
            iters=args.iters,
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            progress=progress,
            compile=not args.no_compile,
            compile_backend=args.compile_backend,
            graph=not args.no_graph,
            plot=args.plot,
        )
    if args.command == "kernels" and args.sweep == "routing":
        from moe_tools import routing_sweep

        return routing_sweep.run(
            device=args.device,
            quick=args.quick,
            T=args.sweep_T,
            E=args.sweep_E,
            k=args.sweep_k,
            dtypes=args.sweep_dtypes,
            ops=args.ops,
            jobs=args.jobs,
            seed=args.seed,
            checkpoint=checkpoint,
        )
    if args.command == "kernels":
        from moe_tools import kernels

        return kernels.run(
            device=args.device, quick=args.quick, ops=args.ops, seed=args.seed, progress=progress
        )
    if args.command == "verify":
        from moe_tools import verify

        return verify.run(
            device=args.device, shapes=args.shapes, ops=args.ops, seed=args.seed, progress=progress
        )
    if args.command == "ep":
        from moe_tools import ep

        return ep.run(
            device=args.device,
            shapes=args.shapes,
            tokens=args.tokens,
            modes=args.modes,
            world_sizes=args.world_sizes,
            capacity_factor=args.capacity_factor,
            impl=args.impl,
            dtype=_dtype(args.dtype, args.device) if args.dtype else None,
            warmup=args.warmup,
            iters=args.iters,
            seed=args.seed,
        )
    raise AssertionError(args.command)


def _args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moe-bench``; returns the exit status (1 when ``verify`` finds a failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "ep":
        from moe_tools.ep import quiet_other_ranks

        quiet_other_ranks(args)  # under torchrun only rank 0 prints
    if args.command == "kernels" and args.sweep is None:
        given = [n for n in SWEEP_ONLY if getattr(args, n)]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            parser.error(f"{flags} need(s) --sweep routing")
    if args.command == "rollout" and args.profile_frames and not args.profile:
        parser.error("--profile-frames needs --profile")
    if args.command == "rollout" and args.modes:
        from moe_tools.rollout import MODES

        unknown = [m for m in args.modes if m not in MODES]
        if unknown:
            parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
        if args.compile or args.cuda_graph is not None:
            parser.error("--modes replaces --compile / --cuda-graph / --no-cuda-graph")

    if args.command == "report":
        text = report.markdown_report(args.results, title=args.title)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}")
        return 0

    if getattr(args, "plot", None):
        report.require_matplotlib()  # fail before the measurements, not after
    env = report.environment(args.device)
    print(report.format_environment(env), flush=True)

    def write(result: report.Result) -> Any:
        doc = report.make_document(
            result.command,
            result.rows,
            env,
            columns=result.columns,
            args=_args_dict(args),
            cmdline=shlex.join(["moe-bench", *argv]),
            extra=result.extra,
        )
        return report.write_json(args.json, doc)

    result = _run(args, write if args.json else None)
    if result.text is not None:
        print(result.text)
    else:
        print(report.format_table(result.rows, result.columns))
    for line in result.extra.get("notes", []):
        print(f"# {line}")
    if args.json:
        print(f"# wrote {write(result)}")
    if getattr(args, "plot", None):
        if getattr(args, "sweep", None):
            out = report.plot_routing_sweep(result.rows, args.plot)
        elif args.command == "train":
            from moe_tools import train_report

            out = train_report.plot_loss_curves(
                result.extra.get("loss_curves", {}),
                args.plot,
                title=train_report.plot_title(result.extra),
            )
        elif args.command == "kernels":
            out = report.plot_kernels(result.rows, result.extra.get("ceiling_gbps"), args.plot)
        elif args.profile:
            out = report.plot_profile(
                result.extra.get("profile", {}), args.plot, title=result.extra.get("title", "")
            )
        else:
            out = report.plot_rollout(
                result.extra.get("frame_ms", []), args.plot, title=result.extra.get("title", "")
            )
        print(f"# wrote {out}")
    if args.command == "verify" and result.extra.get("failed", 0):
        print(f"# verify: {result.extra['failed']} check(s) FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
