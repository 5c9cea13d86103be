"""Where routing's time goes at T=2^20 (one H200 run): per-kernel device time of the launch
variants, each checked bit-exact against the reference, plus the memory floor of kernel A's load
pattern.

PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/gpu/routing_ablation.py

Variants (``routing_triton(config=...)``): index_shuffling's token-column plan (``COLS``, its
tokens per program ``COLS_T``) against the sorted plan; C ranking each program's pairs by prefix
sums of one-hot rows (``CUMSUM``), by ``tl.sort`` or by byte-packed per-expert counts
(``COUNT``), and C's warps (other switches: ``PACK_W``, ``FKEY``, ``MERGE``, ``SCAN_CHUNK``,
``SCAN_WARPS``).
``ROUTING_FLOORS=1`` adds the floors of kernel A's load patterns. Times: one call per CUDA graph,
``do_bench`` medians (L2 flushed); per kernel: ``torch.profiler`` averages over 5 eager calls.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from routing_gpu import graph_time as graph_us  # CUDA graph of one call, do_bench median
from routing_gpu import same

from moe_kernels._reference.routing import index_shuffling_reference, route_reference
from moe_kernels._triton import routing as tri

FAILS: list[str] = []
dev = torch.device("cuda")


@triton.jit
def _row_floor_kernel(x_ptr, out_ptr, T, E: tl.constexpr, BLOCK_T: tl.constexpr):
    """Kernel A's load pattern (a row per thread, 16 bytes per load) with only a max."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    acc = tl.full([BLOCK_T], -2147483648, tl.int32)
    for c0 in range(0, E, 8):
        v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * E + c0 + tl.arange(0, 8)[None, :],
                    mask=ok[:, None], other=0).to(tl.int32)  # fmt: skip
        acc = tl.maximum(acc, tl.max(v, axis=1))
    tl.store(out_ptr + rows, acc, mask=ok)


@triton.jit
def _lanes_floor_kernel(x_ptr, out_ptr, T, E: tl.constexpr, BLOCK_T: tl.constexpr,
                        LPR: tl.constexpr):  # fmt: skip
    """LPR threads per row, 16 bytes each per load (LPR * 16 contiguous bytes of a row)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    acc = tl.full([BLOCK_T, LPR], -2147483648, tl.int32)
    cols = tl.arange(0, LPR)[:, None] * 8 + tl.arange(0, 8)[None, :]
    for c0 in range(0, E, 8 * LPR):
        offs = rows.to(tl.int64)[:, None, None] * E + c0 + cols[None, :, :]
        v = tl.load(x_ptr + offs, mask=ok[:, None, None], other=0).to(tl.int32)
        acc = tl.maximum(acc, tl.max(v, axis=2))
    tl.store(out_ptr + rows, tl.max(acc, axis=1), mask=ok)


@triton.jit
def _tile_floor_kernel(x_ptr, out_ptr, T, E: tl.constexpr, BLOCK_T: tl.constexpr):
    """A coalesced (BLOCK_T, E) tile load with a row max."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * E + tl.arange(0, E)[None, :],
                mask=ok[:, None], other=0).to(tl.int32)  # fmt: skip
    tl.store(out_ptr + rows, tl.max(v, axis=1), mask=ok)


@triton.jit
def _runs_kernel(out_ptr, n_prog, SHIFT, NR: tl.constexpr, R: tl.constexpr):
    """C's store pattern, regular: program p writes NR runs of R int32, run e at
    ``e * (n_prog * R + SHIFT) + p * R`` (SHIFT 0: 32-byte aligned runs for R % 8 == 0)."""
    pid = tl.program_id(0)
    idx = tl.arange(0, NR * R)
    e = idx // R
    tl.store(out_ptr + e * (n_prog * R + SHIFT) + pid * R + idx % R, idx)


def run_floors(n: int = 1 << 23) -> None:
    """What stores in runs cost: n int32 written as runs of R per (program, expert), 128
    experts (R = 8: C's average run at T=2^20, E=128, k=8 with 128-token programs)."""
    out = torch.empty(n + 4096 * 128, device=dev, dtype=torch.int32)
    t_clone = graph_us(lambda: out[:n].clone())
    print(f"== store runs: {n} int32 (clone {t_clone:.1f} us for read + write)")
    for nr, r in ((1, 1024), (128, 8), (128, 16), (128, 32), (128, 64), (64, 16), (32, 32)):
        for shift in (0, 1):
            n_prog = n // (nr * r)
            t = graph_us(lambda np_=n_prog, nr=nr, r=r, sh=shift: _runs_kernel[(np_,)](
                out, np_, sh, nr, r, num_warps=8))  # fmt: skip
            print(f"  runs of {r:5} x {nr:4} a program, shift {shift}: {t:7.1f} us "
                  f"({4 * n / t / 1e3:5.0f} GB/s written)", flush=True)  # fmt: skip


def per_kernel(fn) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        kernels = (("A", "_topk_"), ("B", "_scan"), ("C", "_place"), ("D", "_expert_runs"))
        for short, name in kernels:
            if name in ev.key:
                out[short] = ev.device_time_total / max(ev.count, 1)
    return out


def floors(T: int, E: int) -> None:
    x = torch.randn(T, E, device=dev).to(torch.bfloat16).view(torch.int16)
    out = torch.empty(T, device=dev, dtype=torch.int32)
    nbytes = x.numel() * 2
    t_clone = graph_us(lambda: x.clone())
    print(f"== floors T={T} E={E}: clone {t_clone:.1f} us ({2 * nbytes / t_clone / 1e3:.0f} GB/s)")
    for name, kern, bt, w, *lpr in (
        ("row/thread 64x2w", _row_floor_kernel, 64, 2),
        ("row/thread 128x4w", _row_floor_kernel, 128, 4),
        ("tile 32x4w", _tile_floor_kernel, 32, 4),
        ("2 lanes/row 64x4w", _lanes_floor_kernel, 64, 4, 2),
        ("4 lanes/row 64x8w", _lanes_floor_kernel, 64, 8, 4),
        ("4 lanes/row 16x2w", _lanes_floor_kernel, 16, 2, 4),
        ("4 lanes/row 32x4w", _lanes_floor_kernel, 32, 4, 4),
        ("tile 64x8w", _tile_floor_kernel, 64, 8),
    ):
        grid = (triton.cdiv(T, bt),)
        t = graph_us(
            lambda k=kern, bt=bt, w=w, g=grid, lpr=lpr: k[g](x, out, T, E, bt, *lpr, num_warps=w)
        )
        print(f"  {name:20} {t:8.1f} us  read {nbytes / t / 1e3:6.0f} GB/s")


def variants(T: int, E: int, dtype: torch.dtype, cfgs: list[dict]) -> None:
    k = 8
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, E, device=dev, generator=g).softmax(-1).to(dtype)
    if T <= 65536:  # specials too: NaN, -inf, -0.0
        x[torch.rand(T, E, device=dev, generator=g) < 0.02] = float("nan")
        x[torch.rand(T, E, device=dev, generator=g) < 0.02] = float("-inf")
        x[torch.rand(T, E, device=dev, generator=g) < 0.02] = -0.0
    want_is = index_shuffling_reference(x, 0, E, None, k)
    want_rt = route_reference(x, k, None, 0, E, False)
    print(f"== variants T={T} E={E} k={k} {dtype}  (us: graph IS, graph route | A B C of route)")
    for cfg in cfgs:

        def run_is(cfg=cfg):
            _, _, ei, ti, _, _, tcpe = tri.routing_triton(
                x, k, None, 0, E, False, False, False, True, config=cfg
            )
            return tcpe, ei, ti

        def run_rt(cfg=cfg):
            return tri.routing_triton(x, k, None, 0, E, False, True, True, False, cfg)[:6]

        try:
            ok = all(same(a, b) for a, b in zip(run_is(), want_is, strict=True))
            ok &= all(same(a, b) for a, b in zip(run_rt(), want_rt, strict=True))
            t_is, t_rt = graph_us(run_is), graph_us(run_rt)
            pk = per_kernel(run_rt)
            pk_is = per_kernel(run_is)
            print(
                f"  {cfg!s:62} ok={ok} IS {t_is:7.1f} route {t_rt:7.1f} | "
                f"A {pk.get('A', 0):6.1f} B {pk.get('B', 0):5.1f} C {pk.get('C', 0):6.1f} "
                f"D {pk.get('D', 0):5.1f} | IS: A {pk_is.get('A', 0):6.1f} "
                f"C {pk_is.get('C', 0):6.1f} D {pk_is.get('D', 0):5.1f}",
                flush=True,
            )
            if not ok:
                FAILS.append(f"{T} {E} {dtype} {cfg}")
        except Exception as exc:  # keep going: one broken variant should not hide the others
            print(f"  {cfg!s:62} raised {exc!r}"[:400], flush=True)
            FAILS.append(f"{T} {E} {dtype} {cfg} raised")


def _patched(fn, edits: list[tuple[str, str]]):
    """``fn`` (a jit function of ``tri``) recompiled from its source with ``edits`` applied, in a
    module that sees all of ``tri``'s names."""
    import importlib.util
    import inspect
    import tempfile
    import textwrap

    src = textwrap.dedent(inspect.getsource(fn.fn))
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"diag edit not found: {old!r}")
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), "diag.py")
    with open(path, "w") as f:
        f.write(f"import triton\nimport triton.language as tl\nfrom {tri.__name__} import *\n")
        f.write(f"globals().update(vars(__import__('{tri.__name__}', fromlist=['_'])))\n\n")
        f.write(src)
    spec = importlib.util.spec_from_file_location("diag", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, fn.fn.__name__)


# Time-only diagnostics (wrong results). Sorted plan: ``nosort``, the identity in place of
# tl.sort; ``nostore``, the sorted pairs' stores masked off (at run time, so they stay). The
# token-column plan with C writing the placed pairs (``RUNS`` off; ``_place_presorted``):
# ``none``, the kernel recompiled as it is (the baseline of the same run); ``coalout``, C's
# sorted stores at coalesced addresses (the program's slots; session 11: C 165 -> 68 us at
# E=128, what led to D); ``noinv``, no inverse pass in C. ``anoslot``: A without the stores of
# its placed pairs (A's time only: C then reads garbage and may fault).
_P_POS = "pos = idx + tl.gather(base, le, 0)"
_P_INV = "tl.store(inverse_ptr + offs, tl.where(u >= 0, (u & ((1 << PB) - 1)) + at, -1), mask=m)"
_A_SLOT = "mask=routed & row_ok)  # fmt: skip"
_DIAGS = {
    "none": ("_place_presorted", []),
    "coalout": ("_place_presorted", [(_P_POS, _P_POS.replace("idx +", "idx + pid * NP +"))]),
    "noinv": ("_place_presorted", [(_P_INV, _P_INV.replace("mask=m)", "mask=m & (n < 0))"))]),
    "anoslot": ("_presort_choice", [(_A_SLOT, "mask=routed & row_ok & (rows < 0))")]),
    "nosort": ("_place_sorted_pairs", [("tl.sort(", "(")]),
    "nostore": (
        "_place_sorted_pairs",
        [
            (
                "    pos = idx + tl.gather",
                "    ok = ok & (key * 0 + n < 0)\n    pos = idx + tl.gather",
            )
        ],
    ),
}


def _diag_patch(kind: str) -> None:
    name, edits = _DIAGS[kind]
    setattr(tri, name, _patched(getattr(tri, name), edits))


def main() -> int:
    if os.environ.get("ROUTING_DIAG"):
        diag = os.environ["ROUTING_DIAG"]
        _diag_patch(diag)
        run = tri.routing_triton
        for E in (128, 64):
            x = torch.randn(1 << 20, E, device=dev).softmax(-1).to(torch.bfloat16)
            cols = _DIAGS[diag][0] in ("_place_presorted", "_presort_choice")
            for cfg in ({"RUNS": 0},) if cols else ({}, {"C_WARPS": 1}):
                pk = per_kernel(lambda c=cfg, x=x, E=E: run(x, 8, None, 0, E, 0, 0, 0, 1, c))
                pr = per_kernel(lambda c=cfg, x=x, E=E: run(x, 8, None, 0, E, 0, 1, 1, 0, c))
                print(f"  {diag} E={E} {cfg}: IS C {pk.get('C', 0):6.1f}  route A "
                      f"{pr.get('A', 0):6.1f} C {pr.get('C', 0):6.1f}", flush=True)  # fmt: skip
        return 0
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    if os.environ.get("ROUTING_FLOORS"):
        floors(1 << 20, 128)
    if os.environ.get("ROUTING_RUNS"):
        run_floors()
    # the token-column plan: tokens a program (COLS_T), D writing the placed pairs out by expert
    # (RUNS, groups of RUNS_P A-programs) or C
    rc = [{}, {"COLS_T": 256}, {"COLS": 0}]
    more = [{"RUNS_P": 64}, {"RUNS_P": 256}, {"RUNS_WARPS": 8}, {"RUNS": 0}, {"COLS_T": 64}]
    variants(1 << 20, 128, torch.bfloat16, rc + more)
    variants(1 << 20, 64, torch.bfloat16, rc + more)
    variants(65536, 128, torch.bfloat16, rc)  # NaN, -inf, -0.0 in the scores
    variants(65536, 64, torch.float16, rc)
    print("FAILS:", FAILS if FAILS else "none")
    return 1 if FAILS else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("GPU only")
    sys.exit(main())
