"""Training on the GPU (issue 22): each op's backward against the CPU reference's autograd, and
the MoE layer's forward + backward per impl (eager, compiled) beside its six grouped GEMMs alone,
with bitwise repeatability (the weight-gradient GEMM: ``grouped_weight_grad_gpu.py``).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \\
        python3 benchmarks/gpu/train_gpu.py [--shapes=seed,train] [--profile] [--dry-run]
        python3 benchmarks/gpu/train_gpu.py --skip=ops --impls=torch,triton_bf16 \
            --no-compile --profile     # eager rows, each profiled by host (self CPU) time

``--dry-run``: tiny shapes on the CPU (run it under ``TRITON_INTERPRET=1`` for the kernels).
Shapes: seed = 2048 tokens, E=16, top-8, d_model 2048, hidden 1024; train = 16384 tokens,
E=128, top-8, d_model 2048, hidden 768 (both bf16, SiLU experts; ``gated`` rows add SwiGLU).
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import FAILS, bench_us, capture, check, same_bits

import moe_kernels as mk
from moe_model import MoELayer

SHAPES = {  # name: (tokens, experts, top_k, d_model, hidden)
    "seed": (2048, 16, 8, 2048, 1024),
    "qwen3": (8192, 128, 8, 2048, 768),
    "train": (16384, 128, 8, 2048, 768),
}
TINY = {"seed": (64, 8, 2, 64, 32), "train": (96, 8, 2, 64, 48), "qwen3": (64, 40, 4, 64, 32)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp64."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------ ops


def op_checks(dev: str) -> None:
    """Each op's backward on ``dev`` against autograd of the same call on CPU (the reference)."""
    print("\n## each op's backward on the device vs the CPU reference's autograd")
    g = torch.Generator().manual_seed(0)
    T, E, k, D, H = 300, 16, 4, 96, 64

    def grads(fn, *inputs, on):
        ins = [t.detach().to(on).clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*ins)
        out.backward(torch.cos(torch.arange(out.numel(), device=on).view_as(out).float()).to(out))
        return [t.grad for t in ins if t.is_floating_point()]

    def compare(name, fn, *inputs, tol=1e-5):
        dev_g = grads(fn, *inputs, on=dev)
        ref_g = grads(fn, *inputs, on="cpu")
        again = grads(fn, *inputs, on=dev)
        err = max(rel_err(a, b) for a, b in zip(dev_g, ref_g, strict=True))
        rep = all(same_bits(a, b) for a, b in zip(dev_g, again, strict=True))
        check(f"{name}: grads vs CPU reference, repeatable", err <= tol and rep, f"err {err:.1e}")

    scores = torch.rand(T, E, generator=g)
    x = torch.randn(T, D, generator=g)
    for renorm in (False, True):
        compare(
            f"route renormalize={renorm}",
            lambda s, r=renorm: mk.route(s, k, renormalize=r).weights * 1.0,
            scores,
        )  # noqa: E501

    def disp(x, s):
        return mk.dispatch(x, mk.route(s, k, expert_index_start=2, expert_index_end=14), scale=True)

    compare("dispatch (scaled)", disp, x, scores)
    y = torch.randn(T * k, D, generator=g)

    def comb(y, s):
        return mk.combine(y, mk.route(s, k, renormalize=True), out_dtype=torch.float32)

    compare("combine (weighted)", comb, y, scores)
    _, e_idx, t_idx = mk.index_shuffling(scores, top_k=k)

    def gs(x, s):
        return mk.gather_scale_dense_tokens(x, t_idx.to(x.device), e_idx.to(x.device), s)

    compare("gather_scale_dense_tokens", gs, x, scores)

    def sa(o, yy):
        o = o * 1.0
        mk.scatter_add_dense_tokens(o, yy, t_idx.to(o.device))
        return o

    compare("scatter_add_dense_tokens", sa, x, y)
    for gated in (False, True):
        h = torch.randn(T, 2 * H if gated else H, generator=g)
        compare(
            f"expert_activation gated={gated}", lambda h, gt=gated: mk.expert_activation(h, gt), h
        )  # noqa: E501
    plan = mk.route(scores, k)
    w = torch.randn(E, H, D, generator=g) / D**0.5
    for act in (None, "silu"):

        def ggmm(x, w, a=act):
            p = plan._replace(offsets=plan.offsets.to(x.device))
            return mk.gather_grouped_mm(
                x, w, p.offsets, plan.token_indices.to(x.device), activation=a
            )  # noqa: E501

        compare(f"gather_grouped_mm activation={act} (fp32)", ggmm, x, w, tol=1e-4)
    xs = mk.dispatch(x, plan).bfloat16()  # sorted rows: CUTLASS forward on sm90 bf16

    def gmm(a, w):
        return mk.gather_grouped_mm(a, w, plan.offsets.to(a.device))

    compare("gather_grouped_mm sorted rows (bf16)", gmm, xs, w.bfloat16(), tol=2e-2)


# ------------------------------------------------------------------------------------ layer


def six_gemms(xs, w1, w2, offs, dy):
    """The layer's six grouped GEMMs alone (``torch._grouped_mm``): two forward, four backward
    (the activation's input and output stand in as fixed tensors: no pointwise work timed)."""
    o = offs[1:]
    a = torch.randn(xs.shape[0], w2.shape[2], device=xs.device, dtype=xs.dtype)
    dh = torch.randn(xs.shape[0], w1.shape[1], device=xs.device, dtype=xs.dtype)

    def run():
        torch._grouped_mm(xs, w1.mT, offs=o)  # h
        y = torch._grouped_mm(a, w2.mT, offs=o)
        da = torch._grouped_mm(dy, w2, offs=o)
        dw2 = torch._grouped_mm(dy.mT, a, offs=o)
        dx = torch._grouped_mm(dh, w1, offs=o)
        dw1 = torch._grouped_mm(dh.mT, xs, offs=o)
        return y, da, dx, dw1, dw2

    return run


def layer_rows(
    dev: str,
    shapes: list[str],
    dry: bool,
    profile: bool,
    impls: list[str],
    compiled: bool,
    py_profile: bool = False,
    profile_sort: str = "self_cpu_time_total",
) -> None:
    print("\n## MoE layer forward + backward (bf16 params and activations, fp32 router)")
    print(f"{'shape':<14}{'impl':<13}{'eager ms':>10}{'compiled ms':>13}{'graph ms':>10}"
          f"{'repeat':>8}{'cmp==eager':>11}{'dx err':>9}{'dw1 err':>9}")  # fmt: skip
    dt = torch.float32 if dry else torch.bfloat16
    for name in shapes:
        for gated in (False, True):
            T, E, k, D, H = (TINY if dry else SHAPES)[name]
            torch.manual_seed(0)
            base = MoELayer(D, E, k, H, gated=gated, impl="torch").to(dev)
            base.in_proj.data = base.in_proj.data.to(dt)
            base.out_proj.data = base.out_proj.data.to(dt)
            x = torch.randn(T, D, device=dev, dtype=dt)
            dy = torch.randn(T, D, device=dev, dtype=dt) / D**0.5
            ref = None
            tag = f"{name}{'-gated' if gated else ''}"
            for impl in impls:
                if impl == "baseline" and not dry and name == "train":
                    continue  # the host-syncing loop: seed shape only
                layer = copy.deepcopy(base)
                layer.impl = impl

                def step(m=layer):
                    m.zero_grad(set_to_none=True)
                    xx = x.detach().requires_grad_()
                    m(xx).backward(dy)
                    return [xx.grad, m.router.weight.grad, m.in_proj.grad, m.out_proj.grad]

                first, second = step(), step()
                rep = all(same_bits(a, b) for a, b in zip(first, second, strict=True))
                if impl == "baseline":
                    ref = [t.float() for t in first]
                err = (rel_err(first[0], ref[0]), rel_err(first[2], ref[2])) if ref else (0, 0)
                eager = bench_us(step, dry=dry) / 1e3
                if profile and impl in ("torch", "triton_bf16") and not dry:
                    profile_step(step, f"{tag} {impl} eager", profile_sort)
                if py_profile and impl == "triton_bf16":
                    py_profile_step(step, f"{tag} {impl} eager")
                comp_ms, graph_ms, same = float("nan"), float("nan"), "-"
                if impl != "baseline" and compiled:
                    torch._dynamo.reset()  # one compiled layer at a time: no recompile limit
                    cl = copy.deepcopy(base)
                    cl.impl = impl
                    cm = torch.compile(cl, fullgraph=True)

                    def cstep(m=cl, f=cm):
                        m.zero_grad(set_to_none=True)
                        xx = x.detach().requires_grad_()
                        f(xx).backward(dy)
                        return [xx.grad, m.router.weight.grad, m.in_proj.grad, m.out_proj.grad]

                    c = cstep()
                    same = (
                        "yes"
                        if all(same_bits(a, b) for a, b in zip(first, c, strict=True))
                        else "no"
                    )  # noqa: E501
                    comp_ms = bench_us(cstep, dry=dry) / 1e3
                    if dev == "cuda" and impl in ("torch", "triton_bf16"):
                        try:
                            graph, _ = capture(cstep, warmup=2)
                            graph_ms = bench_us(graph.replay) / 1e3
                        except Exception as exc:  # noqa: BLE001
                            check(
                                f"{tag} {impl} compiled step in a CUDA graph", False, str(exc)[:160]
                            )
                    if profile and impl == "triton_bf16" and not dry:
                        profile_step(cstep, f"{tag} {impl} compiled")
                print(f"{tag:<14}{impl:<13}{eager:>10.3f}{comp_ms:>13.3f}{graph_ms:>10.3f}"
                      f"{'yes' if rep else 'no':>8}{same:>11}{err[0]:>9.1e}"
                      f"{err[1]:>9.1e}")  # fmt: skip
                if impl != "torch":
                    check(f"{tag} {impl} repeatable", rep)
            if dev == "cuda" and not dry:
                plan = mk.route(base.scores(x), k)
                xs = mk.dispatch(x, plan)
                gemms = six_gemms(
                    xs, base.in_proj, base.out_proj, plan.offsets, mk.dispatch(dy, plan)
                )  # noqa: E501
                print(f"{tag:<14}{'6 GEMMs':<13}{bench_us(gemms) / 1e3:>10.3f}")


def profile_step(fn, title: str, sort_by: str = "self_cuda_time_total") -> None:
    """The ops of a few steps of ``fn`` by ``sort_by`` (torch.profiler): kernels by CUDA time,
    or the host's share of an eager step by ``self_cpu_time_total``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as prof:  # noqa: E501
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"\n### profile: {title} (5 steps), by {sort_by}, with input shapes")
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort_by, row_limit=30, max_name_column_width=60,
        max_shapes_column_width=70,
    )  # fmt: skip
    print(table)


def py_profile_step(fn, title: str, steps: int = 20) -> None:
    """The Python functions of ``steps`` eager steps of ``fn`` by their own time (cProfile):
    where an eager step's host time goes below the op level."""
    import cProfile
    import pstats

    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    print(f"\n### Python profile: {title} ({steps} steps), by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"\n### Python profile: {title} ({steps} steps), by cumulative time")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="seed,train")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--py-profile", action="store_true", help="cProfile of triton_bf16 eager")
    ap.add_argument(
        "--profile-sort",
        default="self_cpu_time_total",
        help="the eager profile's order (self_cuda_time_total: kernels)",
    )
    ap.add_argument("--impls", default="baseline,torch,triton_bf16,mxfp8")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument("--skip", default="", help="comma list of: ops, layer")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    skip = set(filter(None, args.skip.split(",")))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}")
    if "ops" not in skip and dev == "cuda":
        op_checks(dev)
    if "layer" not in skip:
        impls = args.impls.split(",")
        layer_rows(dev, args.shapes.split(","), args.dry_run, args.profile, impls,
                   not args.no_compile, args.py_profile, args.profile_sort)  # fmt: skip
    print(f"\n{len(FAILS)} failed checks" + (": " + "; ".join(FAILS) if FAILS else ""))


if __name__ == "__main__":
    main()
