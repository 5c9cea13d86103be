"""GPU check and timing of the mxfp8 ops (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/mxfp8_gpu.py

Checks (bit-exact vs the torch reference, which runs on the CPU copy): casts (both modes, fp32 /
bf16 / fp16, NaN / inf / zero / subnormal blocks, hardware and integer e4m3 rounding), the
special-value table of tests/test_mxfp8_quant.py (every cast path, dim0 and dim1, against the
reference and the table's bytes; its summary line: "special-value table: pass"), dequant,
the three layouts (also at the benchmark shapes), the group offsets and the grouped GEMM (vs a
float64 loop); outputs poisoned through the caching allocator; under
``set_sync_debug_mode("error")``; replayed from a captured CUDA graph; compiled with
``fullgraph=True``. Then ``do_bench`` medians beside a clone of the same bytes, the torch reference
on the GPU and torchao 0.18's Triton kernels (when importable), and a launch-config sweep.
``MXFP8_GPU_DRY_RUN=1 TRITON_INTERPRET=1`` runs a tiny version on CPU.
"""

from __future__ import annotations

import math
import os
import struct
import traceback

import numpy as np
import torch
from common import (
    FAILS,
    bench_us,
    capture,
    check,
    forbid_host_sync,
    graph_us,
    host_us,
    poison,
    same_bits,
)

from moe_kernels import mxfp8 as mx
from moe_kernels._triton import mxfp8_layout as tlay
from moe_kernels._triton import mxfp8_quant as tq
from moe_kernels.reference import mxfp8 as ref

DRY = os.environ.get("MXFP8_GPU_DRY_RUN") == "1"
dev = torch.device("cpu" if DRY else "cuda")
POISON = 0x5A  # what fresh outputs start as (not 0xFF: the scale byte of inf / NaN blocks)
ROWS: list[tuple] = []
HOST: list[tuple] = []

try:
    from torchao.prototype.moe_training.kernels.mxfp8.quant import (
        triton_mx_block_rearrange_2d_M_groups as ao_2d,
    )
    from torchao.prototype.moe_training.kernels.mxfp8.quant import (
        triton_mx_block_rearrange_per_group_3d as ao_3d,
    )
except Exception as exc:  # noqa: BLE001 - a peer only, report and go on
    print("torchao not importable:", repr(exc)[:300])
    ao_2d = ao_3d = None


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def make_x(M: int, K: int, dtype: torch.dtype, seed: int = 0, special: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-10, 10) if dtype == torch.float16 else (-60, 60)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(lo, hi, (M, 1), generator=g))
    if special and M >= 8 and K >= 64:
        x[0, :32] = 0.0
        x[1, 5] = float("nan")
        x[2, 40] = float("-inf")
        x[3, :32] = torch.exp2(torch.arange(32.0) - 16)
        x[4, :32] = 448.0 * 2.0**-3
        x[5, 0] = torch.tensor(448.0).nextafter(torch.tensor(1e9)).item()
        if dtype == torch.float32:
            x[6, :32] = 1e-40
    return x.to(dtype)


def ends_multiple_of_32(R: int, G: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cut = torch.randperm(R // 32 - 1, generator=g)[: G - 1] + 1
    ends = torch.cat([torch.sort(cut).values * 32, torch.tensor([R])])
    return ends.to(torch.int32)


# ----------------------------------------------------------------------------------- checks


def check_casts() -> None:
    print("casts", flush=True)
    shapes = [(40, 96), (64, 160)] if DRY else [(520, 2048), (1024, 96), (64, 4096)]
    for M, K in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = make_x(M, K, dtype, seed=M + K)
            xd = x.to(dev)
            for mode in ("floor", "rceil"):
                rd, rs = ref.to_mxfp8(x, mode)
                for native in (True, False):
                    if DRY and native:
                        continue
                    poison(M * K * 4, byte=POISON, device=dev)
                    d, s = tq.to_mxfp8(xd, mode == "floor", native_cast=native)
                    ok = same_bits(d, rd) and same_bits(s, rs)
                    check(f"to_mxfp8 {M}x{K} {dtype} {mode} native={native}", ok)
                rd1, rs1 = ref.to_mxfp8_dim1(x[: M // 32 * 32], mode)
                for native in (True, False):
                    if DRY and native:
                        continue
                    poison(M * K * 4, byte=POISON, device=dev)
                    d1, s1 = tq.to_mxfp8_dim1(
                        xd[: M // 32 * 32], mode == "floor", native_cast=native
                    )
                    ok = same_bits(d1, rd1) and same_bits(s1, rs1)
                    check(f"to_mxfp8_dim1 {M}x{K} {dtype} {mode} native={native}", ok)
                for bm, bk in DIM1_CONFIGS:  # every timed launch config
                    d1, s1 = tq.to_mxfp8_dim1(
                        xd[: M // 32 * 32], mode == "floor", block_m=bm, block_k=bk
                    )
                    ok = same_bits(d1, rd1) and same_bits(s1, rs1)
                    check(f"to_mxfp8_dim1 {bm}x{bk} {M}x{K} {dtype} {mode}", ok)
                for bm, bk in DIM0_CONFIGS:
                    d, s = tq.to_mxfp8(xd, mode == "floor", block_m=bm, block_k=bk)
                    ok = same_bits(d, rd) and same_bits(s, rs)
                    check(f"to_mxfp8 {bm}x{bk} {M}x{K} {dtype} {mode}", ok)
                d, s = mx.to_mxfp8(xd, scaling_mode=mode)
                for out_dtype in OUT_DTYPES:
                    poison(M * K * 4, byte=POISON, device=dev)
                    got = mx.from_mxfp8(d, s, out_dtype)
                    want = ref.from_mxfp8(d.cpu(), s.cpu(), out_dtype)
                    check(f"from_mxfp8 {M}x{K} {dtype} {mode} -> {out_dtype}", same_bits(got, want))
    # batched dim1 (the grouped GEMM's weight cast)
    b = make_x(3 * 64, 96, torch.bfloat16, seed=5, special=False).view(3, 64, 96)
    rd = torch.stack([ref.to_mxfp8_dim1(b[e], "rceil")[0].view(torch.uint8) for e in range(3)])
    rs = torch.stack([ref.to_mxfp8_dim1(b[e], "rceil")[1].view(torch.uint8) for e in range(3)])
    d, s = tq.to_mxfp8_dim1(b.to(dev), False)
    check("to_mxfp8_dim1 batched (3, 64, 96)", same_bits(d, rd) and same_bits(s, rs))
    # dequant of every byte with every scale byte
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # (256, 256)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    for bm, bk in DEQ_CONFIGS:
        for out_dtype in OUT_DTYPES:
            got = tq.from_mxfp8(data.to(dev), scale.to(dev), out_dtype, block_m=bm, block_k=bk)
            want = ref.from_mxfp8(data, scale, out_dtype)
            check(f"from_mxfp8 {bm}x{bk} all bytes -> {out_dtype}", same_bits(got, want))


# ------------------------------------------------------------- special values (a fixed table)
# The table of tests/test_mxfp8_quant.py (SPECIAL_CASES: keep the two in step), written out here
# so that this script needs no pytest. Each row: (name, input dtypes (F fp32, B bf16, H fp16),
# the first values of a block of 32, the value filling the rest, expected (scale byte, data
# bytes of the first values, data byte of the fill) for "floor", the same for "rceil"). The
# bytes are torchao's rules after 0.18 (pytorch/ao #4725): inf or NaN -> scale 255, data 0x7F.


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


INF, NAN = math.inf, math.nan
F32_MAX = _f32(0x7F7FFFFF)
BF16_MAX = _f32(0x7F7F0000)
P35 = _f32(0x40600001)  # 3.5 + 1 ulp: bf16 and fp16 round it to 3.5
P512 = _f32(0x43FFFFFF)  # 512 - 1 ulp: bf16 and fp16 round it to 512
INVALID = (255, [], 0x7F)
# fmt: off
SPECIAL_CASES = [
    ("zero block", "FBH", [], 0.0, (0, [], 0x00), (0, [], 0x00)),
    ("-0 block keeps the sign", "FBH", [], -0.0, (0, [], 0x80), (0, [], 0x80)),
    ("+inf among ones", "FBH", [1.0, INF], 1.0, INVALID, INVALID),
    ("-inf among zeros", "FBH", [-INF], 0.0, INVALID, INVALID),
    ("+inf and -inf beside 448", "FBH", [INF, -INF], 448.0, INVALID, INVALID),
    ("NaN among ones", "FBH", [NAN], 1.0, INVALID, INVALID),
    ("negative NaN", "FBH", [-NAN], 0.0, INVALID, INVALID),
    ("inf and NaN", "FBH", [2.0, INF, NAN], 0.0, INVALID, INVALID),
    ("2**-126 block", "FB", [2**-126, -(2**-126)], 2**-126, (0, [0x40, 0xC0], 0x40),
     (0, [0x40, 0xC0], 0x40)),
    ("2**-133, bf16's smallest subnormal", "FB", [2**-133, -(2**-133)], 0.0,
     (0, [0x08, 0x88], 0x00), (0, [0x08, 0x88], 0x00)),
    ("2**-149, fp32's smallest subnormal", "F", [2**-149, -(2**-149)], 0.0,
     (0, [0x00, 0x80], 0x00), (0, [0x00, 0x80], 0x00)),
    ("448, e4m3's max", "FBH", [448.0, -448.0], 0.0, (127, [0x7E, 0xFE], 0),
     (127, [0x7E, 0xFE], 0)),
    ("fp32 max", "F", [F32_MAX, -F32_MAX], 0.0, (246, [0x7E, 0xFE], 0), (247, [0x78, 0xF8], 0)),
    ("bf16 max", "FB", [BF16_MAX, -BF16_MAX], 0.0, (246, [0x7E, 0xFE], 0),
     (247, [0x78, 0xF8], 0)),
    ("480", "FBH", [480.0, -480.0], 0.0, (127, [0x7E, 0xFE], 0), (128, [0x77, 0xF7], 0)),
    ("ones and fp32's smallest subnormal", "F", [2**-149, -(2**-149)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    ("ones and bf16's smallest subnormal", "FB", [2**-133, -(2**-133)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    ("ones and fp16's smallest subnormal", "FBH", [2**-24, -(2**-24)], 1.0,
     (119, [0x00, 0x80], 0x78), (119, [0x00, 0x80], 0x78)),
    ("0x40600001", "F", [P35], 0.0, (120, [0x7E], 0), (121, [0x76], 0)),
    ("0x40600001 rounded to 3.5", "BH", [P35], 0.0, (120, [0x7E], 0), (120, [0x7E], 0)),
    ("0x43FFFFFF", "F", [P512], 0.0, (127, [0x7E], 0), (128, [0x78], 0)),
    ("0x43FFFFFF rounded to 512", "BH", [P512], 0.0, (128, [0x78], 0), (128, [0x78], 0)),
    ("65504, fp16's max", "FH", [65504.0, -65504.0], 0.0, (134, [0x7E, 0xFE], 0),
     (135, [0x78, 0xF8], 0)),
    ("2**-24, fp16's smallest subnormal", "FBH", [2**-24, -(2**-24)], 0.0,
     (95, [0x78, 0xF8], 0), (95, [0x78, 0xF8], 0)),
    ("2**-14, fp16's smallest normal", "FBH", [2**-14], 0.0, (105, [0x78], 0), (105, [0x78], 0)),
    ("1023 * 2**-24, fp16's largest subnormal", "FH", [1023 * 2**-24], 0.0, (104, [0x7E], 0),
     (105, [0x78], 0)),
]
# fmt: on
_DTYPE_LETTER = {torch.float32: "F", torch.bfloat16: "B", torch.float16: "H"}
SPECIAL: list[tuple[str, bool]] = []  # (check name, ok) of the special-value checks


def special_table(dtype: torch.dtype, mode: str, width: int = 0):
    """(names, x (N, 32) on the CPU: one case a row, scale (N,) uint8, data (N, 32) uint8);
    ``width`` > 0 repeats the cases cyclically to N = width rows."""
    names, rows, scales, datas = [], [], [], []
    for name, dtypes, head, fill, floor, rceil in SPECIAL_CASES:
        if _DTYPE_LETTER[dtype] in dtypes:
            scale, head_bytes, fill_byte = floor if mode == "floor" else rceil
            names.append(name)
            rows.append([*head, *[fill] * (32 - len(head))])
            scales.append(scale)
            datas.append([*head_bytes, *[fill_byte] * (32 - len(head_bytes))])
    idx = [i % len(names) for i in range(width or len(names))]
    x = torch.from_numpy(np.array(rows, dtype=np.float32)[idx]).to(dtype)  # one rounding
    return [names[i] for i in idx], x, np.array(scales, np.uint8)[idx], np.array(datas)[idx]


def special_check(name, names, d, s, want_d, want_s, blind=None) -> None:
    """One check: bytes (data (N, 32), scale (N, 1)) equal to want_d / want_s; detail: the cases
    that differ. ``blind``: data bytes not compared (dry runs only, see check_special_values)."""
    gd, gs = u8(d).numpy(), u8(s).numpy()
    if gd.shape != want_d.shape or gs.shape != (len(names), 1):
        ok, detail = False, f"shapes {gd.shape} {gs.shape}"
    else:
        if blind is not None:
            want_d = np.where(blind, gd, want_d)
        bad = sorted(
            {
                n
                for n, a, b, c, e in zip(names, gd, gs[:, 0], want_d, want_s, strict=True)
                if b != e or not np.array_equal(a, c)
            }
        )
        ok, detail = not bad, "; ".join(bad)
    check(name, ok, detail[:300])
    SPECIAL.append((name, ok))


def _blind(x: torch.Tensor) -> np.ndarray | None:
    """Data bytes a dry run cannot check: the interpreter's bf16 -> fp32 cast mangles bf16
    subnormals (the GPU converts them exactly, so on the GPU every byte is checked)."""
    if not DRY or x.dtype != torch.bfloat16:
        return None
    a = x.float().abs()
    return ((a > 0) & (a < 2**-126)).numpy()


def check_special_values() -> None:
    """The special-value table on the device: the reference (CPU) against the table's bytes,
    then every cast path (public ops, both e4m3 roundings, the dim1 kernels and layouts) against
    the reference, bit for bit; dim1 gets the 32 values of a case down a column."""
    print("special values", flush=True)
    dim1_cfgs = [
        None,  # the default launch ("regs", ASM_PACK on the GPU)
        {"variant": "tload"},
        {"ASM_PACK": False},
        {"ASM_PACK": False, "SAT_CAST": True},
        {"RPT": 32, "KV": 1, "K_FAST": False},
        {"RPT": 8, "KV": 2, "OFFS64": True},
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for mode in ("floor", "rceil"):
            floor = mode == "floor"
            for width in (0, 64):  # the cases once (masked tiles), repeated to 64 (unmasked)
                names, x, want_s, want_d = special_table(dtype, mode, width)
                tag = f"{dtype} {mode} N={len(names)}"
                rd, rs = ref.to_mxfp8(x, mode)
                special_check(f"special reference = table {tag}", names, rd, rs, want_d, want_s)
                rd1, rs1 = ref.to_mxfp8_dim1(x.t().contiguous(), mode)
                special_check(
                    f"special reference dim1 = table {tag}", names, rd1, rs1, want_d, want_s
                )
                rd, rs, rd1, rs1 = (u8(t).numpy() for t in (rd, rs, rd1, rs1))
                xd, xtd = x.to(dev), x.t().contiguous().to(dev)
                runs = [("to_mxfp8", mx.to_mxfp8(xd, scaling_mode=mode), rd, rs)]
                runs.append(("to_mxfp8_dim1", mx.to_mxfp8_dim1(xtd, scaling_mode=mode), rd1, rs1))
                for native in (True, False):
                    if DRY and native:
                        continue
                    got = tq.to_mxfp8(xd, floor, native_cast=native)
                    runs.append((f"to_mxfp8 native={native}", got, rd, rs))
                    got = tq.to_mxfp8_dim1(xtd, floor, native_cast=native)
                    runs.append((f"to_mxfp8_dim1 native={native}", got, rd1, rs1))
                for cfg in dim1_cfgs:
                    got = tq.to_mxfp8_dim1(xtd, floor, config=cfg)
                    runs.append((f"to_mxfp8_dim1 config={cfg}", got, rd1, rs1))
                for op, (d, s), want_d_ref, want_s_ref in runs:
                    special_check(
                        f"special {op} {tag}", names, d, s, want_d_ref, want_s_ref[:, 0], _blind(x)
                    )
                # dequantised: NaN exactly on the invalid blocks
                d, s = mx.to_mxfp8(xd, scaling_mode=mode)
                back_nan = torch.isnan(mx.from_mxfp8(d, s, torch.float32)).cpu().numpy()
                ok = np.array_equal(back_nan, np.repeat((want_s == 255)[:, None], 32, axis=1))
                check(f"special from_mxfp8 NaN blocks {tag}", ok)
                SPECIAL.append((f"special from_mxfp8 NaN blocks {tag}", ok))


def check_layouts() -> None:
    print("layouts", flush=True)
    g = torch.Generator().manual_seed(0)
    cases_2d = [((300, 7), [0, 1, 129, 129, 300]), ((1000, 36), None)]
    if not DRY:
        cases_2d += [((16640, 160), 16), ((131072, 224), 8), ((131072, 64), 8), ((524288, 256), 8)]
        cases_2d += [((5000, 64), 40)]
    for (R, C), groups in cases_2d:
        s = torch.randint(0, 256, (R, C), generator=g, dtype=torch.uint8)
        if groups is None:
            sizes = torch.randint(0, 60, (25,), generator=g)
            sizes[-1] += R - sizes.sum()
            ends = torch.cumsum(sizes, 0).to(torch.int32)
        elif isinstance(groups, int):
            ends = ends_multiple_of_32(R, groups, seed=R)
        else:
            ends = torch.tensor(groups, dtype=torch.int64)
        want, want_rows = ref.to_blocked_per_group_2d(s, ends)
        n = int(want_rows[-1])
        for bc in (None, 32, 64):
            poison(s.numel() * 2 + 128 * len(ends) * C, byte=POISON, device=dev)
            got, rows = tlay.to_blocked_per_group_2d(s.to(dev), ends.to(dev), block_c=bc)
            ok = torch.equal(rows.cpu(), want_rows) and same_bits(got[:n], want[:n])
            check(f"2d {R}x{C} G={len(ends)} block_c={bc}", ok)
        sizes, rows = mx.compute_per_group_blocked_scale_offsets(ends.to(dev))
        want_sizes, want_rows2 = ref.compute_per_group_blocked_scale_offsets(ends)
        check(
            f"group offsets G={len(ends)}",
            torch.equal(sizes.cpu(), want_sizes) and torch.equal(rows.cpu(), want_rows2),
        )
    cases_3d = [(3, 130, 5)] + ([] if DRY else [(8, 2048, 224), (8, 7168, 64), (16, 4096, 64)])
    for E, N, C in cases_3d:
        s = torch.randint(0, 256, (E, N, C), generator=g, dtype=torch.uint8)
        want = ref.to_blocked_per_group_3d(s)
        for bc in (None, 32, 64):
            poison(s.numel() * 2, byte=POISON, device=dev)
            check(
                f"3d {E}x{N}x{C} block_c={bc}",
                same_bits(tlay.to_blocked_per_group_3d(s.to(dev), block_c=bc), want),
            )
        check(f"to_blocked {N}x{C}", same_bits(mx.to_blocked(s[0].to(dev)), ref.to_blocked(s[0])))


def grouped_problem(M, K, N, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    a = (
        torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g))
    ).bfloat16()
    b = (torch.randn(len(sizes), K, N, generator=g) * 0.1).bfloat16()
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    return a, b, ends


def check_grouped_mm() -> None:
    print("grouped mm", flush=True)
    sizes = [5, 0, 40, 1, 18] if DRY else [100, 0, 333, 1, 590, 0, 7, 1000]
    M = sum(sizes) + 16
    a, b, ends = grouped_problem(M, 256 if not DRY else 64, 64 if not DRY else 24, sizes, seed=1)
    poison(M * 1024 * 4, byte=POISON, device=dev)
    got = mx.mxfp8_grouped_mm(a.to(dev), b.to(dev), ends.to(dev)).cpu()
    # same numerics on the CPU reference path (dequantised operands are exact in bf16)
    want = ref.grouped_mm_dequantized(
        ref.from_mxfp8(*ref.to_mxfp8(a, "rceil")),
        torch.stack(
            [ref.from_mxfp8(*ref.to_mxfp8_dim1(b[e], "rceil")).t() for e in range(len(sizes))]
        ),
        ends,
        torch.float32,
    )
    err = (got.float() - want).abs().max().item()
    tol = (want.abs() * 2.0**-8 + 1e-3).min().item()
    rel = ((got.float() - want).abs() / (want.abs() + 1e-3)).max().item()
    check(
        "mxfp8_grouped_mm vs dequantised fp32 loop",
        rel <= 2.0**-7,
        f"max abs {err:.3g} rel {rel:.3g} tol {tol:.3g}",
    )
    check("mxfp8_grouped_mm tail rows zero", bool((got[sum(sizes) :] == 0).all()))


def run_all_ops(x, s2, ends, s3, a, b, ga_ends):
    d, sc = mx.to_mxfp8(x)
    d1, s1 = mx.to_mxfp8_dim1(x)
    back = mx.from_mxfp8(d, sc)
    blk2, rows = mx.to_blocked_per_group_2d(s2, ends)
    blk3 = mx.to_blocked_per_group_3d(s3)
    blk = mx.to_blocked(s2)
    sizes, rows2 = mx.compute_per_group_blocked_scale_offsets(ends)
    out = mx.mxfp8_grouped_mm(a, b, ga_ends)
    return d, sc, d1, s1, back, blk2, rows, blk3, blk, sizes, rows2, out


def check_sync_graph_compile() -> None:
    print("no sync / CUDA graph / compile", flush=True)
    x = make_x(256, 512, torch.bfloat16, seed=3, special=False).to(dev)
    s2 = torch.randint(0, 256, (1000, 36), dtype=torch.uint8, device=dev)
    ends = torch.tensor([100, 100, 513, 1000], dtype=torch.int32, device=dev)
    s3 = torch.randint(0, 256, (4, 200, 8), dtype=torch.uint8, device=dev)
    a, b, ga_ends = (t.to(dev) for t in grouped_problem(300, 128, 64, [40, 0, 200, 44], seed=4))
    args = (x, s2, ends, s3, a, b, ga_ends)
    eager = run_all_ops(*args)
    n2 = int(eager[6][-1])

    def same_all(outs) -> bool:
        ok = True
        for i, (p, q) in enumerate(zip(outs, eager, strict=True)):
            if i == 5:
                p, q = p[:n2], q[:n2]
            ok &= same_bits(p, q)
        return ok

    if DRY:
        return
    try:
        torch.cuda.synchronize()
        with forbid_host_sync():
            outs = run_all_ops(*args)
        check("no host sync (set_sync_debug_mode error)", same_all(outs))
    except Exception:
        traceback.print_exc()
        check("no host sync (set_sync_debug_mode error)", False)
    try:
        graph, outs = capture(lambda: run_all_ops(*args))
        graph.replay()
        torch.cuda.synchronize()
        check("CUDA graph capture + replay", same_all(outs))
    except Exception:
        traceback.print_exc()
        check("CUDA graph capture + replay", False)
    try:
        torch._dynamo.reset()
        outs = torch.compile(run_all_ops, fullgraph=True)(*args)
        check("torch.compile(fullgraph=True)", same_all(outs))
    except Exception:
        traceback.print_exc()
        check("torch.compile(fullgraph=True)", False)


# ----------------------------------------------------------------------------------- timing


def bench(fn) -> float:
    """do_bench median (L2 flushed before every call), us."""
    return bench_us(fn, dry=DRY)


def graph_bench(fn) -> float:
    """Per-call GPU time of 10 back-to-back calls replayed from one CUDA graph (median of 9
    replays), us: no host overhead, no L2 flush."""
    return graph_us(fn, 10, 9, DRY)


class Table:
    """Rows of one op at one shape, relative to a clone of the same bytes measured beside them."""

    def __init__(self, op: str, shape: str, clone_fn, nbytes: int, clone_scale: float = 1.0):
        self.op, self.shape, self.nbytes = op, shape, nbytes
        self.clone = (bench(clone_fn) * clone_scale, graph_bench(clone_fn) * clone_scale)
        self.ao = float("nan")
        self.add("clone" if clone_scale == 1.0 else "copy ceiling", None, times=self.clone)

    def add(self, variant: str, fn, times=None) -> tuple[float, float]:
        try:
            us, gus = times if times is not None else (bench(fn), graph_bench(fn))
        except Exception as exc:  # noqa: BLE001 - report the row as missing, keep timing
            print(f"{self.op} {self.shape} {variant} failed: {exc!r}"[:300], flush=True)
            us = gus = float("nan")
        r, gr = us / self.clone[0], gus / self.clone[1]
        ROWS.append(
            (self.op, self.shape, variant, us, gus, r, gr, self.ao / us, self.nbytes / us / 1e3)
        )
        print(f"    {self.op} {self.shape} {variant}: {us:.1f} us, graph {gus:.1f} us", flush=True)
        return us, gus


def time_layouts() -> None:
    print("timing layouts", flush=True)
    shapes = [((16640, 160), 16), ((131072, 224), 8), ((131072, 64), 8), ((524288, 256), 8)]
    if DRY:
        shapes = [((640, 64), 4)]
    for (R, C), G in shapes:
        s = torch.randint(0, 256, (R, C), dtype=torch.uint8, device=dev)
        ends = ends_multiple_of_32(R, G, seed=R).to(dev)
        t = Table("2d", f"{R}x{C} G={G}", lambda s=s: s.clone(), 2 * R * C)
        if ao_2d is not None:
            try:
                t.ao = bench(lambda s=s, e=ends: ao_2d(s, e))
                t.add("torchao", lambda s=s, e=ends: ao_2d(s, e))
            except Exception as exc:  # noqa: BLE001
                print("torchao 2d failed:", repr(exc)[:200])
        for bc in (None, 32, 64, 128):
            fn = lambda s=s, e=ends, bc=bc: tlay.to_blocked_per_group_2d(s, e, block_c=bc)
            t.add(f"ours bc={bc or 'auto'}", fn)
        t.add("public fn", lambda s=s, e=ends: mx.to_blocked_per_group_2d(s, e))
        HOST.append(
            (
                f"2d {R}x{C}",
                host_us(lambda s=s, e=ends: mx.to_blocked_per_group_2d(s, e), dry=DRY),
                host_us(lambda s=s, e=ends: mx._blocked_2d_op(s, e), dry=DRY),
                host_us(lambda s=s: s.clone(), dry=DRY),
            )
        )
    shapes3 = [(8, 2048, 224), (8, 7168, 64), (16, 4096, 64)] if not DRY else [(2, 256, 64)]
    for E, N, C in shapes3:
        s = torch.randint(0, 256, (E, N, C), dtype=torch.uint8, device=dev)
        t = Table("3d", f"{E}x{N}x{C}", lambda s=s: s.clone(), 2 * s.numel())
        if ao_3d is not None:
            try:
                t.ao = bench(lambda s=s: ao_3d(s))
                t.add("torchao", lambda s=s: ao_3d(s))
            except Exception as exc:  # noqa: BLE001
                print("torchao 3d failed:", repr(exc)[:200])
        for bc in (None, 32, 64, 128):
            fn = lambda s=s, bc=bc: tlay.to_blocked_per_group_3d(s, block_c=bc)
            t.add(f"ours bc={bc or 'auto'}", fn)
        t.add("public fn", lambda s=s: mx.to_blocked_per_group_3d(s))


# the interpreter truncates fp32 -> bf16 (bf16-subnormal results differ): no bf16 in a dry run
OUT_DTYPES = (
    (torch.float32, torch.float16) if DRY else (torch.float32, torch.bfloat16, torch.float16)
)
DIM0_CONFIGS = [(None, None), (32, 128), (16, 256), (32, 256), (64, 256), (16, 512)]
DEQ_CONFIGS = [(None, None), (32, 256), (16, 512)]
DIM1_CONFIGS = [(None, None), (64, 64), (32, 64), (32, 256), (32, 32)]


def time_casts() -> None:
    print("timing casts", flush=True)
    shapes = [(16384, 8192), (131072, 2048)] if not DRY else [(128, 256)]
    for M, K in shapes:
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        nbytes = M * K * 2 + M * K + M * K // 32  # read bf16, write e4m3 + e8m0
        # the copy ceiling for our bytes: a clone's time scaled to nbytes (it moves 4 M K bytes)
        t = Table("cast", f"{M}x{K} bf16", lambda x=x: x.clone(), nbytes, nbytes / (4 * M * K))
        t.add("dim0 torch ref", lambda x=x: ref.to_mxfp8(x, "rceil"))
        for bm, bk in DIM0_CONFIGS:
            fn = lambda x=x, bm=bm, bk=bk: tq.to_mxfp8(x, False, block_m=bm, block_k=bk)
            t.add(f"dim0 {bm or 'auto'}x{bk or 'auto'}", fn)
        t.add("dim0 auto int-rounding", lambda x=x: tq.to_mxfp8(x, False, native_cast=False))
        t.add("dim1 torch ref", lambda x=x: ref.to_mxfp8_dim1(x, "rceil"))
        for bm, bk in DIM1_CONFIGS:
            fn = lambda x=x, bm=bm, bk=bk: tq.to_mxfp8_dim1(x, False, block_m=bm, block_k=bk)
            t.add(f"dim1 {bm or 'auto'}x{bk or 'auto'}", fn)
        d, sc = mx.to_mxfp8(x)
        for bm, bk in DEQ_CONFIGS:
            fn = lambda d=d, sc=sc, bm=bm, bk=bk: tq.from_mxfp8(
                d, sc, torch.bfloat16, block_m=bm, block_k=bk
            )
            t.add(f"from_mxfp8 {bm or 'auto'}x{bk or 'auto'}", fn)


def time_grouped_mm() -> None:
    print("timing grouped mm", flush=True)
    if DRY:
        return
    T, E, K, N = 4096 * 8, 16, 2048, 1024
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    ends = ends_multiple_of_32(T, E, seed=1).to(dev)
    # the "GB/s" column holds GFLOP/s here; "vs clone" is vs the bf16 torch._grouped_mm
    t = Table(
        "gmm", f"{T}x{K}->{N} E={E}", lambda: torch._grouped_mm(a, b, offs=ends), 2 * T * K * N
    )
    t.add("mxfp8_grouped_mm (emulated)", lambda: mx.mxfp8_grouped_mm(a, b, ends))


def main() -> None:
    if not DRY:
        print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    checks = (check_casts, check_special_values, check_layouts, check_grouped_mm)
    for step in (*checks, check_sync_graph_compile):
        try:
            step()
        except Exception:
            traceback.print_exc()
            FAILS.append(step.__name__)
    for step in (time_layouts, time_casts, time_grouped_mm):
        try:
            step()
        except Exception:
            traceback.print_exc()
            FAILS.append(step.__name__)
    lines = [
        "| op | shape | variant | bench us | graph us | /clone | /clone graph | vs ao | GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for op, shape, variant, us, gus, r, gr, ao, bw in ROWS:
        cells = [op, shape, variant, f"{us:.1f}", f"{gus:.1f}", f"{r:.2f}", f"{gr:.2f}"]
        lines.append("| " + " | ".join([*cells, f"{ao:.1f}", f"{bw:.0f}"]) + " |")
    lines.append("")
    lines.append("| host us per eager call | public fn | custom op | clone |")
    lines.append("| --- | --- | --- | --- |")
    for name, h1, h2, h3 in HOST:
        lines.append(f"| {name} | {h1:.1f} | {h2:.1f} | {h3:.1f} |")
    table = "\n".join(lines)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mxfp8_table.md"), "w") as f:
            f.write(table + "\n")
    print(table)
    n_bad = sum(not ok for _, ok in SPECIAL)
    verdict = "pass" if SPECIAL and not n_bad else "FAIL"
    print(f"\nspecial-value table: {verdict} ({len(SPECIAL) - n_bad}/{len(SPECIAL)} checks ok)")
    print("FAILS:", FAILS if FAILS else "none")


if __name__ == "__main__":
    main()
