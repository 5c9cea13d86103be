"""Persistent K-grouped GEMM: the weight gradient of a grouped GEMM, and its launcher.

``out[e] = dy[rows of e].T @ x[src of those rows]`` for the rows p of group e
(``offsets[e] <= p < offsets[e+1]``; src = ``row_indices[p]``, or p without them).

Scheduling: the output tiles (E experts x ``ceil(N / BN)`` x ``ceil(D / BD)``, a static count) are
walked expert-major by a persistent grid of ``NUM_PROGS`` programs, tiles ``pid, pid + NUM_PROGS,
...``, so the programs in flight read a few experts' rows while they are in L2. A tile's K loop runs
over its group's rows in BK-row steps (``max(1, ceil(rows / BK))`` of them; an empty group's one
step adds nothing and stores zeros). Since the steps differ per expert, the tile loop and the K loop
are flattened by hand into one loop of the program's total step count (counted from ``offsets`` on
the device, clamped as ``grouped_mm.group_tiles`` clamps them: no host read, every group inside [0,
P) whatever the offsets hold), which Triton software-pipelines across tiles: the next tile's first
loads are in flight while a tile stores.

Each tile accumulates its rows in order in fp32 (no split over rows, no atomics): bitwise
reproducible. Rows at or past the group's end, and rows whose source is outside [0, T), add
nothing. Loads (``WgradConfig.tma``): by pointer ("none": the gather, strided operands, the
interpreter), both tiles masked; x through a host-built TMA descriptor ("x", sorted bf16 rows),
dy by pointer, masked; or both ("both"). The descriptors are ragged (``triton.tools.ragged_tma``):
each load names its group's [start, end), and the hardware fills rows at or past the end with
zeros, so the next group's rows (or the unused rows past the last group, whatever they hold,
NaN included) never reach a tile.

Nothing here checks arguments: ``moe_kernels.grouped_mm.grouped_weight_grad`` does that before
any launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET, tracing
from moe_kernels._gemm_plan import WgradConfig, wgrad_config
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.grouped_mm import group_tiles
from moe_kernels._triton.launch import FastKernel
from moe_kernels._triton.persistent_grouped_mm import num_sms, tma_layout, tma_ok

try:  # host-side ragged TMA descriptors (triton >= 3.5)
    from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged
except ImportError:  # pragma: no cover - older triton: pointer loads only
    create_ragged_descriptor = load_ragged = None


@triton.jit
def _pick(values, idx, e):
    """values[e] of a (BLOCK_E,) vector in registers (a reduction: no memory access in the
    loop, which would keep Triton from pipelining the loads)."""
    return tl.sum(tl.where(idx == e, values, 0), axis=0)


@triton.jit
def _tiles_before(bound, pid, NUM_PROGS):
    """How many of this program's tiles ``pid + i * NUM_PROGS`` (i >= 0) lie below ``bound``."""
    return tl.maximum(bound - pid + NUM_PROGS - 1, 0) // NUM_PROGS


@triton.jit
def _grouped_weight_grad_kernel(
    dy_ptr,  # (P, N)
    x_ptr,  # (T, D)
    offs_ptr,  # (E+1,) int32/int64
    ridx_ptr,  # (P,) int32/int64 (HAS_RIDX only)
    out_ptr,  # (E, N, D), contiguous
    dy_desc,  # ragged TMA descriptor of dy (P, N), block (BK, BN) (TMA only)
    x_desc,  # ragged TMA descriptor of x (P, D), block (BK, BD) (TMA only)
    T,
    P,
    N,
    D,
    E,
    NUM_PROGS,
    stride_dyp,
    stride_dyn,
    stride_xt,
    stride_xd,
    HAS_RIDX: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TMA_DY: tl.constexpr,  # dy's tiles through dy_desc
    TMA_X: tl.constexpr,  # x's tiles through x_desc
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    WHILE_LOOPS: tl.constexpr,  # interpreter: triton 3.5's cannot range() over a runtime bound
):
    pid = tl.program_id(0)
    num_d = tl.cdiv(D, BD)
    per_e = tl.cdiv(N, BN) * num_d  # output tiles per expert
    # This program's step count: its tiles in each expert times that expert's K steps.
    idx = tl.arange(0, BLOCK_E)
    in_e = idx < E
    raw_start = tl.load(offs_ptr + idx, mask=(idx >= 1) & in_e, other=0)
    raw_end = tl.load(offs_ptr + idx + 1, mask=in_e, other=0)
    starts, ends, _, _ = group_tiles(raw_start, raw_end, idx, E, P, BK, False)  # clamped
    steps = tl.maximum(tl.cdiv(ends - starts, BK), 1)
    mine = _tiles_before((idx + 1) * per_e, pid, NUM_PROGS) - _tiles_before(idx * per_e, pid,
                                                                             NUM_PROGS)  # fmt: skip
    total = tl.sum(tl.where(in_e, mine * steps, 0), axis=0)

    acc = tl.zeros((BN, BD), dtype=tl.float32)
    # The loop's state: the step k within the tile (the tile advances at k == 0), its expert e,
    # the expert's rows [start, end) and K steps, the tile's first output row n0 and column d0.
    e, start, end, num_k, n0, d0 = _tile(pid, starts, ends, steps, idx, per_e, num_d, BN, BD)
    state = (0, pid - NUM_PROGS, e, start, end, num_k, n0, d0)
    if WHILE_LOOPS:
        step = total * 0
        while step < total:
            acc, state = _step(acc, state, starts, ends, steps, idx, per_e, num_d, NUM_PROGS,
                               dy_ptr, x_ptr, ridx_ptr, out_ptr, dy_desc, x_desc, T, N, D,
                               stride_dyp, stride_dyn, stride_xt, stride_xd, HAS_RIDX, BK,
                               TMA_DY, TMA_X, UPCAST, IEEE)  # fmt: skip
            step += 1
    else:
        for _ in range(0, total):
            acc, state = _step(acc, state, starts, ends, steps, idx, per_e, num_d, NUM_PROGS,
                               dy_ptr, x_ptr, ridx_ptr, out_ptr, dy_desc, x_desc, T, N, D,
                               stride_dyp, stride_dyn, stride_xt, stride_xd, HAS_RIDX, BK,
                               TMA_DY, TMA_X, UPCAST, IEEE)  # fmt: skip


@triton.jit
def _step(acc, state, starts, ends, steps, idx, per_e, num_d, NUM_PROGS, dy_ptr, x_ptr, ridx_ptr,
          out_ptr, dy_desc, x_desc, T, N, D, stride_dyp, stride_dyn, stride_xt, stride_xd,
          HAS_RIDX: tl.constexpr, BK: tl.constexpr, TMA_DY: tl.constexpr, TMA_X: tl.constexpr,
          UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One K step of the flattened loop: a tile's state set at its first step, its product
    accumulated, the tile stored at its last step. Returns (acc, state)."""
    BN: tl.constexpr = acc.shape[0]
    BD: tl.constexpr = acc.shape[1]
    k, tile, e, start, end, num_k, n0, d0 = state
    if k == 0:
        tile += NUM_PROGS
        e, start, end, num_k, n0, d0 = _tile(tile, starts, ends, steps, idx, per_e, num_d, BN,
                                             BD)  # fmt: skip
    acc = _accumulate(acc, start + k * BK, end, dy_ptr, x_ptr, ridx_ptr, dy_desc, x_desc, T,
                      stride_dyp, stride_dyn, stride_xt, stride_xd, n0, d0, N, D, HAS_RIDX, BK,
                      TMA_DY, TMA_X, UPCAST, IEEE)  # fmt: skip
    if k == num_k - 1:
        _store(acc, out_ptr, e, n0, d0, N, D)
        acc = tl.zeros((BN, BD), dtype=tl.float32)
    k = tl.where(k == num_k - 1, 0, k + 1)
    return acc, (k, tile, e, start, end, num_k, n0, d0)


@triton.jit
def _tile(tile, starts, ends, steps, idx, per_e, num_d, BN: tl.constexpr,
          BD: tl.constexpr):  # fmt: skip
    """(expert, its first and end row, its K steps, the first output row n0 and column d0) of
    a tile, from the groups' (BLOCK_E,) vectors."""
    e = tile // per_e
    start = _pick(starts, idx, e)
    end = _pick(ends, idx, e)
    num_k = _pick(steps, idx, e)
    return e, start, end, num_k, ((tile % per_e) // num_d) * BN, (tile % num_d) * BD


@triton.jit
def _accumulate(acc, r0, end, dy_ptr, x_ptr, ridx_ptr, dy_desc, x_desc, T, stride_dyp,
                stride_dyn, stride_xt, stride_xd, n0, d0, N, D, HAS_RIDX: tl.constexpr,
                BK: tl.constexpr, TMA_DY: tl.constexpr, TMA_X: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """acc + dy[r0:r0+BK, n0:n0+BN].T @ x[src[r0:r0+BK], d0:d0+BD], rows at or past ``end``
    (or with a source outside [0, T)) adding nothing."""
    BN: tl.constexpr = acc.shape[0]
    BD: tl.constexpr = acc.shape[1]
    rows = r0 + tl.arange(0, BK)
    live = rows < end
    if HAS_RIDX:
        src = tl.load(ridx_ptr + rows, mask=live, other=-1).to(tl.int64)
        live = live & (src >= 0) & (src < T)
    else:
        src = rows.to(tl.int64)
    if TMA_DY:  # rows past the group's end come as zeros
        dy = load_ragged(dy_desc, r0, end - r0, [0, n0])
    else:
        ns = n0 + tl.arange(0, BN)
        dy = tl.load(
            dy_ptr + rows.to(tl.int64)[:, None] * stride_dyp + ns[None, :] * stride_dyn,
            mask=live[:, None] & (ns < N)[None, :],
            other=0.0,
        )
    if TMA_X:  # rows past the group's end come as zeros
        x = load_ragged(x_desc, r0, end - r0, [0, d0])
    else:
        ds = d0 + tl.arange(0, BD)
        x = tl.load(
            x_ptr + src[:, None] * stride_xt + ds[None, :] * stride_xd,
            mask=live[:, None] & (ds < D)[None, :],
            other=0.0,
        )
    if UPCAST:
        dy = dy.to(tl.float32)
        x = x.to(tl.float32)
    if IEEE:
        return tl.dot(tl.trans(dy), x, acc, input_precision="ieee")
    return tl.dot(tl.trans(dy), x, acc)


@triton.jit
def _store(acc, out_ptr, e, n0, d0, N, D):
    """out[e, n0:n0+BN, d0:d0+BD] = acc (within N and D), cast once."""
    ns = n0 + tl.arange(0, acc.shape[0])
    ds = d0 + tl.arange(0, acc.shape[1])
    out = out_ptr + e.to(tl.int64) * N * D + ns.to(tl.int64)[:, None] * D + ds[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (ds < D)[None, :])


_launcher = FastKernel(_grouped_weight_grad_kernel)


def _descriptor_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor can read t (``tma_ok``), or the interpreter emulates one: its default
    config takes none, so only a config naming them (the tests of the TMA modes on CPU) does."""
    if INTERPRET and not tracing():
        return tma_layout(t)
    return tma_ok(t)


def grouped_weight_grad(
    dy_PN: torch.Tensor,
    x_TD: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: WgradConfig | None = None,
) -> torch.Tensor:
    """(E, N, D) in ``out_dtype``; see ``moe_kernels.grouped_mm.grouped_weight_grad``."""
    num_rows, n = dy_PN.shape
    num_tokens, dim = x_TD.shape
    num_experts = offsets_E1.shape[0] - 1
    out = torch.empty((num_experts, n, dim), dtype=out_dtype, device=dy_PN.device)
    if out.numel() == 0:
        return out
    if num_rows == 0 or num_tokens == 0:
        return out.zero_()
    cfg = config or wgrad_config(n, dim, INTERPRET, x_TD.dtype == torch.float32)
    tma = (cfg.tma != "none" and row_indices_P is None and dy_PN.dtype == torch.bfloat16
           and create_ragged_descriptor is not None and num_rows <= 2**30  # its row bound
           and _descriptor_ok(dy_PN) and _descriptor_ok(x_TD))  # fmt: skip
    tma_dy, tma_x = tma and cfg.tma == "both", tma
    dy_desc = create_ragged_descriptor(dy_PN, [cfg.block_k, cfg.block_n]) if tma_dy else None
    x_desc = create_ragged_descriptor(x_TD, [cfg.block_k, cfg.block_d]) if tma_x else None
    tiles = num_experts * cdiv(n, cfg.block_n) * cdiv(dim, cfg.block_d)
    sms = num_sms(dy_PN.get_device()) if dy_PN.is_cuda else 4
    programs = max(1, min(tiles, sms * cfg.programs_per_sm))
    args = (
        dy_PN,
        x_TD,
        offsets_E1,
        row_indices_P if row_indices_P is not None else offsets_E1,
        out,
        dy_desc,
        x_desc,
        num_tokens,
        num_rows,
        n,
        dim,
        num_experts,
        programs,
        dy_PN.stride(0),
        dy_PN.stride(1),
        x_TD.stride(0),
        x_TD.stride(1),
    )
    constexprs = dict(
        HAS_RIDX=row_indices_P is not None,
        BN=cfg.block_n,
        BD=cfg.block_d,
        BK=cfg.block_k,
        BLOCK_E=next_pow2(num_experts),
        TMA_DY=tma_dy,
        TMA_X=tma_x,
        UPCAST=INTERPRET,
        IEEE=x_TD.dtype == torch.float32,
        WHILE_LOOPS=INTERPRET,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher.launch((programs,), args, constexprs, **options)
    return out
