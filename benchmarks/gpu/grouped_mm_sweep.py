"""Config sweep and timing of ``gather_grouped_mm`` at the seed MoE shape (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/grouped_mm_sweep.py            # H200, < 150 s
    python3 benchmarks/gpu/grouped_mm_sweep.py --dry-run  # CPU, interpreter, tiny
    python3 benchmarks/gpu/grouped_mm_sweep.py --ptx      # CPU: compile for sm_90a
    python3 benchmarks/gpu/grouped_mm_sweep.py --tokens=512  # the world model's per-pass size

Routing: ``moe_kernels.route`` on random softmax scores, T=2048 tokens (``--tokens``), E=16
experts, top-8 (P=16384 rows). GEMM1: x (T, 2048) gathered through the plan, w1 (E, 1024, 2048),
SiLU.
GEMM2: h (P, 1024) already sorted (row_indices None), w2 (E, 2048, 1024), no activation. bf16.

Rows timed (all inside CUDA graphs: 20 calls captured, the graph replayed, median replay / 20):
  (a) today's path: ``dispatch`` + ``torch._grouped_mm`` + ``F.silu``
  (b) ``torch._grouped_mm`` alone on pre-gathered rows
  (c) ``gather_grouped_mm`` (gather + GEMM + SiLU fused), one row per launch config
  (d) GEMM2 shape: ``gather_grouped_mm`` configs vs ``torch._grouped_mm``
  (e) the experts end to end, today's path vs fused GEMM1 + our GEMM2 (best configs)
Columns: us per call, TFLOP/s (2 * routed rows * N * D / time), vs(a) = time(a) / time(row) and
vs(b) = time(b) / time(row) (above 1 = the row is faster), max |error| vs the fp32 reference.
Each config's output is checked once, in one line, before it is timed (a failing config is
reported and skipped): within one bf16 rounding of the fp32 torch reference plus accumulation
noise, |y - ref| <= 2**-7 * |ref| + 2**-7 * max|ref| / 64, tail rows zero. The public op's
correctness (poisoned outputs, no sync, repeatability): ``tests/gpu/test_grouped_mm_gpu.py``.

``--ptx`` (no GPU needed): compiles every swept config for sm_90a with the installed Triton
(integer arguments and pointers marked 16-divisible, as a launch with these shapes would
specialize them) and prints shared memory, registers, spills, the number of cp.async / TMA loads
(0 of both = the K loop is not pipelined) and the wgmma wait depths (a 1 = wgmma overlaps).
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
import torch.nn.functional as F  # noqa: E402
from common import compile_sm90  # noqa: E402
from common import graph_us as _graph_us  # noqa: E402

import moe_kernels  # noqa: E402
from moe_kernels._triton import grouped_mm as tri  # noqa: E402
from moe_kernels.grouped_mm import gather_grouped_mm  # noqa: E402
from moe_kernels.reference import grouped_mm as ref  # noqa: E402

dev = torch.device("cpu" if DRY or PTX else "cuda")
if DRY:
    T, E, K, D_MODEL, HIDDEN = 32, 4, 2, 64, 32
    CONFIGS = [tri.GemmConfig(32, 32, 32, 2, 4, 1), tri.GemmConfig(16, 32, 64, 1, 4, 1, True)]
    CONFIGS2 = CONFIGS
    CALLS, REPLAYS = 1, 1
else:
    T = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--tokens=")), 2048)
    E, K, D_MODEL, HIDDEN = 16, 8, 2048, 1024
    C = tri.GemmConfig  # (block_m, block_n, block_k, group_m, num_warps, num_stages, tma)
    CONFIGS = [
        C(128, 128, 64, 8, 8, 3),
        C(128, 128, 64, 8, 8, 4),
        C(128, 128, 64, 8, 4, 4),
        C(128, 128, 64, 1, 8, 4),
        C(128, 128, 64, 16, 8, 4),
        C(128, 256, 64, 8, 8, 3),
        C(128, 256, 64, 8, 8, 4),
        C(128, 128, 128, 8, 8, 3),
        C(128, 64, 64, 8, 4, 4),
        C(64, 128, 64, 8, 4, 4),
        C(64, 256, 64, 8, 8, 4),
        C(256, 128, 64, 8, 8, 3),
        C(128, 128, 64, 8, 8, 3, True),
        C(128, 128, 64, 8, 8, 4, True),
        C(128, 256, 64, 8, 8, 3, True),
        C(64, 256, 64, 8, 8, 4, True),
        C(64, 256, 64, 8, 8, 3, True),
        C(64, 128, 64, 8, 4, 4, True),
        C(64, 128, 128, 8, 4, 3, True),
        C(128, 128, 64, 4, 8, 4, True),
        C(128, 256, 64, 8, 8, 4, True),
    ]
    CONFIGS2 = [CONFIGS[i] for i in (0, 1, 5, 6, 7, 11, 12, 13, 14)]
    CALLS, REPLAYS = 20, 7


def graph_us(fn) -> float:
    """Median over REPLAYS of (a graph of CALLS calls of fn) / CALLS, in microseconds."""
    return _graph_us(fn, CALLS, REPLAYS, DRY)


def max_err(y: torch.Tensor, expected: torch.Tensor, n_valid: int) -> tuple[float, bool]:
    """(max |y - ref|, within the bf16 tolerance and zero tail)."""
    yf, ef = y.float(), expected.float()
    err = (yf - ef).abs()
    tol = 2.0**-7 * ef.abs() + 2.0**-7 * float(ef.abs().max()) / 64
    ok = bool(torch.isfinite(yf).all()) and bool((err <= tol).all())
    ok = ok and bool((y[n_valid:] == 0).all())
    return float(err.max()) if err.numel() else 0.0, ok


def grouped_mm_torch(a_PD: torch.Tensor, w_END: torch.Tensor, offsets: torch.Tensor):
    return torch._grouped_mm(a_PD, w_END.transpose(-2, -1), offs=offsets[1:])


ROWS: list[tuple] = []  # (section, name, us, tflops, vs_a, vs_b, err)
FAILED: list[str] = []  # configs that failed their check or did not run


def row(section, name, us, flops, base_a, base_b, err="") -> None:
    tflops = flops / us / 1e6 if us > 0 else float("nan")
    vs_a = f"{base_a / us:.2f}x" if base_a else ""
    vs_b = f"{base_b / us:.2f}x" if base_b else ""
    ROWS.append((section, name, us, tflops, vs_a, vs_b, err))
    print(
        f"{section:3} {name:34} {us:9.1f} us {tflops:7.1f} TF/s  vs(a) {vs_a:>6}  "
        f"vs(b) {vs_b:>6}  err {err}",
        flush=True,
    )


def cfg_name(c: tri.GemmConfig) -> str:
    name = f"BM{c.block_m} BN{c.block_n} BK{c.block_k} G{c.group_m} w{c.num_warps} s{c.num_stages}"
    return name + (" tma" if c.tma else "")


def sweep(
    section: str,
    configs,
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None,
    act: int,
    expected: torch.Tensor,
    n_valid: int,
    flops: float,
    base_a: float,
    base_b: float,
) -> tuple[tri.GemmConfig | None, float]:
    best, best_us = None, float("inf")
    for cfg in configs:
        name = cfg_name(cfg)
        try:
            err, ok = max_err(tri.gather_grouped_mm(x, w, offsets, rows, act, config=cfg),
                              expected, n_valid)  # fmt: skip
            if not ok:
                print(f"{section:3} {name:34} FAIL (max err {err:.3g})")
                FAILED.append(f"{section} {name}")
                continue
            us = graph_us(lambda cfg=cfg: tri.gather_grouped_mm(x, w, offsets, rows, act, cfg))
            row(section, name, us, flops, base_a, base_b, f"{err:.3g}")
            if us < best_us:
                best, best_us = cfg, us
        except Exception as exc:  # a config that does not compile / run: report and go on
            print(f"{section:3} {name:34} ERROR {type(exc).__name__}: {str(exc)[:160]}")
            FAILED.append(f"{section} {name}")
            if DRY:
                traceback.print_exc()
    return best, best_us


def ptx_check() -> int:
    """Compile each config for sm_90a on this machine and report what ptxas says."""
    import re

    kern = tri._gather_grouped_mm_kernel
    divisible = ["x_ptr", "w_ptr", "offs_ptr", "ridx_ptr", "y_ptr", "T", "P", "N", "D", "E"]
    divisible += ["stride_xt", "stride_we", "stride_wn"]
    shapes = [("gemm1", True, tri.ACT_SILU, CONFIGS), ("gemm2", False, tri.ACT_NONE, CONFIGS2)]
    for label, has_ridx, act, configs in shapes:
        for cfg in configs:
            a_tma, b_tma = cfg.tma and not has_ridx, cfg.tma
            sig = {n: "i32" for n in ("T", "P", "N", "D", "E", "stride_xt", "stride_we")}
            sig.update(stride_wn="i32", x_ptr="*bf16", w_ptr="*bf16", offs_ptr="*i32")
            sig.update(ridx_ptr="*i32", y_ptr="*bf16")
            sig["a_desc"] = f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>"
            sig["b_desc"] = f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>"
            consts = dict(stride_xd=1, stride_wd=1, HAS_RIDX=has_ridx, ACTIVATION=act)
            consts.update(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)
            consts.update(BLOCK_E=32, EVEN_K=True, A_TMA=a_tma, B_TMA=b_tma)
            consts.update(UPCAST=False, IEEE=False, WHILE_LOOPS=False)
            if not a_tma:
                consts["a_desc"] = None
            if not b_tma:
                consts["b_desc"] = None
            for name in consts:
                sig[name] = "constexpr"
            try:
                compiled, ptx, regs, spills = compile_sm90(
                    kern, sig, consts, divisible, cfg.num_warps, cfg.num_stages
                )
                waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx)))
                print(
                    f"{label} {cfg_name(cfg):34} smem {compiled.metadata.shared:6d}  "
                    f"regs {regs:>3}  spill {spills}  "
                    f"cp.async {len(re.findall(r'cp.async.c[ag]', ptx)):3d}  "
                    f"tma {len(re.findall(r'cp.async.bulk.tensor', ptx)):2d}  "
                    f"wgmma waits {','.join(waits)}",
                    flush=True,
                )
            except Exception as exc:
                print(f"{label} {cfg_name(cfg):34} ERROR {type(exc).__name__}: {str(exc)[:200]}")
                FAILED.append(f"{label} {cfg_name(cfg)}")
    return 1 if FAILED else 0


def main() -> int:
    t_start = time.perf_counter()
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if not DRY else 'cpu (interpreter)'}")
    print(f"torch {torch.__version__}, T={T} E={E} k={K} d_model={D_MODEL} hidden={HIDDEN} bf16")
    scores = torch.randn(T, E, device=dev, generator=gen).softmax(-1)
    plan = moe_kernels.route(scores, K)
    num_rows = plan.token_indices.shape[0]
    n_valid = num_rows  # every pair is routed (all experts local)
    x = (torch.randn(T, D_MODEL, device=dev, generator=gen) * 0.5).bfloat16()
    w1 = (torch.randn(E, HIDDEN, D_MODEL, device=dev, generator=gen) / D_MODEL**0.5).bfloat16()
    w2 = (torch.randn(E, D_MODEL, HIDDEN, device=dev, generator=gen) / HIDDEN**0.5).bfloat16()
    offsets = plan.offsets
    print(f"counts per expert: {plan.counts.tolist()}")

    # references (fp32 torch loop over groups)
    ref1 = ref.gather_grouped_mm(x, w1, offsets, plan.token_indices, "silu")
    xs = moe_kernels.dispatch(x, plan)
    h = ref1  # GEMM2's input: the (sorted) activations
    ref2 = ref.gather_grouped_mm(h, w2, offsets, None, None)
    flops1 = 2.0 * n_valid * HIDDEN * D_MODEL
    flops2 = 2.0 * n_valid * D_MODEL * HIDDEN

    # (a) / (b) and a clone of the gathered bytes
    have_gmm = hasattr(torch, "_grouped_mm")
    us_a = us_b = us_b2 = 0.0
    try:
        y_a = F.silu(grouped_mm_torch(moe_kernels.dispatch(x, plan), w1, offsets))
        err_a, _ = max_err(y_a, ref1, n_valid)

        def path_a():
            return F.silu(grouped_mm_torch(moe_kernels.dispatch(x, plan), w1, offsets))

        us_a = graph_us(path_a)
        row("a", "dispatch+_grouped_mm+silu", us_a, flops1, us_a, 0, f"{err_a:.3g}")
        us_b = graph_us(lambda: grouped_mm_torch(xs, w1, offsets))
        row("b", "_grouped_mm (pre-gathered)", us_b, flops1, us_a, us_b)
    except Exception as exc:
        have_gmm = False
        print(f"(a)/(b) torch._grouped_mm unavailable here: {type(exc).__name__}: {exc}"[:200])
    us_clone = graph_us(lambda: xs.clone())
    row("-", "clone of the gathered A (P x D)", us_clone, 0.0, 0, 0)

    # (c) fused gather + GEMM1 + silu
    best1, best1_us = sweep(
        "c",
        CONFIGS,
        x,
        w1,
        offsets,
        plan.token_indices,
        tri.ACT_SILU,
        ref1,
        n_valid,
        flops1,
        us_a,
        us_b,
    )
    # default launcher choice through the public op (eager direct path)
    try:
        y_pub = gather_grouped_mm(x, w1, offsets, plan.token_indices, activation="silu")
        err, ok = max_err(y_pub, ref1, n_valid)
        us = graph_us(
            lambda: gather_grouped_mm(x, w1, offsets, plan.token_indices, activation="silu")
        )
        status = f"{err:.3g}" + ("" if ok else " FAIL")
        row("c", "public op, launcher default", us, flops1, us_a, us_b, status)
        if not ok:
            FAILED.append("c public op")
    except Exception as exc:
        print(f"c   public op ERROR {type(exc).__name__}: {str(exc)[:160]}")
        FAILED.append("c public op")

    # (d) GEMM2 shape: sorted rows, no activation
    if have_gmm:
        err_b2, _ = max_err(grouped_mm_torch(h, w2, offsets), ref2, n_valid)
        us_b2 = graph_us(lambda: grouped_mm_torch(h, w2, offsets))
        row("d", "_grouped_mm GEMM2", us_b2, flops2, 0, us_b2, f"{err_b2:.3g}")
    best2, best2_us = sweep(
        "d", CONFIGS2, h, w2, offsets, None, tri.ACT_NONE, ref2, n_valid, flops2, 0, us_b2
    )

    # (e) the experts end to end
    if have_gmm and best1 is not None and best2 is not None:

        def today():
            a = F.silu(grouped_mm_torch(moe_kernels.dispatch(x, plan), w1, offsets))
            return grouped_mm_torch(a, w2, offsets)

        def fused():
            a = tri.gather_grouped_mm(x, w1, offsets, plan.token_indices, tri.ACT_SILU, best1)
            return tri.gather_grouped_mm(a, w2, offsets, None, tri.ACT_NONE, best2)

        us_today = graph_us(today)
        us_fused = graph_us(fused)
        row("e", "today: dispatch+mm+silu+mm", us_today, flops1 + flops2, us_today, 0)
        row("e", "fused gather mm+silu, our mm", us_fused, flops1 + flops2, us_today, 0)

    print()
    if best1 is not None:
        ratios = f"  vs (a) {us_a / best1_us:.2f}x, vs (b) {us_b / best1_us:.2f}x" if us_a else ""
        print(f"best GEMM1 (gather+silu): {cfg_name(best1)}  {best1_us:.1f} us{ratios}")
    if best2 is not None:
        ratio = f"  vs _grouped_mm {us_b2 / best2_us:.2f}x" if us_b2 else ""
        print(f"best GEMM2 (sorted):      {cfg_name(best2)}  {best2_us:.1f} us{ratio}")
    print(f"failed configs: {FAILED or 'none'}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 1 if FAILED and (best1 is None or best2 is None) else 0


if __name__ == "__main__":
    sys.exit(ptx_check() if PTX else main())
