"""Timing of the mxfp8 ops (one H200 run): ``do_bench`` medians and CUDA-graph device times beside
a clone of the same bytes, the torch reference on the GPU and torchao 0.18's Triton kernels
(when importable), with the launchers' ``block_m`` / ``block_k`` / ``block_c`` / ``native_cast``
variants, and the host time of an eager call.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/mxfp8_gpu.py

``MXFP8_GPU_DRY_RUN=1 TRITON_INTERPRET=1`` runs a tiny version on CPU; ``OUT=DIR`` also writes
the table to DIR/mxfp8_table.md. Correctness (bit for bit against the reference, the
special-value blocks, no sync, graph replay, compile): ``tests/gpu/test_mxfp8_gpu.py``.
"""

from __future__ import annotations

import os
import traceback

import torch
from common import bench_us, graph_us, host_us

from moe_kernels import mxfp8 as mx
from moe_kernels._triton import mxfp8_layout as tlay
from moe_kernels._triton import mxfp8_quant as tq
from moe_kernels.reference import mxfp8 as ref

DRY = os.environ.get("MXFP8_GPU_DRY_RUN") == "1"
dev = torch.device("cpu" if DRY else "cuda")
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


def custom_op_2d(s: torch.Tensor, e: torch.Tensor):
    """The registered custom op itself (the dispatcher's round trip the public function skips)."""
    return torch.ops.moe_kernels.to_blocked_per_group_2d.default(s, e)


def ends_multiple_of_32(R: int, G: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cut = torch.randperm(R // 32 - 1, generator=g)[: G - 1] + 1
    ends = torch.cat([torch.sort(cut).values * 32, torch.tensor([R])])
    return ends.to(torch.int32)


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
                host_us(lambda s=s, e=ends: custom_op_2d(s, e), dry=DRY),
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
    failed = []
    for step in (time_layouts, time_casts, time_grouped_mm):
        try:
            step()
        except Exception:
            traceback.print_exc()
            failed.append(step.__name__)
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
    print("failed sections:", failed or "none")


if __name__ == "__main__":
    main()
