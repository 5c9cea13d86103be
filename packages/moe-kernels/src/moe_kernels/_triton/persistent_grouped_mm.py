"""Persistent grouped GEMM over expert-sorted rows, and its launcher.

``c[p] = a[p] @ B[e]`` for the rows p of group e (``offsets[e] <= p < offsets[e+1]``), where
``B[e]`` is ``w[e].T`` for a weight stored (E, N, K) (``"nk"``: an ``nn.Linear`` weight) or
``w[e]`` for one stored (E, K, N) (``"kn"``: the ``.mT`` view the backward GEMMs pass).

Scheduling: a persistent grid of ``NUM_PROGS`` programs walks the tiles ``pid, pid + NUM_PROGS,
...`` of the exact tile count (each group's ``ceil(rows / BM)`` m-tiles times ``ceil(N / BN)``
n-tiles, counted on the device from ``offsets``, clamped as ``grouped_mm.group_tiles`` clamps them:
no host read, every group inside [0, P) whatever the offsets hold), m-tile major, so the programs in
flight share a few experts' weights in L2. A tile finds its group from the groups' cumulative tile
counts (vector reductions, no data-dependent loop), so with ``FLATTEN`` the tile loop and the K loop
are one software-pipelined loop (Triton's ``tl.range(flatten=True)``): the next tile's first loads
are in flight while a tile stores its result. Each tile accumulates K in order in fp32 (no split-K),
so rows are bitwise independent of the tiling. Rows past a group's end are loaded (rows of the next
group, or zeros past P) but never stored; rows past ``offsets[E]`` are not visited (``zero_tail``
zeroes them where a caller needs them defined).

A and B come through host-built TMA descriptors where the config asks and the tensors allow
(contiguous, 16-byte rows and base; "kn" also needs K % BK == 0, since a K tile must not run into
the next expert's rows), else pointer loads (every path under the interpreter, and while
``torch.compile`` traces: ``wrap_triton`` records no host-built descriptors).

Nothing here checks arguments: ``moe_kernels.grouped_mm`` does that before any launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET, has_tma, tracing
from moe_kernels._gemm_plan import PersistentConfig, persistent_config
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.grouped_mm import find_tile, group_tiles, k_step
from moe_kernels._triton.launch import FastKernel, aligned

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None


@triton.jit
def _tile(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, a_desc, b_desc, N, K, stride_am, stride_be,
          stride_bn, stride_bk, seg, row0, row_end, n_t, B_KN: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, A_TMA: tl.constexpr,
          B_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
          WHILE_LOOPS: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """One BM x BN tile of c: rows [row0, min(row0 + BM, row_end)) of group seg, n-tile n_t;
    with ``SCALED`` times a's row scales and group seg's column scales (``as_ptr`` (P,),
    ``bs_ptr`` (E, N) fp32)."""
    rows = row0 + tl.arange(0, BM)
    row_in = rows < row_end
    safe_rows = tl.where(row_in, rows, row0)  # row0 < row_end: a row of this group
    ks = tl.arange(0, BK)
    n0 = n_t * BN
    cols = n0 + tl.arange(0, BN)
    col_in = cols < N
    safe_cols = tl.where(col_in, cols, 0)
    a_ptrs = a_ptr + safe_rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = (
        b_ptr
        + seg.to(tl.int64) * stride_be
        + safe_cols.to(tl.int64)[None, :] * stride_bn
        + ks[:, None] * stride_bk
    )
    b_row = seg * K if B_KN else seg * N + n0  # w viewed (E*K, N) or (E*N, K)
    num_k = tl.cdiv(K, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if WHILE_LOOPS:  # the interpreter of triton 3.5 cannot range() over a runtime bound
        k = num_k * 0
        while k < num_k:
            acc = k_step(acc, k * BK, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, n0, ks, K, 1,
                         stride_bk, B_KN, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE)  # fmt: skip
            k += 1
    else:
        for k in range(0, num_k):
            acc = k_step(acc, k * BK, a_ptrs, b_ptrs, a_desc, b_desc, row0, b_row, n0, ks, K, 1,
                         stride_bk, B_KN, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE)  # fmt: skip
    if SCALED:
        acc = acc * tl.load(as_ptr + safe_rows)[:, None]
        acc = acc * tl.load(bs_ptr + seg.to(tl.int64) * N + safe_cols)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _persistent_grouped_mm_kernel(
    a_ptr,  # (P, K) expert-sorted rows, unit stride along K
    b_ptr,  # w: (E, N, K) "nk" or (E, K, N) "kn"
    offs_ptr,  # (E+1,) int32/int64
    c_ptr,  # (P, N), contiguous
    as_ptr,  # (P,) fp32 row scales of a (SCALED only)
    bs_ptr,  # (E, N) fp32 column scales of w (SCALED only)
    a_desc,  # TMA descriptor of a (P, K), block (BM, BK) (A_TMA only)
    b_desc,  # TMA descriptor of w viewed (E*N, K) block (BN, BK), or (E*K, N) block (BK, BN)
    P,
    N,
    K,
    E,
    NUM_PROGS,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    B_KN: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    WHILE_LOOPS: tl.constexpr,  # interpreter: triton 3.5's cannot range() over a runtime bound
    FLATTEN: tl.constexpr,  # one pipelined (tile, k) loop: the next loads overlap the store
    SCALED: tl.constexpr,  # fp8 operands: the result times a's row and w's column scales
):
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_E)
    raw_start = tl.load(offs_ptr + idx, mask=(idx >= 1) & (idx < E), other=0)
    raw_end = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0)
    starts, ends, tiles, cum = group_tiles(raw_start, raw_end, idx, E, P, BM, False)
    num_n = tl.cdiv(N, BN)
    num_tiles = tl.sum(tiles, axis=0) * num_n
    if WHILE_LOOPS:
        tile = pid
        while tile < num_tiles:
            seg, row0, row_end = find_tile(starts, ends, tiles, cum, idx, tile // num_n, BM)
            _tile(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, a_desc, b_desc, N, K, stride_am,
                  stride_be, stride_bn, stride_bk, seg, row0, row_end, tile % num_n, B_KN, BM,
                  BN, BK, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE, WHILE_LOOPS, SCALED)  # fmt: skip
            tile += NUM_PROGS
    else:
        for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
            seg, row0, row_end = find_tile(starts, ends, tiles, cum, idx, tile // num_n, BM)
            _tile(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, a_desc, b_desc, N, K, stride_am,
                  stride_be, stride_bn, stride_bk, seg, row0, row_end, tile % num_n, B_KN, BM,
                  BN, BK, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE, WHILE_LOOPS, SCALED)  # fmt: skip


@functools.lru_cache(maxsize=16)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_layout(t: torch.Tensor) -> bool:
    """t's layout suits a TMA descriptor: contiguous, with 16-byte rows and base."""
    return t.is_contiguous() and t.shape[-1] * t.element_size() % 16 == 0 and aligned(t, 16)


def tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor can view t as a 2-D row-major matrix: a CUDA tensor of ``tma_layout``
    on sm90+ (the chips with TMA; ``_dispatch.has_tma``), and no trace in progress
    (``wrap_triton`` records no host-built descriptors)."""
    if TensorDescriptor is None or tracing() or not t.is_cuda or not tma_layout(t):
        return False
    return has_tma(t.get_device())


_launcher = FastKernel(_persistent_grouped_mm_kernel)


def persistent_grouped_mm(
    a_PK: torch.Tensor,
    w: torch.Tensor,
    offsets_E1: torch.Tensor,
    layout: str,
    config: PersistentConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(P, N) in ``out_dtype`` (default a's dtype): ``c[p] = a[p] @ B[e]`` over the groups
    (module docstring); rows past offsets[E] are left unwritten. ``layout``: "nk" (w (E, N, K))
    or "kn" (w (E, K, N)); a's rows unit-stride. ``scales``: (a_scale (P,), w_scale (E, N))
    fp32, contiguous: e4m3 operands (the FP8 grouped GEMM's per-channel form, "nk"),
    ``c[p] = (a[p] @ w[e].T) * a_scale[p] * w_scale[e]``, each tile's K loop accumulated in the
    MMA (fp8: FBGEMM's fast accumulation). Inputs are checked by the caller."""
    kn = layout == "kn"
    num_rows, k_dim = a_PK.shape
    num_experts = w.shape[0]
    n = w.shape[2] if kn else w.shape[1]
    c = torch.empty((num_rows, n), dtype=out_dtype or a_PK.dtype, device=a_PK.device)
    if num_rows == 0 or n == 0 or num_experts == 0:
        return c
    if k_dim == 0:
        return c.zero_()
    cfg = config or persistent_config(num_rows, n, k_dim, num_experts, INTERPRET)
    a_tma = cfg.tma and tma_ok(a_PK)
    b_tma = cfg.tma and tma_ok(w) and (not kn or k_dim % cfg.block_k == 0)
    a_desc = TensorDescriptor.from_tensor(a_PK, [cfg.block_m, cfg.block_k]) if a_tma else None
    b_desc = None
    if b_tma:
        flat = w.view(num_experts * k_dim, n) if kn else w.view(num_experts * n, k_dim)
        block = [cfg.block_k, cfg.block_n] if kn else [cfg.block_n, cfg.block_k]
        b_desc = TensorDescriptor.from_tensor(flat, block)
    num_n = cdiv(n, cfg.block_n)
    bound = (cdiv(num_rows, cfg.block_m) + num_experts) * num_n  # tiles at most
    sms = num_sms(a_PK.get_device()) if a_PK.is_cuda else 4
    programs = max(1, min(bound, sms * cfg.programs_per_sm))
    stride_bn, stride_bk = (w.stride(2), w.stride(1)) if kn else (w.stride(1), w.stride(2))
    a_scale, w_scale = scales if scales is not None else (offsets_E1, offsets_E1)  # (unused)
    args = (a_PK, w, offsets_E1, c, a_scale, w_scale, a_desc, b_desc, num_rows, n, k_dim,
            num_experts, programs, a_PK.stride(0), w.stride(0), stride_bn, stride_bk)  # fmt: skip
    constexprs = dict(
        B_KN=kn,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        BLOCK_E=next_pow2(num_experts),
        EVEN_K=k_dim % cfg.block_k == 0,
        A_TMA=a_tma,
        B_TMA=b_tma,
        UPCAST=INTERPRET,
        IEEE=a_PK.dtype == torch.float32 or (INTERPRET and scales is not None),
        WHILE_LOOPS=INTERPRET,
        FLATTEN=cfg.flatten,
        SCALED=scales is not None,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher.launch((programs,), args, constexprs, **options)
    return c
