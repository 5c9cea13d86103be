"""Launch-config sweep of the column-wise MXFP8 cast (``to_mxfp8_dim1``) on one GPU.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/mxfp8_dim1_sweep.py [--dry-run]

For (16384, 8192) and (131072, 2048) bf16 and (8192, 4096) fp32: every kernel variant / launch
config in ``CONFIGS`` is timed with ``triton.testing.do_bench`` (median) beside a clone of the same
byte count (x read + data and scales written: the copy ceiling), the row-wise ``to_mxfp8`` of the
same x and the torch reference, after a one-line check that its output equals the row-wise cast
of ``x.t()`` (rceil; random data with NaN / inf / zero blocks). A failing config is reported and
the sweep goes on; past a soft budget (``MXFP8_SWEEP_BUDGET_S``, 108 s: ~1 s of compile per
config and dtype) the remaining configs are skipped and said so. One table, then the best exact
config per shape. The public casts' correctness (floor mode, special values, no sync, graph
replay): ``tests/gpu/test_mxfp8_gpu.py``.

``--dry-run`` runs it all on CPU under TRITON_INTERPRET=1 on tiny shapes (exactness only; the
times are one interpreted call each, meaningless).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv[1:]
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from common import bench_us, clone_of  # noqa: E402

from moe_kernels import mxfp8 as mx  # noqa: E402
from moe_kernels._triton import mxfp8_quant as tq  # noqa: E402
from moe_kernels.reference import mxfp8 as ref  # noqa: E402
from moe_kernels.testing import bits_equal as same  # noqa: E402

T0 = time.perf_counter()
dev = torch.device("cpu" if DRY else "cuda")


def regs(rpt: int, kv: int, bm: int, bk: int, k_fast: bool = True, asm: bool = False) -> dict:
    return {"RPT": rpt, "KV": kv, "BLOCK_M": bm, "BLOCK_K": bk, "K_FAST": k_fast, "ASM_PACK": asm}


# (name, config): "regs" = rows in registers, packed int32 stores (threads = cells of RPT rows x
# KV columns, num_warps derived); "tload" = the previous kernel (tile loaded transposed); "sat" =
# no clamp before the saturating cast; "asm" = 4 values -> 1 word by inline PTX (implies sat).
CONFIGS: list[tuple[str, dict | None]] = [
    ("tload 32x128 w8 (old default)", {"variant": "tload"}),
    ("default", None),
    ("regs r16 kv2 128x32 mfast", regs(16, 2, 128, 32, False)),
    ("regs r16 kv2 256x32", regs(16, 2, 256, 32)),
    ("regs r16 kv2 128x32", regs(16, 2, 128, 32)),
    ("regs r16 kv8 128x128", regs(16, 8, 128, 128)),
    ("regs r32 kv1 128x32", regs(32, 1, 128, 32)),
    ("regs r32 kv2 128x64", regs(32, 2, 128, 64)),
    ("regs r8 kv4 128x32", regs(8, 4, 128, 32)),
    ("regs r8 kv8 128x64", regs(8, 8, 128, 64)),
    ("regs r16 kv4 128x64 sat", {**regs(16, 4, 128, 64), "SAT_CAST": True}),
    ("regs r16 kv2 128x32 asm", regs(16, 2, 128, 32, asm=True)),
    ("regs r16 kv4 128x64 asm", regs(16, 4, 128, 64, asm=True)),
    ("regs r16 kv4 128x64 mfast asm", regs(16, 4, 128, 64, False, asm=True)),
    ("regs r16 kv4 256x64 asm", regs(16, 4, 256, 64, asm=True)),
    ("regs r16 kv8 128x128 asm", regs(16, 8, 128, 128, asm=True)),
    ("regs r32 kv2 128x64 asm", regs(32, 2, 128, 64, asm=True)),
    ("regs r8 kv8 128x64 asm", regs(8, 8, 128, 64, asm=True)),
]
if DRY:
    SHAPES = [(64, 96, torch.bfloat16), (96, 64, torch.float32)]
else:
    SHAPES = [(16384, 8192, torch.bfloat16), (131072, 2048, torch.bfloat16)]
    SHAPES += [(8192, 4096, torch.float32)]
# soft wall-clock budget (compiles included): past it, the remaining configs are skipped
BUDGET_S = float(os.environ.get("MXFP8_SWEEP_BUDGET_S", "108"))

ROWS: list[tuple[str, str, float, float, str]] = []
SKIPPED: list[str] = []
FAILS: list[str] = []  # configs that do not run or whose output is not the row-wise cast's


def make_x(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random non-zero rows at very different magnitudes, plus a zero block, a NaN block, an
    inf block and (fp32) a subnormal block, all in the first 32-row blocks."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=dev)
    x = x * torch.exp2(torch.randint(-40, 40, (M, 1), generator=g, device=dev).float())
    x[:32, 0] = 0.0
    x[40, 1] = float("nan")
    x[33, 2] = float("-inf")
    x[:32, 3] = torch.exp2(torch.arange(32.0, device=dev) - 16)
    if dtype == torch.float32:
        x[32:64, 4] = 1e-40
    return x.to(dtype)


def label(M: int, K: int, dtype: torch.dtype) -> str:
    return f"({M},{K}) {str(dtype).replace('torch.', '')}"


def add_row(shape: str, name: str, us: float, ceiling_us: float, exact: str) -> None:
    pct = 100.0 * ceiling_us / us if us > 0 else float("nan")
    ROWS.append((shape, name, us, pct, exact))
    print(f"  {shape:22} {name:32} {us:10.1f} us {pct:6.1f}%  {exact}", flush=True)


def over_budget(what: str) -> bool:
    if DRY or time.perf_counter() - T0 < BUDGET_S:
        return False
    SKIPPED.append(what)
    print(f"  [skipped, past {BUDGET_S:.0f} s] {what}", flush=True)
    return True


def fail(what: str, exc: BaseException) -> None:
    FAILS.append(what)
    msg = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " | ")
    print(f"  [ERROR] {what}: {msg[:400]}", flush=True)


def sweep_shape(M: int, K: int, dtype: torch.dtype) -> None:
    shape = label(M, K, dtype)
    x = make_x(M, K, dtype, seed=M + K)
    xt = x.t().contiguous()
    want = mx.to_mxfp8(xt, scaling_mode="rceil")  # the row-wise cast: the oracle
    nbytes = x.numel() * x.element_size() + M * K + M * K // 32
    clone_us = bench_us(clone_of(nbytes, dev), dry=DRY)
    add_row(shape, "clone (same bytes)", clone_us, clone_us, "-")
    for name, cfg in CONFIGS:
        what = f"{shape} {name}"
        if over_budget(what):
            continue
        try:
            got = tq.to_mxfp8_dim1(x, False, config=cfg)
            exact = "ok" if same(got, want) else "MISMATCH"
            if exact != "ok":
                FAILS.append(what)
            del got
            if DRY:  # the exactness call ran this path already
                us = float("nan")
            else:
                us = bench_us(lambda cfg=cfg: tq.to_mxfp8_dim1(x, False, config=cfg))
            add_row(shape, name, us, clone_us, exact)
        except Exception as exc:  # noqa: BLE001 - report the config and keep sweeping
            fail(what, exc)
    try:
        add_row(
            shape,
            "row-wise to_mxfp8 (M,K)",
            bench_us(lambda: tq.to_mxfp8(x, False), dry=DRY),
            clone_us,
            "-",
        )
        add_row(
            shape,
            "torch reference dim1",
            bench_us(lambda: ref.to_mxfp8_dim1(x, "rceil"), dry=DRY),
            clone_us,
            "-",
        )
    except Exception as exc:  # noqa: BLE001
        fail(f"{shape} peers", exc)


def main() -> None:
    if not DRY and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --dry-run)")
    import triton

    where = "CPU interpreter (dry run)" if DRY else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, triton {triton.__version__}, {where}", flush=True)
    for name, cfg in CONFIGS:
        print(f"  config {name}: {tq.dim1_config(SHAPES[0][0], SHAPES[0][1], config=cfg)}")
    print(f"{'shape':24} {'config':32} {'time':>13} {'%clone':>7}  exact", flush=True)
    for M, K, dtype in SHAPES:
        try:
            sweep_shape(M, K, dtype)
        except Exception as exc:  # noqa: BLE001
            fail(label(M, K, dtype), exc)
        if not DRY:
            torch.cuda.empty_cache()
    print("best exact config per shape (time, % of the clone ceiling):")
    for shape in dict.fromkeys(r[0] for r in ROWS):
        cands = [r for r in ROWS if r[0] == shape and r[4] == "ok"]
        if cands:
            best = min(cands, key=lambda r: r[2])
            print(f"  BEST {shape:22} {best[1]:32} {best[2]:10.1f} us {best[3]:6.1f}%")
    print(f"failures: {FAILS or 'none'}; skipped: {SKIPPED or 'none'}", flush=True)
    print(f"{time.perf_counter() - T0:.1f} s in all", flush=True)


if __name__ == "__main__":
    main()
