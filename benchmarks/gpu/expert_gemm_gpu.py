"""The persistent grouped GEMM with fused epilogues (``moe_kernels._triton.expert_gemm``, issue
33) beside what it replaces, per GEMM of an MoE layer's training step and launch config:

* ``up+act``: ``torch._grouped_mm(xs, w_in.mT)`` (CUTLASS) then ``expert_activation`` against
  the ACT epilogue (h and act(h) from one kernel; sorted rows through TMA, or gathered from x);
* ``down``: CUTLASS ``a @ w_out[e].T`` against the STORE epilogue;
* ``dgrad+act``: CUTLASS ``dY[tok] @ w_out[e]`` then ``activation_grad_weighted`` against the
  ACT_GRAD epilogue (dh, s act(h) and the router weights' gradient from one kernel);
* ``dx``: CUTLASS ``dh @ w_in[e]`` against the STORE epilogue ("kn" weights).

Each variant is checked against the CUTLASS chain (largest difference over the largest value, on
the group rows) and timed in CUDA graphs (device time per call, ``graph_us``); TFLOP/s counts the
GEMM's 2 R N K. Configs reach the kernel through its typed override (``config=ExpertGemmConfig``).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/expert_gemm_gpu.py [--shapes=seed,qwen3,...] [--kinds=...]
        [--dry-run]

``--dry-run``: one tiny shape on the CPU (set ``TRITON_INTERPRET=1`` for the kernels).
"""

from __future__ import annotations

import argparse

import torch
from common import FAILS, check, graph_us, once_us

import moe_kernels as mk
from moe_kernels import activation as _act
from moe_kernels._triton import expert_gemm as eg
from moe_kernels._triton.expert_gemm import ExpertGemmConfig as C

SHAPES = {  # name: (tokens, d_model, hidden, experts, top_k, gated)
    "seed": (2048, 2048, 1024, 16, 8, False),
    "qwen3": (8192, 2048, 768, 128, 8, True),
    "sonic": (32768, 4096, 1024, 128, 8, True),
    "sonic_mem": (24576, 1536, 256, 128, 8, True),
    "h256": (8192, 2048, 256, 128, 8, True),
    "e16": (8192, 2048, 768, 16, 8, True),
    "k2": (8192, 2048, 768, 128, 2, True),
    "e256": (8192, 2048, 768, 256, 8, True),
    "t2048": (2048, 2048, 768, 128, 8, True),
}
TINY = (64, 32, 16, 4, 2, True)

def _both(*cfgs):
    """Each config without and with the flattened loop."""
    return [c._replace(flatten=f) for c in cfgs for f in (False, True)]


PLAIN = _both(  # STORE configs (one accumulator)
    C(128, 256, 64, 8, 3),
    C(128, 128, 64, 8, 4),
    C(64, 256, 64, 4, 4),
    C(128, 64, 64, 4, 4, programs_per_sm=2),
)
DUAL = _both(  # ACT with SwiGLU: block_n columns per accumulator (two of them)
    C(128, 128, 64, 8, 3),
    C(128, 64, 64, 8, 4),
    C(64, 64, 64, 4, 4, programs_per_sm=2),
)
GRAD = _both(  # ACT_GRAD
    C(64, 128, 64, 8, 4),
    C(128, 64, 64, 8, 4),
    C(128, 128, 64, 8, 4, epilogue_split=2),
    C(64, 64, 64, 4, 4, programs_per_sm=2),
)


def problem(shape, dev, dtype):
    T, D, H, E, k, gated = shape
    g = torch.Generator(device=dev).manual_seed(0)
    plan = mk.route(torch.randn(T, E, device=dev, generator=g).softmax(-1), k)
    x = torch.randn(T, D, device=dev, generator=g).to(dtype)
    X = 2 * H if gated else H
    w_in = (torch.randn(E, X, D, device=dev, generator=g) / D**0.5).to(dtype)
    w_out = (torch.randn(E, D, H, device=dev, generator=g) / H**0.5).to(dtype)
    R = plan.token_indices.shape[0]
    dyg = (torch.randn(R, D, device=dev, generator=g) / D**0.5).to(dtype)
    return plan, x, w_in, w_out, dyg


def rel(a, b, n):
    a, b = a[:n].float(), b[:n].float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cutlass(a, w, offs):
    return torch._grouped_mm(a, w, offs=offs)


def timed(fn, dry):
    if dry:
        return once_us(fn)
    return graph_us(fn, calls=3, replays=7)


def run_shape(name, shape, kinds, dev, dtype, dry):
    T, D, H, E, k, gated = shape
    plan, x, w_in, w_out, dyg = problem(shape, dev, dtype)
    offs, rows, s = plan.offsets, plan.token_indices, plan.weights
    o32 = offs[1:].to(torch.int32)
    n = int(offs[-1])
    R, X = rows.shape[0], w_in.shape[1]
    xs = mk.dispatch(x, plan)
    cut = dev.type == "cuda" and hasattr(torch, "_grouped_mm")
    mm = cutlass if cut else (lambda a, w, o: torch.cat([a[:1] @ w[0]] * a.shape[0]))

    def row(kind, variant, us, flops, err=None):
        tf = flops / us / 1e6 if us == us and us > 0 else float("nan")
        e = "" if err is None else f"{err:.1e}"
        print(f"{name:<10}{kind:<11}{variant:<44}{us:>10.1f}{tf:>8.0f}{e:>10}", flush=True)

    if "up" in kinds:
        flops = 2 * R * X * D
        h_ref = mm(xs, w_in.mT, o32) if cut else None
        a_ref = _act.expert_activation(h_ref, gated) if cut else None
        if cut:
            row("up+act", "cutlass gemm", timed(lambda: mm(xs, w_in.mT, o32), dry), flops)
            row("up+act", "expert_activation", timed(lambda: _act.expert_activation(h_ref, gated),
                                                     dry), flops)  # fmt: skip
            row("up+act", "cutlass + activation",
                timed(lambda: _act.expert_activation(mm(xs, w_in.mT, o32), gated), dry), flops)
        for cfg in DUAL if gated else PLAIN:
            for src, r in (("sorted", None), ("gather", rows)):
                a_in = xs if r is None else x
                try:
                    h, a = eg.expert_gemm(a_in, w_in, offs, r, layout="nk", epilogue=eg.ACT,
                                          gated=gated, config=cfg)  # fmt: skip
                    err = max(rel(h, h_ref, n), rel(a, a_ref, n)) if cut else None
                    if err is not None:
                        check(f"{name} up+act {src} {tuple(cfg)}", err < 2e-2, f"{err:.1e}")
                    us = timed(lambda a_in=a_in, r=r, cfg=cfg: eg.expert_gemm(
                        a_in, w_in, offs, r, layout="nk", epilogue=eg.ACT, gated=gated,
                        config=cfg), dry)  # fmt: skip
                    row("up+act", f"{src} {tuple(cfg)}", us, flops, err)
                except Exception as exc:  # noqa: BLE001 - a config that fails is a row
                    print(f"{name:<10}up+act     {src} {tuple(cfg)} FAILED {exc!r}"[:300])
        if not gated:
            for cfg in PLAIN[:4]:
                us = timed(lambda cfg=cfg: eg.expert_gemm(xs, w_in, offs, None, layout="nk",
                                                          config=cfg), dry)  # fmt: skip
                row("up", f"store sorted {tuple(cfg)}", us, flops)
    a_RH = torch.randn(R, H, device=dev, dtype=dtype)
    if "down" in kinds:
        flops = 2 * R * H * D
        ref = mm(a_RH, w_out.mT, o32) if cut else None
        if cut:
            row("down", "cutlass gemm", timed(lambda: mm(a_RH, w_out.mT, o32), dry), flops)
        for cfg in PLAIN:
            try:
                (c,) = eg.expert_gemm(a_RH, w_out, offs, None, layout="nk", config=cfg)
                err = rel(c, ref, n) if cut else None
                if err is not None:
                    check(f"{name} down {tuple(cfg)}", err < 2e-2, f"{err:.1e}")
                us = timed(lambda cfg=cfg: eg.expert_gemm(a_RH, w_out, offs, None, layout="nk",
                                                          config=cfg), dry)  # fmt: skip
                row("down", f"store {tuple(cfg)}", us, flops, err)
            except Exception as exc:  # noqa: BLE001
                print(f"{name:<10}down       {tuple(cfg)} FAILED {exc!r}"[:300])
    h_RX = (torch.randn(R, X, device=dev, generator=None) * 2).to(dtype)
    if "dgrad" in kinds:
        flops = 2 * R * H * D
        if cut:
            da = mm(dyg, w_out, o32)
            ref = _act.activation_grad_weighted(da, h_RX, s, rows, gated)

            def chain():
                return _act.activation_grad_weighted(mm(dyg, w_out, o32), h_RX, s, rows, gated)

            row("dgrad+act", "cutlass gemm", timed(lambda: mm(dyg, w_out, o32), dry), flops)
            row("dgrad+act", "activation_grad_weighted",
                timed(lambda: _act.activation_grad_weighted(da, h_RX, s, rows, gated), dry), flops)
            row("dgrad+act", "cutlass + grad_weighted", timed(chain, dry), flops)
        for cfg in GRAD:
            try:
                out = eg.expert_gemm(dyg, w_out, offs, None, layout="kn", epilogue=eg.ACT_GRAD,
                                     gated=gated, h_PX=h_RX, weights_P=s, tokens_P=rows,
                                     config=cfg)  # fmt: skip
                err = max(rel(o, r, n) for o, r in zip(out, ref, strict=True)) if cut else None
                if err is not None:
                    check(f"{name} dgrad+act {tuple(cfg)}", err < 3e-2, f"{err:.1e}")
                us = timed(lambda cfg=cfg: eg.expert_gemm(
                    dyg, w_out, offs, None, layout="kn", epilogue=eg.ACT_GRAD, gated=gated,
                    h_PX=h_RX, weights_P=s, tokens_P=rows, config=cfg), dry)  # fmt: skip
                row("dgrad+act", f"fused {tuple(cfg)}", us, flops, err)
            except Exception as exc:  # noqa: BLE001
                print(f"{name:<10}dgrad+act  {tuple(cfg)} FAILED {exc!r}"[:300])
        for cfg in PLAIN[:4]:
            us = timed(lambda cfg=cfg: eg.expert_gemm(dyg, w_out, offs, None, layout="kn",
                                                      config=cfg), dry)  # fmt: skip
            row("dgrad", f"store kn {tuple(cfg)}", us, flops)
    if "dx" in kinds:
        flops = 2 * R * X * D
        ref = mm(h_RX, w_in, o32) if cut else None
        if cut:
            row("dx", "cutlass gemm", timed(lambda: mm(h_RX, w_in, o32), dry), flops)
        for cfg in PLAIN:
            try:
                (c,) = eg.expert_gemm(h_RX, w_in, offs, None, layout="kn", config=cfg)
                err = rel(c, ref, n) if cut else None
                if err is not None:
                    check(f"{name} dx {tuple(cfg)}", err < 2e-2, f"{err:.1e}")
                us = timed(lambda cfg=cfg: eg.expert_gemm(h_RX, w_in, offs, None, layout="kn",
                                                          config=cfg), dry)  # fmt: skip
                row("dx", f"store kn {tuple(cfg)}", us, flops, err)
            except Exception as exc:  # noqa: BLE001
                print(f"{name:<10}dx         {tuple(cfg)} FAILED {exc!r}"[:300])
    if "wgrad" in kinds and cut:
        flops = 2 * R * X * D
        row("wgrad", "cutlass dw_in", timed(lambda: mm(h_RX.mT, xs, o32), dry), flops)
        flops = 2 * R * H * D
        row("wgrad", "cutlass dw_out", timed(lambda: mm(dyg.mT, a_RH, o32), dry), flops)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--kinds", default="up,down,dgrad,dx,wgrad")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    kinds = set(args.kinds.split(","))
    print(f"{'shape':<10}{'gemm':<11}{'variant (config)':<44}{'us':>10}{'TFLOP/s':>8}{'err':>10}")
    shapes = {"tiny": TINY} if args.dry_run else {s: SHAPES[s] for s in args.shapes.split(",")}
    for name, shape in shapes.items():
        run_shape(name, shape, kinds, dev, dtype, args.dry_run)
    print("FAILED:", FAILS) if FAILS else print("all checks passed")


if __name__ == "__main__":
    main()
