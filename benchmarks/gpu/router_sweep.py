"""Config sweep and timing of the fused router ``router_scores`` (one H200 run, < 90 s).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/router_sweep.py            # H200
    python3 benchmarks/gpu/router_sweep.py --dry-run  # CPU, interpreter, tiny shapes
    python3 benchmarks/gpu/router_sweep.py --ptx      # CPU: compile for sm_90a

Shapes: T in {512, 2048, 16384} tokens, D = 2048, E in {16, 128}; x bf16 ~ N(0, 1), router
weight fp32 ~ N(0, 1/D) (the model's init), softmax scores.

Rows per shape (all timed inside CUDA graphs: 20 calls captured, the graph replayed, median
replay / 20, so host launch cost is not counted):
  clone       ``x.clone()``: the same bytes read (and written once more): the memory yardstick
  eager       the torch formula ``softmax(F.linear(x.float(), w.float()), -1)``, TF32 off
  compiled    the same formula under ``torch.compile`` (inductor, default mode)
  public      ``moe_kernels.router_scores`` with the launcher's default config
  BT.. BD..   our kernel with each swept config (``RouterConfig``)
Each config's first call is checked in one line before it is timed (a config that fails or
does not compile is reported and skipped): within rtol 1e-4 / atol 1e-6 of the fp32 reference,
the max |diff| printed. The public op against a float64 bound, its top-k, repeatability and
host-sync freedom: ``tests/gpu/test_router_gpu.py``.

``--ptx`` (no GPU needed): compiles every swept config (and the launcher's defaults) for sm_90a
with the installed Triton and prints shared memory, registers and spills from ptxas.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
PTX = "--ptx" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from common import compile_sm90, torch_router_scores  # noqa: E402
from common import graph_us as _graph_us  # noqa: E402

from moe_kernels._triton import router as tri  # noqa: E402
from moe_kernels.reference import router as ref  # noqa: E402
from moe_kernels.router import router_scores  # noqa: E402

dev = torch.device("cpu" if DRY or PTX else "cuda")
C = tri.RouterConfig  # (block_t, block_d, num_warps, num_stages, dot)
if DRY:
    SHAPES = [(5, 16, 64), (33, 40, 100)]  # (T, E, D)
    CONFIGS = {
        16: [
            C(16, 32, 4, 1),
            C(32, 64, 4, 1, False),
            C(4, 32, 4, 1, False, True),
            C(4, 16, 4, 1, False, True, True),
        ],
        128: [C(16, 128, 4, 1)],
    }
    CALLS, REPLAYS = 1, 1
else:
    SHAPES = [(t, e, 2048) for e in (16, 128) for t in (512, 2048, 16384)]
    A3 = {"acc3": True, "dot": False}  # per-lane partial sums over D (FMAs only in the loop)
    P3 = {**A3, "prefetch": True}  # and chunk i+1's loads issued before chunk i's FMAs
    CONFIGS = {
        16: [
            C(4, 128, 4, 3, **A3),
            C(8, 128, 4, 3, **A3),
            C(16, 64, 4, 3, **A3),
            C(4, 128, 4, 3, **P3),
            C(8, 128, 4, 3, **P3),
            C(16, 64, 4, 3, **P3),
            C(8, 64, 4, 3, **P3),
            C(16, 32, 4, 3, **P3),
            C(32, 32, 4, 3, **P3),
            C(8, 128, 8, 3, **P3),
        ],
        128: [
            C(4, 64, 8, 3, **A3),
            C(8, 16, 4, 3, **A3),
            C(4, 64, 8, 3, **P3),
            C(8, 16, 4, 3, **P3),
            C(4, 32, 4, 3, **P3),
            C(8, 32, 8, 3, **P3),
        ],
    }
    CALLS, REPLAYS = 20, 7


def graph_us(fn) -> float:
    """Median over REPLAYS of (a graph of CALLS calls of fn) / CALLS, in microseconds."""
    return _graph_us(fn, CALLS, REPLAYS, DRY)


FAILS: list[str] = []  # configs that failed their check or did not run


def check(y: torch.Tensor, expected: torch.Tensor) -> tuple[str, bool]:
    """(a short note, ok): y within rtol 1e-4 / atol 1e-6 of the fp32 reference."""
    diff = (y - expected).abs()
    ok = bool(torch.isfinite(y).all()) and bool((diff <= 1e-4 * expected.abs() + 1e-6).all())
    return (f"vs ref {float(diff.max()):.2g}" if diff.numel() else "empty"), ok


ROWS: list[tuple] = []


def row(shape: str, name: str, us: float, x_bytes: int, clone_us: float, torch_us: float, note=""):
    tbs = x_bytes / us / 1e6 if us > 0 else float("nan")
    vs_clone = f"{clone_us / us:.2f}x" if clone_us else ""
    vs_torch = f"{torch_us / us:.2f}x" if torch_us else ""
    ROWS.append((shape, name, us))
    print(
        f"{shape:18} {name:24} {us:8.2f} us  x {tbs:5.2f} TB/s  clone/ours {vs_clone:>6}  "
        f"compiled/ours {vs_torch:>6}  {note}",
        flush=True,
    )


def cfg_name(c: tri.RouterConfig) -> str:
    return (
        f"BT{c.block_t} BD{c.block_d} w{c.num_warps} s{c.num_stages}"
        + (" acc3" if c.acc3 else "" if c.dot else " sum")
        + (" pf" if c.prefetch else "")
    )


def run_shape(num_tokens: int, num_experts: int, dim: int, gen: torch.Generator) -> None:
    label = f"T{num_tokens} E{num_experts}"
    x = torch.randn(num_tokens, dim, device=dev, generator=gen).bfloat16()
    w = torch.randn(num_experts, dim, device=dev, generator=gen) / dim**0.5
    expected = ref.router_scores(x, w, "softmax")
    x_bytes = x.numel() * x.element_size()

    clone_us = graph_us(lambda: x.clone())
    eager_us = graph_us(lambda: torch_router_scores(x, w))
    row(label, "clone of x", clone_us, x_bytes, 0, 0)
    compiled_us = 0.0
    try:
        compiled = torch.compile(torch_router_scores, backend="eager" if DRY else "inductor")
        note, _ = check(compiled(x, w), expected)
        compiled_us = graph_us(lambda: compiled(x, w))
        row(label, "torch eager", eager_us, x_bytes, clone_us, 0)
        row(label, "torch.compile", compiled_us, x_bytes, clone_us, compiled_us, note)
    except Exception as exc:
        row(label, "torch eager", eager_us, x_bytes, clone_us, 0)
        print(f"{label:18} torch.compile ERROR {type(exc).__name__}: {str(exc)[:160]}")

    # The public op, launcher default.
    try:
        note, ok = check(router_scores(x, w), expected)
        auto = tri.pick_config(num_tokens, dim, num_experts)
        us = graph_us(lambda: router_scores(x, w))
        row(
            label,
            "public (default)",
            us,
            x_bytes,
            clone_us,
            compiled_us,
            f"[{cfg_name(auto)}] {note}",
        )
        if not ok:
            print(f"{label:18} public op FAIL")
            FAILS.append(f"{label} public")
    except Exception as exc:
        print(f"{label:18} public op ERROR {type(exc).__name__}: {str(exc)[:160]}")
        FAILS.append(f"{label} public")
        if DRY:
            traceback.print_exc()

    best, best_us = None, float("inf")
    for cfg in CONFIGS[16 if num_experts <= 32 else 128]:
        name = cfg_name(cfg)
        try:
            note, ok = check(tri.router_scores(x, w, False, cfg), expected)
            if not ok:
                print(f"{label:18} {name:24} FAIL {note}")
                FAILS.append(f"{label} {name}")
                continue
            us = graph_us(lambda cfg=cfg: tri.router_scores(x, w, False, cfg))
            row(label, name, us, x_bytes, clone_us, compiled_us, note)
            if us < best_us:
                best, best_us = cfg, us
        except Exception as exc:  # a config that does not compile / run: report and go on
            print(f"{label:18} {name:24} ERROR {type(exc).__name__}: {str(exc)[:160]}")
            FAILS.append(f"{label} {name}")
            if DRY:
                traceback.print_exc()
    if best is not None:
        ratio = f", {compiled_us / best_us:.2f}x vs compiled" if compiled_us else ""
        BEST.append(
            f"{label}: {cfg_name(best)} {best_us:.2f} us ({clone_us / best_us:.2f}x clone{ratio})"
        )
    print(flush=True)


BEST: list[str] = []


def main() -> int:
    t_start = time.perf_counter()
    if not DRY:
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is a true fp32 GEMM
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if not DRY else 'cpu (interpreter)'}")
    print(f"torch {torch.__version__}, bf16 x, fp32 w, softmax; graph of {CALLS} calls")
    for num_tokens, num_experts, dim in SHAPES:
        run_shape(num_tokens, num_experts, dim, gen)
    print("best config per shape:")
    for line in BEST:
        print("  " + line)
    print(f"failed: {FAILS or 'none'}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 1 if FAILS else 0


def ptx_check() -> int:
    """Compile each config for sm_90a on this machine and report what ptxas says."""
    import re

    kern = tri._router_kernel
    ints = ["T", "D", "E", "stride_xt", "stride_we"]
    for num_experts in (16, 128, 1000):
        configs = list(CONFIGS.get(num_experts, []))
        for num_tokens in (512, 2048, 16384):
            auto = tri.pick_config(num_tokens, 2048, num_experts)
            if auto not in configs:
                configs.append(auto)
        for cfg in configs:
            sig = dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", **dict.fromkeys(ints, "i32"))
            consts = dict(stride_xd=1, stride_wd=1, SIGMOID=False, BLOCK_T=cfg.block_t)
            consts.update(BLOCK_E=tri.block_e(num_experts), BLOCK_D=cfg.block_d, EVEN_D=True)
            consts.update(USE_DOT=cfg.dot, ACC3=cfg.acc3, PREFETCH=cfg.prefetch, WHILE_LOOPS=False)
            sig.update(dict.fromkeys(consts, "constexpr"))
            name = f"E{num_experts} {cfg_name(cfg)}"
            try:
                compiled, ptx, regs, spills = compile_sm90(
                    kern, sig, consts, ["x_ptr", "w_ptr", "out_ptr", *ints], cfg.num_warps,
                    cfg.num_stages,
                )  # fmt: skip
                print(
                    f"{name:32} smem {compiled.metadata.shared:6d}  "
                    f"regs {regs:>3}  spill {spills}  "
                    f"cp.async {len(re.findall(r'cp.async.c[ag]', ptx)):3d}",
                    flush=True,
                )
            except Exception as exc:
                print(f"{name:32} ERROR {type(exc).__name__}: {str(exc)[:200]}")
                FAILS.append(name)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(ptx_check() if PTX else main())
