"""Persistent grouped GEMM over expert-sorted rows with the training path's fused epilogues, and
its launcher.

``acc[p] = a[src(p)] @ B[e]`` for the rows p of group e (``offsets[e] <= p < offsets[e+1]``),
where ``B[e]`` is ``w[e].T`` for a weight stored (E, N, K) (``nk``: an ``nn.Linear`` weight) or
``w[e]`` for one stored (E, K, N) (``kn``), and ``src(p)`` is p (sorted rows) or
``row_indices[p]`` (``GATHER``: a pointer gather of the source rows in the loads). The epilogue
(``EPILOGUE``) decides what a tile writes:

* ``STORE``: ``c = acc`` in c's dtype.
* ``ACT`` (the up-projection's forward): ``h = acc`` rounded to h's dtype, and ``a = act(h)`` of
  the rounded h (the bits a separate activation pass over h would write): SiLU, or with ``DUAL``
  SwiGLU ``silu(h_gate) * h_up`` from two accumulators, the gate columns ``[n0, n0 + BN)`` of
  w[e] and the up columns ``[H + n0, H + n0 + BN)`` (X = 2H output columns of h, H of a).
* ``ACT_GRAD`` (the down-projection's data gradient, the router weight applied after the GEMM):
  with ``g = acc`` (fp32, ``dY[tok] @ w_out[e]``), h the saved pre-activation, s the row's router
  weight (0 where ``tok < 0``): ``dh = act'(h) (s g)`` (X columns), ``sa = s act(h)`` and
  ``ds_part[p, j] = sum over the tile's columns of g act(h)`` for n-tile j; ``row_sum`` adds the
  parts in j order (no atomics). The formulas are ``_triton/activation.py``'s.

Scheduling: a persistent grid of ``NUM_PROGS`` programs walks the tiles ``pid, pid + NUM_PROGS,
...`` of the exact tile count (each group's ``ceil(rows / BM)`` m-tiles times ``ceil(N / BN)``
n-tiles, counted on the device: no host read of ``offsets``), m-tile major, so the programs in
flight share a few experts' B in L2. A program finds its tile's group with a cursor that only
moves forward (its tiles come in increasing order). Rows past a group's end are loaded (TMA or
clamped pointers) but never stored; rows past ``offsets[E]`` are not visited (left unwritten:
callers read group rows only). B and sorted A tiles come through host-built TMA descriptors
where the config asks and the tensors allow, else pointer loads (every path under the
interpreter, and while ``torch.compile`` traces).

Nothing here checks arguments: ``moe_kernels.expert_gemm`` does that before any launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET, tracing
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel, aligned

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

STORE, ACT, ACT_GRAD = 0, 1, 2


@triton.jit
def _load_b(b_desc, b_ptr, b_row, n0, k0, cols, ks, N_B, K, stride_bn, stride_bk,
            B_KN: tl.constexpr, B_TMA: tl.constexpr, EVEN_K: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The (BK, BN) tile of B[e] at (k0, n0). ``nk``: rows b_row.. of w viewed (E*N_B, K) (TMA)
    or through strides, transposed; ``kn``: rows b_row + k0.. of w viewed (E*K, N_B)."""
    if B_TMA:
        if B_KN:
            b = b_desc.load([b_row + k0, n0])
        else:
            b = b_desc.load([b_row, k0]).T
    else:
        if B_KN:
            ptrs = b_ptr + (k0 + ks).to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn
        else:
            ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_bn + (k0 + ks)[:, None] * stride_bk
        if EVEN_K:
            b = tl.load(ptrs)
        else:
            b = tl.load(ptrs, mask=((k0 + ks) < K)[:, None], other=0.0)
    return b


@triton.jit
def _silu_parts(g):
    """(silu(g), silu'(g)) in fp32, ``_triton/activation.py``'s formulas bit for bit."""
    denom = 1.0 + tl.exp(-g)
    s = 1.0 / denom
    return g / denom, s * (1.0 + g * (1.0 - s))


@triton.jit
def _find(starts, ends, cum, tiles, idx, m_t, BM: tl.constexpr):
    """(group, first row, end row) of m-tile ``m_t`` from the groups' (BLOCK_E,) start and end
    rows, their m-tile counts and its inclusive cumulative sum (loop-free: the persistent loop
    stays one flattenable nest)."""
    seg = tl.sum((cum <= m_t).to(tl.int32), axis=0)
    here = idx == seg
    first = tl.sum(tl.where(here, cum - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(here, starts, 0), axis=0) + (m_t - first) * BM
    row_end = tl.sum(tl.where(here, ends, 0), axis=0)
    return seg, row0, row_end


@triton.jit
def _k_step(acc, acc2, k0, a_desc, a_ptrs, row0, b_desc, b_base, b_row, n0, safe_cols, ks, N, N_B,
            K, stride_bn, stride_bk, DUAL: tl.constexpr, B_KN: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, A_TMA: tl.constexpr,
            B_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """(acc, acc2) + the products of the K columns [k0, k0 + BK) (columns past K read as 0)."""
    if A_TMA:
        a = a_desc.load([row0, k0])  # rows past P and columns past K read as 0
    elif EVEN_K:
        a = tl.load(a_ptrs + k0)
    else:
        a = tl.load(a_ptrs + k0, mask=((k0 + ks) < K)[None, :], other=0.0)
    b = _load_b(b_desc, b_base, b_row, n0, k0, safe_cols, ks, N_B, K, stride_bn, stride_bk,
                B_KN, B_TMA, EVEN_K, BN, BK)  # fmt: skip
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    if DUAL:  # the up half: w[e]'s rows (nk) or columns (kn) [N + n0, N + n0 + BN)
        b_row2 = b_row if B_KN else b_row + N
        b2 = _load_b(b_desc, b_base, b_row2, N + n0, k0, N + safe_cols, ks, N_B, K, stride_bn,
                     stride_bk, B_KN, B_TMA, EVEN_K, BN, BK)  # fmt: skip
        if UPCAST:
            b2 = b2.to(tl.float32)
        if IEEE:
            acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
        else:
            acc2 = tl.dot(a, b2, acc2)
    return acc, acc2


@triton.jit
def _tile(a_ptr, b_ptr, ridx_ptr, c_ptr, c2_ptr, h_ptr, s_ptr, ds_ptr, a_desc, b_desc,
          T, N, N_B, K, num_n, stride_am, stride_be, stride_bn, stride_bk,
          seg, row0, row_end, n_t,
          EPILOGUE: tl.constexpr, GATED: tl.constexpr, DUAL: tl.constexpr,
          GATHER: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, EVEN_K: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
          UPCAST: tl.constexpr, IEEE: tl.constexpr, WHILE_LOOPS: tl.constexpr,
          EPI_SPLIT: tl.constexpr):  # fmt: skip
    """One BM x BN output tile: rows [row0, min(row0 + BM, row_end)) of group seg, n-tile n_t."""
    rows = row0 + tl.arange(0, BM)
    row_in = rows < row_end
    safe_rows = tl.where(row_in, rows, row0)  # row0 < row_end: a row of this group
    if GATHER:
        src = tl.load(ridx_ptr + safe_rows).to(tl.int64)
        live = row_in & (src >= 0) & (src < T)
        src = tl.where(live, src, 0)
    else:
        src = safe_rows.to(tl.int64)
        live = row_in
    ks = tl.arange(0, BK)
    n0 = n_t * BN
    cols = n0 + tl.arange(0, BN)
    col_in = cols < N
    safe_cols = tl.where(col_in, cols, 0)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :]
    b_base = b_ptr + seg.to(tl.int64) * stride_be
    b_row = seg * K if B_KN else seg * N_B + n0  # w viewed (E*K, N_B) or (E*N_B, K)
    num_k = tl.cdiv(K, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN if DUAL else 16), dtype=tl.float32)
    if WHILE_LOOPS:
        k = num_k * 0
        while k < num_k:
            acc, acc2 = _k_step(acc, acc2, k * BK, a_desc, a_ptrs, row0, b_desc, b_base, b_row,
                                n0, safe_cols, ks, N, N_B, K, stride_bn, stride_bk, DUAL, B_KN,
                                BN, BK, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE)  # fmt: skip
            k += 1
    else:
        for k in range(0, num_k):
            acc, acc2 = _k_step(acc, acc2, k * BK, a_desc, a_ptrs, row0, b_desc, b_base, b_row,
                                n0, safe_cols, ks, N, N_B, K, stride_bn, stride_bk, DUAL, B_KN,
                                BN, BK, EVEN_K, A_TMA, B_TMA, UPCAST, IEEE)  # fmt: skip
    width = 2 * N if GATED else N  # columns of h / dh
    if EPILOGUE == 0:
        acc = tl.where(live[:, None], acc, 0.0)
        mask = row_in[:, None] & col_in[None, :]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:
        if EPI_SPLIT == 2:  # two column halves in turn: fewer live registers
            g0, g1 = _halves(acc, BM, BN)
            u0, u1 = _halves(acc2, BM, BN if DUAL else 16)
            c0, c1 = _halves(cols[None, :] + rows[:, None] * 0, BM, BN)
            _act_store(g0, u0, rows, row_in, live, c0, N, width, c_ptr, c2_ptr, DUAL)
            _act_store(g1, u1, rows, row_in, live, c1, N, width, c_ptr, c2_ptr, DUAL)
        else:
            _act_store(acc, acc2, rows, row_in, live, cols[None, :], N, width, c_ptr, c2_ptr,
                       DUAL)  # fmt: skip
    else:
        tok = tl.load(ridx_ptr + safe_rows)
        on = row_in & (tok >= 0)
        w = tl.load(s_ptr + safe_rows, mask=on, other=0.0).to(tl.float32)
        if EPI_SPLIT == 2:
            g0, g1 = _halves(acc, BM, BN)
            c0, c1 = _halves(cols[None, :] + rows[:, None] * 0, BM, BN)
            dot = _act_grad_store(g0, rows, row_in, w, c0, N, width, h_ptr, c_ptr, c2_ptr, GATED)
            dot += _act_grad_store(g1, rows, row_in, w, c1, N, width, h_ptr, c_ptr, c2_ptr,
                                   GATED)  # fmt: skip
        else:
            dot = _act_grad_store(acc, rows, row_in, w, cols[None, :], N, width, h_ptr, c_ptr,
                                  c2_ptr, GATED)  # fmt: skip
        tl.store(ds_ptr + rows.to(tl.int64) * num_n + n_t, tl.where(on, dot, 0.0), mask=row_in)


@triton.jit
def _halves(t, BM: tl.constexpr, BN: tl.constexpr):
    """The column halves ``(t[:, :BN // 2], t[:, BN // 2:])`` of a (BM, BN) tensor."""
    return tl.split(tl.permute(tl.reshape(t, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _act_store(acc, acc2, rows, row_in, live, cols, N, width, h_ptr, a_ptr, DUAL: tl.constexpr):
    """ACT on the columns ``cols`` (1, C) or (BM, C): h = the rounded accumulator (the up half
    from acc2 with DUAL), a = act(h)."""
    mask = row_in[:, None] & (cols < N)
    r64 = rows.to(tl.int64)[:, None]
    h_ptrs = h_ptr + r64 * width + cols
    g = tl.where(live[:, None], acc, 0.0).to(h_ptr.dtype.element_ty)
    tl.store(h_ptrs, g, mask=mask)
    y, _unused = _silu_parts(g.to(tl.float32))
    if DUAL:
        u = tl.where(live[:, None], acc2, 0.0).to(h_ptr.dtype.element_ty)
        tl.store(h_ptrs + N, u, mask=mask)
        y = y * u.to(tl.float32)
    tl.store(a_ptr + r64 * N + cols, y.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_grad_store(acc, rows, row_in, w, cols, N, width, h_ptr, dh_ptr, sa_ptr,
                    GATED: tl.constexpr):  # fmt: skip
    """ACT_GRAD on the columns ``cols``: dh = act'(h) (w acc), sa = w act(h); returns the rows'
    partial dots ``sum(acc * act(h))`` over these columns (fp32)."""
    mask = row_in[:, None] & (cols < N)
    r64 = rows.to(tl.int64)[:, None]
    h_ptrs = h_ptr + r64 * width + cols
    g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    silu, dsilu = _silu_parts(g)
    gw = acc * w[:, None]
    dh_ptrs = dh_ptr + r64 * width + cols
    if GATED:
        u = tl.load(h_ptrs + N, mask=mask, other=0.0).to(tl.float32)
        act = silu * u
        tl.store(dh_ptrs, (gw * u * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptrs + N, (gw * silu).to(dh_ptr.dtype.element_ty), mask=mask)
    else:
        act = silu
        tl.store(dh_ptrs, (gw * dsilu).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(sa_ptr + r64 * N + cols, (act * w[:, None]).to(sa_ptr.dtype.element_ty), mask=mask)
    return tl.sum(tl.where(mask, acc * act, 0.0), axis=1)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # (P, K) sorted rows, or (T, K) source rows (GATHER); unit stride along K
    b_ptr,  # w: (E, N_B, K) "nk" or (E, K, N_B) "kn"
    offs_ptr,  # (E+1,) int32/int64
    ridx_ptr,  # (P,) row_indices (GATHER) / tokens (ACT_GRAD: rows with tok < 0 have s = 0)
    c_ptr,  # STORE: c (P, N); ACT: h (P, X); ACT_GRAD: dh (P, X)
    c2_ptr,  # ACT: a (P, N); ACT_GRAD: sa (P, N)
    h_ptr,  # ACT_GRAD: the saved pre-activation h (P, X)
    s_ptr,  # ACT_GRAD: router weights (P,)
    ds_ptr,  # ACT_GRAD: (P, ceil(N / BN)) fp32 partial dots
    a_desc,  # TMA descriptor of a (P, K), block (BM, BK) (A_TMA only)
    b_desc,  # TMA descriptor of w (E*N_B, K) block (BN, BK), or (E*K, N_B) block (BK, BN)
    T,
    P,
    N,  # output columns of one accumulator (H for ACT / ACT_GRAD)
    N_B,  # rows of w[e] ("nk") or columns ("kn"): N, or 2N with DUAL
    K,
    E,
    NUM_PROGS,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    EPILOGUE: tl.constexpr,
    GATED: tl.constexpr,  # ACT / ACT_GRAD: SwiGLU (h has 2N columns: gate, then up)
    DUAL: tl.constexpr,  # a second accumulator over w[e]'s rows [N + n0, ...) (ACT with GATED)
    GATHER: tl.constexpr,
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
    EPI_SPLIT: tl.constexpr,  # 2: the epilogue in two column halves (fewer live registers)
    FLATTEN: tl.constexpr,  # one flattened (tile, k) loop: the next tile's loads overlap the epilogue
):
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_E)
    starts = tl.load(offs_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    starts = tl.minimum(tl.maximum(starts, 0), P)
    ends = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0).to(tl.int32)
    ends = tl.minimum(tl.maximum(ends, starts), P)
    tiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(tiles, axis=0)  # inclusive
    num_n = tl.cdiv(N, BN)
    num_tiles = tl.sum(tiles, axis=0) * num_n
    if WHILE_LOOPS:
        tile = pid
        while tile < num_tiles:
            seg, row0, row_end = _find(starts, ends, cum, tiles, idx, tile // num_n, BM)
            _tile(a_ptr, b_ptr, ridx_ptr, c_ptr, c2_ptr, h_ptr, s_ptr, ds_ptr, a_desc, b_desc,
                  T, N, N_B, K, num_n, stride_am, stride_be, stride_bn, stride_bk,
                  seg, row0, row_end, tile % num_n,
                  EPILOGUE, GATED, DUAL, GATHER, B_KN, BM, BN, BK, EVEN_K, A_TMA, B_TMA,
                  UPCAST, IEEE, WHILE_LOOPS, EPI_SPLIT)  # fmt: skip
            tile += NUM_PROGS
    else:
        for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
            seg, row0, row_end = _find(starts, ends, cum, tiles, idx, tile // num_n, BM)
            _tile(a_ptr, b_ptr, ridx_ptr, c_ptr, c2_ptr, h_ptr, s_ptr, ds_ptr, a_desc, b_desc,
                  T, N, N_B, K, num_n, stride_am, stride_be, stride_bn, stride_bk,
                  seg, row0, row_end, tile % num_n,
                  EPILOGUE, GATED, DUAL, GATHER, B_KN, BM, BN, BK, EVEN_K, A_TMA, B_TMA,
                  UPCAST, IEEE, WHILE_LOOPS, EPI_SPLIT)  # fmt: skip


@triton.jit
def _row_sum_kernel(part_ptr, out_ptr, offs_ptr, P, NUM_N, E,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """out[p] = the sum of part[p, :NUM_N] (one fixed tree order); 0 for rows past offsets[E]."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + E).to(tl.int64), 0), P)
    in_p = rows < P
    ok = rows < end
    mask = ok[:, None] & (cols < NUM_N)[None, :]
    part = tl.load(part_ptr + rows.to(tl.int64)[:, None] * NUM_N + cols[None, :], mask=mask,
                   other=0.0)  # fmt: skip
    tl.store(out_ptr + rows, tl.sum(part, axis=1), mask=in_p)


_row_sum = FastKernel(_row_sum_kernel)


def row_sum(part_PJ: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """(P,) fp32: each row's parts summed (rows past offsets[E]: 0)."""
    num_rows, num_n = part_PJ.shape
    out = torch.empty((num_rows,), dtype=torch.float32, device=part_PJ.device)
    if num_rows == 0:
        return out
    bp = 128 if not INTERPRET else max(16, min(1024, next_pow2(num_rows)))
    args = (part_PJ, out, offsets_E1, num_rows, num_n, offsets_E1.shape[0] - 1)
    _row_sum.launch((cdiv(num_rows, bp),), args,
                    dict(BLOCK_P=bp, BLOCK_N=next_pow2(max(num_n, 1))), num_warps=4)  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Launcher


class ExpertGemmConfig(NamedTuple):
    """Tile shape and launch parameters of one persistent grouped-GEMM launch. ``tma``: B (and
    sorted A) through TMA descriptors where the tensors allow; ``programs_per_sm``: the
    persistent grid is that many programs per multiprocessor."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = True
    programs_per_sm: int = 1
    epilogue_split: int = 1  # 2: the fused epilogues in two column halves
    flatten: bool = False  # the persistent and K loops as one pipelined loop


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_ok(t: torch.Tensor, rows_divisible: int = 1) -> bool:
    """A TMA descriptor over t as a 2-D row-major matrix: contiguous, 16-byte rows and base.
    Not while tracing (``wrap_triton`` records no host-built descriptors)."""
    if TensorDescriptor is None or tracing() or not t.is_cuda:
        return False
    row_bytes = t.shape[-1] * t.element_size()
    return t.is_contiguous() and row_bytes % 16 == 0 and aligned(t, 16)


_launcher = FastKernel(_expert_gemm_kernel)


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    *,
    layout: str,
    epilogue: int = STORE,
    gated: bool = False,
    h_PX: torch.Tensor | None = None,
    weights_P: torch.Tensor | None = None,
    tokens_P: torch.Tensor | None = None,
    num_rows: int | None = None,
    config: ExpertGemmConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the persistent grouped GEMM; see the module docstring. Inputs are checked by the
    caller. ``layout``: "nk" (w (E, N_B, K)) or "kn" (w (E, K, N_B)); N = N_B, or N_B / 2 for
    ``ACT`` with ``gated`` (two accumulators). Returns (c,) for STORE, (h, a) for ACT, (dh, sa,
    ds) for ACT_GRAD (ds (P,) fp32), rows past offsets[E] unwritten (ds: 0)."""
    from moe_kernels._triton.expert_gemm_heuristics import pick_config

    kn = layout == "kn"
    num_experts = w.shape[0]
    k_dim = w.shape[1] if kn else w.shape[2]
    n_b = w.shape[2] if kn else w.shape[1]
    dual = epilogue == ACT and gated
    n = n_b // 2 if dual else n_b
    p = a.shape[0] if num_rows is None else num_rows
    if row_indices_P is not None:
        p = row_indices_P.shape[0]
    dev, dtype = a.device, a.dtype
    cfg = config or pick_config(p, n, k_dim, num_experts, epilogue, gated, a.element_size(),
                                a.is_cuda)  # fmt: skip
    width = 2 * n if gated else n
    num_n = cdiv(n, cfg.block_n)
    if epilogue == STORE:
        outs = (torch.empty((p, n), dtype=dtype, device=dev),)
        c, c2 = outs[0], outs[0]
    elif epilogue == ACT:
        outs = (torch.empty((p, width), dtype=dtype, device=dev),
                torch.empty((p, n), dtype=dtype, device=dev))  # fmt: skip
        c, c2 = outs
    else:
        ds_part = torch.empty((p, num_n), dtype=torch.float32, device=dev)
        c = torch.empty((p, width), dtype=dtype, device=dev)
        c2 = torch.empty((p, n), dtype=dtype, device=dev)
    if p == 0 or n == 0 or num_experts == 0:
        if epilogue == ACT_GRAD:
            return c, c2, torch.zeros((p,), dtype=torch.float32, device=dev)
        return outs
    a_tma = cfg.tma and row_indices_P is None and _tma_ok(a)
    b_tma = cfg.tma and _tma_ok(w) and (not kn or k_dim % cfg.block_k == 0)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]) if a_tma else None
    b_desc = None
    if b_tma:
        flat = w.view(num_experts * k_dim, n_b) if kn else w.view(num_experts * n_b, k_dim)
        block = [cfg.block_k, cfg.block_n] if kn else [cfg.block_n, cfg.block_k]
        b_desc = TensorDescriptor.from_tensor(flat, block)
    bound = (cdiv(p, cfg.block_m) + num_experts) * num_n
    sms = _num_sms(a.get_device()) if a.is_cuda else 4
    programs = max(1, min(bound, sms * cfg.programs_per_sm))
    ridx = row_indices_P if row_indices_P is not None else tokens_P
    stride_bn, stride_bk = (w.stride(2), w.stride(1)) if kn else (w.stride(1), w.stride(2))
    args = (
        a, w, offsets_E1, ridx if ridx is not None else offsets_E1, c, c2,
        h_PX if h_PX is not None else c, weights_P if weights_P is not None else c,
        ds_part if epilogue == ACT_GRAD else c, a_desc, b_desc,
        a.shape[0], p, n, n_b, k_dim, num_experts, programs,
        a.stride(0), w.stride(0), stride_bn, stride_bk,
    )  # fmt: skip
    constexprs = dict(
        EPILOGUE=epilogue,
        GATED=gated,
        DUAL=dual,
        GATHER=row_indices_P is not None,
        B_KN=kn,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        BLOCK_E=next_pow2(num_experts),
        EVEN_K=k_dim % cfg.block_k == 0,
        A_TMA=a_tma,
        B_TMA=b_tma,
        UPCAST=INTERPRET,
        IEEE=dtype == torch.float32,
        WHILE_LOOPS=INTERPRET,
        EPI_SPLIT=cfg.epilogue_split,
        FLATTEN=cfg.flatten,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if a_tma or b_tma:  # descriptors are not keys FastKernel can cache on: Triton's own launch
        _expert_gemm_kernel[(programs,)](*args, **constexprs, **options)
    else:
        _launcher.launch((programs,), args, constexprs, **options)
    if epilogue == ACT_GRAD:
        return c, c2, row_sum(ds_part, offsets_E1)
    return outs
