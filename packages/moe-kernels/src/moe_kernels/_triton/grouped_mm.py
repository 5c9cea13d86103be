"""Triton grouped GEMM with a gathered A operand and a fused SiLU epilogue, and its launcher.

``y[p] = act(x[rows[p]] @ w[e].T)`` for the rows p of group e (``offsets[e] <= p < offsets[e+1]``).

Grid: a static upper bound of output tiles, ``(ceil(P / BM) + E) * ceil(N / BN)`` programs (no
host read of ``offsets``). Each program loads the E+1 boundaries, clamps them (``group_tiles``:
offsets[0] read as 0, each later one into [the previous one, P], so the bound holds and every
row belongs to one segment whatever the offsets hold), counts the BM-row tiles of every segment
(the E groups, then the tail ``[offsets[E], P)`` as segment E), finds its segment with a
cumulative sum and either computes a BM x BN tile of its group (fp32 accumulator, ``tl.dot`` over
BK-wide K steps, software pipelined by ``num_stages``), writes zeros (tail tiles), or exits (the
spare programs of the bound). Tiles are ordered GROUP_M m-tiles at a time for L2 reuse of B.

A rows are loaded through ``row_indices`` (a pointer gather; rows contiguous along D, so 16-byte
vector loads); a row index outside [0, T) reads row 0 and stores a zero row. Rows past the group's
end are clamped to a real row (unmasked loads in the K loop) and not stored. B tiles are read from
w[e] (N, D) as (BK, BN) through strides, or (config ``tma=True``) as (BN, BK) through a host-built
TMA descriptor of w viewed as (E*N, D), transposed in registers; A tiles of sorted rows (no
``row_indices``) can come through TMA as well. Nothing here checks arguments: the public module
``moe_kernels.grouped_mm`` does that before any launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET, has_tma, tracing
from moe_kernels._triton.blocks import cdiv, next_pow2, pow2_clamp
from moe_kernels._triton.launch import FastKernel, aligned

try:  # host-side TMA descriptors (triton >= 3.4); without them ``tma=True`` configs use pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

ACT_NONE, ACT_SILU = 0, 1


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def group_tiles(raw_start, raw_end, idx, E, P, BM: tl.constexpr, TAIL: tl.constexpr):
    """(start, end, m-tiles, their inclusive cumulative sum) of the (BLOCK_E,) segments idx,
    from the loaded offsets ``raw_start[i] = offsets[i]`` (1 <= i <= E) and ``raw_end[i] =
    offsets[i + 1]`` (i < E), any value elsewhere. The clamping rule (memory safety whatever
    the offsets hold; ``reference.grouped_mm.group_bounds``): offsets[0] reads as 0 and each
    later offset is clamped into [the previous clamped offset, P], i.e. the running maximum of
    the offsets clamped into [0, P], taken in int64 (int64 values past int32 saturate, never
    wrap), so the segments are disjoint, in order and inside [0, P). Segment e < E is group e;
    with TAIL segment E is the tail [offsets[E], P), else it and the later ones are empty.
    Takes values, not the offsets pointer: a helper's results derived from a pointer argument
    make Inductor's mutation analysis count that pointer as written (and copy it before every
    launch)."""
    s = tl.where((idx >= 1) & (idx <= E), raw_start.to(tl.int64), 0)
    e = tl.where(idx < E, raw_end.to(tl.int64), 0)
    if TAIL:
        s = tl.where(idx <= E, s, P)
        e = tl.where(idx < E, e, P)
    start = tl.minimum(tl.associative_scan(tl.maximum(s, 0), 0, _max_fn), P).to(tl.int32)
    end = tl.minimum(tl.associative_scan(tl.maximum(e, 0), 0, _max_fn), P).to(tl.int32)
    if not TAIL:
        end = tl.where(idx < E, end, start)  # (segments past E - 1 empty)
    tiles = (end - start + BM - 1) // BM
    return start, end, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def find_tile(start, end, tiles, cum, idx, t, BM: tl.constexpr):
    """(segment, first row, end row) of m-tile t, from ``group_tiles``' results (a t past the
    last tile gives a segment past the last one)."""
    seg = tl.sum((cum <= t).to(tl.int32), axis=0)
    here = idx == seg
    first_tile = tl.sum(tl.where(here, cum - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(here, start, 0), axis=0) + (t - first_tile) * BM
    row_end = tl.sum(tl.where(here, end, 0), axis=0)
    return seg, row0, row_end


@triton.jit
def tile_pids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(m-tile, n-tile) of program ``pid``, GROUP_M consecutive m-tiles sweeping all n-tiles
    before moving on (L2 reuse of B)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def row_sources(ridx_ptr, safe_rows, row_in, T, HAS_RIDX: tl.constexpr):
    """(source row of x as int64, live) of the output rows ``safe_rows`` (in-group rows where
    ``row_in``): through ``row_indices`` (an index outside [0, T) reads row 0 and is not live),
    or the rows themselves (sorted rows)."""
    if HAS_RIDX:
        src = tl.load(ridx_ptr + safe_rows).to(tl.int64)
        live = row_in & (src >= 0) & (src < T)
        return tl.where(live, src, 0), live
    return safe_rows.to(tl.int64), row_in


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b: ``UPCAST`` in fp32 (the interpreter's bf16 dot is wrong), ``IEEE`` an exact
    fp32 dot (no TF32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def k_step(acc, k0, a_ptrs, b_ptrs, a_desc, b_desc, a_row, b_row, n0, ks, K, stride_ak, stride_bk,
           B_KN: tl.constexpr, EVEN_K: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
           UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """acc + A[:, k0:k0+BK] @ B[k0:k0+BK, :] (columns past K read as zero). A: (BM, BK) tiles at
    ``a_ptrs`` (K stride ``stride_ak``) or from ``a_desc`` at row ``a_row``; B: (BK, BN) at
    ``b_ptrs`` (K stride ``stride_bk``), or from ``b_desc``: w viewed (E*N, K) at row ``b_row``
    (transposed), or with ``B_KN`` w viewed (E*K, N) at (b_row + k0, n0)."""
    if A_TMA:
        a = a_desc.load([a_row, k0])  # rows past P and columns past K read as 0
    elif EVEN_K:
        a = tl.load(a_ptrs + k0 * stride_ak)
    else:
        a = tl.load(a_ptrs + k0 * stride_ak, mask=((k0 + ks) < K)[None, :], other=0.0)
    if B_TMA:
        if B_KN:
            b = b_desc.load([b_row + k0, n0])
        else:
            b = b_desc.load([b_row, k0]).T
    elif EVEN_K:
        b = tl.load(b_ptrs + k0 * stride_bk)
    else:
        b = tl.load(b_ptrs + k0 * stride_bk, mask=((k0 + ks) < K)[:, None], other=0.0)
    return dot_acc(a, b, acc, UPCAST, IEEE)


@triton.jit
def _gather_grouped_mm_kernel(
    x_ptr,  # (T, D)
    w_ptr,  # (E, N, D)
    offs_ptr,  # (E+1,) int32/int64
    ridx_ptr,  # (P,) int32/int64 (HAS_RIDX only)
    y_ptr,  # (P, N), contiguous
    a_desc,  # TMA descriptor of x (T, D), block (BM, BK) (A_TMA only)
    b_desc,  # TMA descriptor of w viewed (E*N, D), block (BN, BK) (B_TMA only)
    T,
    P,
    N,
    D,
    E,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wn,
    stride_wd,
    HAS_RIDX: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    A_TMA: tl.constexpr,  # sorted rows (no row_indices): A tiles through TMA
    B_TMA: tl.constexpr,  # B tiles through TMA (the last n-tile may read the next expert: unused)
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    WHILE_LOOPS: tl.constexpr,  # interpreter: triton 3.5's cannot range() over a runtime bound
):
    pid_m, pid_n = tile_pids(tl.program_id(0), tl.cdiv(P, BM) + E, tl.cdiv(N, BN), GROUP_M)

    idx = tl.arange(0, BLOCK_E)
    raw_start = tl.load(offs_ptr + idx, mask=(idx >= 1) & (idx <= E), other=0)
    raw_end = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0)
    start, end, tiles, cum = group_tiles(raw_start, raw_end, idx, E, P, BM, True)  # E: the tail
    seg, row0, row_end = find_tile(start, end, tiles, cum, idx, pid_m, BM)
    rows = row0 + tl.arange(0, BM)
    row_in = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    col_in = cols < N
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    if seg == E:  # tail rows [offsets[E], P): zeros
        zero = tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty)
        tl.store(y_ptrs, zero, mask=row_in[:, None] & col_in[None, :])
    elif seg < E:
        safe_rows = tl.where(row_in, rows, row0)  # row0 < row_end: a row of this group
        src, live = row_sources(ridx_ptr, safe_rows, row_in, T, HAS_RIDX)
        safe_cols = tl.where(col_in, cols, 0)
        ks = tl.arange(0, BK)
        a_ptrs = x_ptr + src[:, None] * stride_xt + ks[None, :] * stride_xd
        b_ptrs = (
            w_ptr
            + seg.to(tl.int64) * stride_we
            + safe_cols.to(tl.int64)[None, :] * stride_wn
            + ks[:, None] * stride_wd
        )
        b_row = seg * N + pid_n * BN  # w viewed as (E*N, D)
        num_k = tl.cdiv(D, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if WHILE_LOOPS:
            k = num_k * 0
            while k < num_k:
                acc = k_step(
                    acc, k * BK, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, 0, ks, D,
                    stride_xd, stride_wd, False, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE,
                )  # fmt: skip
                k += 1
        else:
            for k in range(0, num_k):
                acc = k_step(
                    acc, k * BK, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, 0, ks, D,
                    stride_xd, stride_wd, False, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE,
                )  # fmt: skip
        if ACTIVATION == 1:
            acc = acc / (1.0 + tl.exp(-acc))  # silu in fp32
        acc = tl.where(live[:, None], acc, 0.0)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _zero_tail_kernel(y_ptr, offs_ptr, P, N, E, BM: tl.constexpr, BN: tl.constexpr,
                      BLOCK_E: tl.constexpr):  # fmt: skip
    """Zero rows [offsets[E], P) of y (P, N), one BM x BN tile a program (most exit at once).
    offsets[E] as ``group_tiles`` clamps it: max(offsets[1..E]) clamped into [0, P]."""
    idx = tl.arange(0, BLOCK_E)
    last = tl.load(offs_ptr + idx, mask=(idx >= 1) & (idx <= E), other=0).to(tl.int64)
    end = tl.minimum(tl.maximum(tl.max(last, axis=0), 0), P)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    if tl.program_id(0).to(tl.int64) * BM + BM > end:
        mask = ((rows >= end) & (rows < P))[:, None] & (cols < N)[None, :]
        zero = tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], zero, mask=mask)


_zero_tail = FastKernel(_zero_tail_kernel)


def zero_tail(y_PN: torch.Tensor, offsets_E1: torch.Tensor) -> None:
    """In place: rows of contiguous y_PN at or past offsets[E] (clamped as ``group_tiles``
    clamps it) set to zero (no host read)."""
    num_rows, n = y_PN.shape
    if y_PN.numel() == 0:
        return
    num_experts = offsets_E1.shape[0] - 1
    bm, bn = 64, min(max(next_pow2(n), 16), 256)
    grid = (cdiv(num_rows, bm), cdiv(n, bn))
    args = (y_PN, offsets_E1, num_rows, n, num_experts)
    _zero_tail.launch(grid, args, dict(BM=bm, BN=bn, BLOCK_E=next_pow2(num_experts + 1)),
                      num_warps=4)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launcher


class GemmConfig(NamedTuple):
    """Tile shape and launch parameters of one grouped-GEMM launch."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # B (and A when rows are sorted) through TMA descriptors where possible


def pick_config(
    num_rows: int,
    n: int,
    d: int,
    num_experts: int,
    elem_bytes: int = 2,
    smem: int = 227 * 1024,
    hopper: bool = True,
) -> GemmConfig:
    """Tiles, warps and stages from the problem and the GPU's shared memory per block.

    GPU: 64 x 256 x 64 tiles, 8 warps, 4 stages, B (and sorted A) through TMA: the fastest of the
    H200 sweep (``benchmarks/gpu/grouped_mm_sweep.py``, 2048 tokens, E=16, k=8, D=2048 -> N=1024
    with SiLU: 135 us against 163 us for dispatch + ``torch._grouped_mm`` + SiLU). BN/BK shrink for
    small N/D; stages drop until the tiles fit in ``smem`` (e.g. ~100 KiB on consumer GPUs); TMA
    only on ``hopper`` (compute capability 9.0 and later).
    Interpreter: few, large programs (each program costs ~0.4 ms of numpy overhead).
    """
    if INTERPRET:
        return GemmConfig(
            block_m=pow2_clamp(num_rows, 16, 32),
            block_n=pow2_clamp(n, 16, 128),
            block_k=pow2_clamp(d, 16, 128),
            group_m=4,
            num_warps=4,
            num_stages=1,
        )
    block_m = 64
    block_n = pow2_clamp(n, 16, 256)
    block_k = pow2_clamp(d, 16, 64)
    num_warps = 8 if block_m * block_n >= 64 * 256 else 4
    stages = 4
    while stages > 2 and stages * (block_m + block_n) * block_k * elem_bytes > smem - 8192:
        stages -= 1
    return GemmConfig(block_m, block_n, block_k, 8, num_warps, stages, tma=hopper)


@functools.lru_cache(maxsize=16)
def _device_limits(index: int) -> tuple[int, bool]:
    """(shared memory per block in bytes, TMA allowed: ``_dispatch.has_tma``) of CUDA device
    ``index``."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024)), has_tma(index)


_launcher = FastKernel(_gather_grouped_mm_kernel)  # compiled-handle launches (low host cost)


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor over t as a 2-D row-major matrix: contiguous, 16-byte rows and base.
    Not while tracing: ``wrap_triton`` records no host-built descriptors."""
    row_bytes = t.shape[-1] * t.element_size()
    if TensorDescriptor is None or tracing():
        return False
    return t.is_contiguous() and row_bytes % 16 == 0 and aligned(t, 16)


def tma_descriptors(x_TD: torch.Tensor, w_END: torch.Tensor, sorted_rows: bool, cfg) -> tuple:
    """(A's, B's) host TMA descriptors for a launch with config ``cfg`` (``tma``, ``block_m``,
    ``block_n``, ``block_k``), or None for the operands loaded through pointers: A (x, blocks
    (BM, BK)) only for sorted rows, B (w viewed (E*N, D), blocks (BN, BK)); each where
    ``_tma_ok`` allows it."""
    a_desc = b_desc = None
    if cfg.tma and sorted_rows and _tma_ok(x_TD):
        a_desc = TensorDescriptor.from_tensor(x_TD, [cfg.block_m, cfg.block_k])
    if cfg.tma and _tma_ok(w_END):
        num_experts, n, dim = w_END.shape
        w_flat = w_END.view(num_experts * n, dim)
        b_desc = TensorDescriptor.from_tensor(w_flat, [cfg.block_n, cfg.block_k])
    return a_desc, b_desc


def num_programs(num_rows: int, n: int, num_experts: int, cfg: GemmConfig) -> int:
    """The static grid: an upper bound of (m-tiles of every group and of the tail) x n-tiles."""
    return (cdiv(num_rows, cfg.block_m) + num_experts) * cdiv(n, cfg.block_n)


def gather_grouped_mm(
    x_TD: torch.Tensor,
    w_END: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    activation: int,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(P, N) in x's dtype; see ``moe_kernels.grouped_mm.gather_grouped_mm``. Inputs checked."""
    num_tokens, dim = x_TD.shape
    num_experts, n, _ = w_END.shape
    num_rows = num_tokens if row_indices_P is None else row_indices_P.shape[0]
    y_PN = torch.empty((num_rows, n), dtype=x_TD.dtype, device=x_TD.device)
    if num_rows == 0 or n == 0:
        return y_PN
    if num_tokens == 0 or dim == 0 or num_experts == 0:
        return y_PN.zero_()  # no A rows / empty K: every row is act(0) = 0
    cfg = config or pick_config(
        num_rows,
        n,
        dim,
        num_experts,
        x_TD.element_size(),
        *(_device_limits(x_TD.get_device()) if x_TD.is_cuda else (227 * 1024, False)),
    )
    a_desc, b_desc = tma_descriptors(x_TD, w_END, row_indices_P is None, cfg)
    a_tma, b_tma = a_desc is not None, b_desc is not None
    grid = (num_programs(num_rows, n, num_experts, cfg),)
    args = (
        x_TD,
        w_END,
        offsets_E1,
        row_indices_P if row_indices_P is not None else offsets_E1,
        y_PN,
        a_desc,
        b_desc,
        num_tokens,
        num_rows,
        n,
        dim,
        num_experts,
        x_TD.stride(0),
        x_TD.stride(1),
        w_END.stride(0),
        w_END.stride(1),
        w_END.stride(2),
    )
    constexprs = dict(
        HAS_RIDX=row_indices_P is not None,
        ACTIVATION=activation,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        GROUP_M=cfg.group_m,
        BLOCK_E=next_pow2(num_experts + 1),
        EVEN_K=dim % cfg.block_k == 0,
        A_TMA=a_tma,
        B_TMA=b_tma,
        UPCAST=INTERPRET,
        IEEE=x_TD.dtype == torch.float32,
        WHILE_LOOPS=INTERPRET,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher.launch(grid, args, constexprs, **options)
    return y_PN
