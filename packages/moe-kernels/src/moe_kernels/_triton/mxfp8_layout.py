"""Triton kernels for the cuBLAS blocked (128 x 4 tile) MX scale layout, with their launchers.

One program per (output 128-row tile, column chunk): it loads a (128, BLOCK_C) slab of scales
(zero outside the matrix / group), permutes it in registers into tile order
(tile column, r % 32, r // 32, c) and writes it as one contiguous run of 128 * BLOCK_C bytes.
For the per-group 2d layout the grid is static (R / 128 + G tiles): every program rebuilds the
group start rows from the (G,) end offsets in registers (a cumsum over G), finds its group and
exits when it lies past the last group. No host sync, no zero-fill of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import INTERPRET, tracing
from .blocks import cdiv, next_pow2
from .launch import FastKernel, current_stream, fast_path_open


@triton.jit
def _swizzle_tile(x, BLOCK_C: tl.constexpr):
    """(128, BLOCK_C) -> flat (128 * BLOCK_C,) in blocked order."""
    t = tl.reshape(x, (4, 32, BLOCK_C // 4, 4))
    t = tl.permute(t, (2, 1, 0, 3))
    return tl.reshape(t, (128 * BLOCK_C,))


@triton.jit
def _store_tile(out_ptr, tile_base, x, Cp, BLOCK_C: tl.constexpr):
    pid_c = tl.program_id(1)
    flat = tl.arange(0, 128 * BLOCK_C)
    base = tile_base + pid_c * (BLOCK_C * 128)
    tl.store(
        out_ptr + base + flat,
        _swizzle_tile(x, BLOCK_C),
        (flat // 512) < (Cp // 4 - pid_c * (BLOCK_C // 4)),
    )


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _group_layout(ends, prev, gmask, bound):
    """(starts, sizes, cum) as (GP,) int32 from the loaded (GP,) end offsets ``ends`` and
    ``prev`` (the previous group's end, 0 for the first): group g holds input rows [starts[g],
    starts[g] + sizes[g]), cum[g] = start_rows[g + 1]. Each end is clamped into [previous
    clamped end, bound] (``reference.grouped_mm.clamp_group_ends``): the running maximum of the
    offsets clamped into [0, bound], in the offsets' own dtype before the int32 cast (int64
    values past int32 saturate, never wrap). (The kernels load the offsets themselves: a
    helper's results derived from a pointer argument make Inductor's mutation analysis count
    the pointer as written.)"""
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), bound).to(tl.int32), 0, _max_fn)
    starts = tl.associative_scan(tl.minimum(tl.maximum(prev, 0), bound).to(tl.int32), 0, _max_fn)
    sizes = tl.where(gmask, ends - starts, 0)
    cum = tl.cumsum((sizes + 127) // 128 * 128, axis=0)
    return starts, sizes, cum


@triton.jit
def _group_offsets_kernel(ends_ptr, sizes_ptr, start_rows_ptr, G, bound, GP: tl.constexpr):
    gi = tl.arange(0, GP)
    gmask = gi < G
    ends = tl.load(ends_ptr + gi, mask=gmask, other=0)
    prev = tl.load(ends_ptr + gi - 1, mask=gmask & (gi > 0), other=0)
    _, sizes, cum = _group_layout(ends, prev, gmask, bound)
    tl.store(sizes_ptr + gi, sizes, gmask)
    tl.store(start_rows_ptr + gi, tl.zeros_like(gi), gi == 0)
    tl.store(start_rows_ptr + 1 + gi, cum, gmask)


@triton.jit
def _blocked_2d_groups_kernel(
    s_ptr,
    ends_ptr,
    out_ptr,
    start_rows_ptr,
    R,
    C,
    Cp,
    G,
    stride_s,
    GP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Groups clamped into [0, R] (``_group_layout``): every source row read is < R, and every
    tile written lies below start_rows[G] <= R + 127 G, inside the (R + 128 G, Cp) output."""
    tile = tl.program_id(0)
    gi = tl.arange(0, GP)
    gmask = gi < G
    ends = tl.load(ends_ptr + gi, mask=gmask, other=0)
    prev = tl.load(ends_ptr + gi - 1, mask=gmask & (gi > 0), other=0)
    starts, sizes, cum = _group_layout(ends, prev, gmask, R)
    if (tile == 0) & (tl.program_id(1) == 0):
        tl.store(start_rows_ptr + gi, tl.zeros_like(gi), gi == 0)
        tl.store(start_rows_ptr + 1 + gi, cum, gmask)
    row0 = tile * 128
    g = tl.sum(((cum <= row0) & gmask).to(tl.int32), axis=0)  # groups wholly before this tile
    if g < G:
        start_row = tl.sum(tl.where(gi == g - 1, cum, 0), axis=0)
        in_start = tl.sum(tl.where(gi == g, starts, 0), axis=0)
        size = tl.sum(tl.where(gi == g, sizes, 0), axis=0)
        local = row0 - start_row + tl.arange(0, 128)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        src = (in_start + local).to(tl.int64) * stride_s
        mask = (local[:, None] < size) & (cols[None, :] < C)
        x = tl.load(s_ptr + src[:, None] + cols[None, :], mask=mask, other=0)
        _store_tile(out_ptr, row0.to(tl.int64) * Cp, x, Cp, BLOCK_C)


@triton.jit
def _blocked_3d_kernel(
    s_ptr,
    out_ptr,
    N,
    C,
    Cp,
    n_tiles,
    stride_se,
    stride_sn,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    e = (pid // n_tiles).to(tl.int64)
    t = pid % n_tiles
    rows = t * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < N) & (cols[None, :] < C)
    ptrs = s_ptr + e * stride_se + rows[:, None].to(tl.int64) * stride_sn + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0)
    tile_base = (e * n_tiles + t) * 128 * Cp
    _store_tile(out_ptr, tile_base, x, Cp, BLOCK_C)


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _block_c(C: int, block_c: int | None, warps: int | None = None) -> tuple[int, int]:
    """Column chunk (a power of two >= 4) and warps (``block_c``, ``warps`` override). Rows whose
    length is a multiple of 4 take wide chunks, even where the last one is partly masked (H200,
    131072 x 224 scales: 128 -> 1.20x a clone, 64 -> 1.32x, 32 -> 1.45x; 256 columns: 128 ->
    1.11x, 32 -> 1.97x); other rows are read a byte at a time and take chunks of 8 (C = 37:
    (524288, 37) G=8 18.9 us against 29.2 with 64; (64, 7168, 37) 13.2 against 20.0). Chunks
    of at most 8 columns take one warp ((524288, 8) G=40: 5.6 us against 8.2 with four). Under
    the interpreter the whole row in one chunk."""
    Cp = _ceil_to(C, 4)
    if block_c is None:
        if INTERPRET:
            block_c = max(4, next_pow2(Cp))
        elif C % 4:
            block_c = min(8, max(4, next_pow2(Cp)))
        else:
            block_c = min(128, max(4, next_pow2(Cp)))
    if warps is None:
        warps = 1 if block_c <= 8 else 4 if block_c <= 32 else 8
    return block_c, warps


_group_offsets = FastKernel(_group_offsets_kernel)
_blocked_2d_groups = FastKernel(_blocked_2d_groups_kernel)
_blocked_3d = FastKernel(_blocked_3d_kernel)

# Eager calls: a layout call's host time (argument keys, grid and block arithmetic, launch
# options) was 2-4x a clone's on the H200's host, which bounded the small layouts. So each call
# signature (sizes, strides, dtypes, pointer alignments, device, launch overrides) binds its
# compiled handle, grid and integer arguments once; a bound call allocates its outputs and
# launches the handle on the tensors' addresses. The key pins everything Triton
# specialised on (fresh outputs come aligned from the caching allocator).
_BOUND: dict[tuple, tuple] = {}
_MAX_BOUND = 256


def _bound_launch(key: tuple | None, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Relaunch the handle bound to ``key`` on ``tensors`` (inputs, then outputs); False where
    nothing is bound, there is no key (tracing) or direct launches are closed (interpreter,
    launch hooks)."""
    hit = None if key is None else _BOUND.get(key)
    if hit is None or not fast_path_open():
        return False
    h, grid, ints = hit
    ptrs = [t.data_ptr() for t in tensors]
    h.go(grid[0], grid[1], 1, current_stream(key[0]), *h.pre, *ptrs, *ints, *h.tail)
    return True


def _launch(kernel: FastKernel, key: tuple | None, grid: tuple, tensors: tuple, ints: tuple,
            constexprs: dict, warps: int) -> None:  # fmt: skip
    h = kernel.launch(grid, (*tensors, *ints), constexprs, num_warps=warps)
    if h is not None and key is not None and len(_BOUND) < _MAX_BOUND:
        _BOUND[key] = (h, grid, ints)


def group_offsets(group_end_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G,) end offsets -> sizes (G,) int32, start_rows (G + 1,) int32; the ends clamped into
    [previous clamped end, 2**31 - 1 - 127 G] (start_rows cannot overflow)."""
    G = group_end_offsets.shape[0]
    dev = group_end_offsets.device
    sizes = torch.empty(G, dtype=torch.int32, device=dev)
    start_rows = torch.empty(G + 1, dtype=torch.int32, device=dev)
    bound = 2**31 - 1 - 127 * G  # reference.mxfp8.offsets_bound
    _group_offsets.launch(
        (1,), (group_end_offsets, sizes, start_rows, G, bound), dict(GP=max(2, next_pow2(G)))
    )
    return sizes, start_rows


def to_blocked_per_group_2d(
    scale_RC: torch.Tensor,
    group_end_offsets: torch.Tensor,
    *,
    block_c: int | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) uint8 scales + (G,) end offsets -> ((R + 128 G, Cp) blocked, (G + 1,) start rows);
    the ends clamped into [previous clamped end, R]."""
    if scale_RC.stride(-1) != 1:
        scale_RC = scale_RC.contiguous()
    if scale_RC.dtype != torch.uint8:  # e8m0: no Triton pointer type
        scale_RC = scale_RC.view(torch.uint8)
    (R, C), G, dev = scale_RC.shape, group_end_offsets.shape[0], scale_RC.get_device()
    key = None if tracing() else (
        dev, "2d", R, C, scale_RC.stride(0), G, group_end_offsets.dtype, block_c, warps,
        scale_RC.data_ptr() % 16, group_end_offsets.data_ptr() % 16,
    )  # fmt: skip
    Cp = _ceil_to(C, 4)
    out = torch.empty((R + 128 * G, Cp), dtype=torch.uint8, device=scale_RC.device)
    start_rows = torch.empty(G + 1, dtype=torch.int32, device=scale_RC.device)
    tensors = (scale_RC, group_end_offsets, out, start_rows)
    if not _bound_launch(key, tensors):
        bc, nw = _block_c(C, block_c, warps)
        # at least one column program: program (0, 0) writes start_rows, also where C = 0
        grid = (cdiv(R, 128) + G, max(1, cdiv(Cp, bc)))
        ints = (R, C, Cp, G, scale_RC.stride(0))
        _launch(_blocked_2d_groups, key, grid, tensors, ints,
                dict(GP=max(2, next_pow2(G)), BLOCK_C=bc), nw)  # fmt: skip
    return out, start_rows


def to_blocked_per_group_3d(
    scale_ENC: torch.Tensor, *, block_c: int | None = None, warps: int | None = None
) -> torch.Tensor:
    """(E, N, C) uint8 scales -> (E, Np * Cp), each expert's matrix in the blocked layout."""
    if scale_ENC.stride(-1) != 1:
        scale_ENC = scale_ENC.contiguous()
    if scale_ENC.dtype != torch.uint8:
        scale_ENC = scale_ENC.view(torch.uint8)
    (E, N, C), dev = scale_ENC.shape, scale_ENC.get_device()
    Np, Cp = _ceil_to(N, 128), _ceil_to(C, 4)
    out = torch.empty((E, Np * Cp), dtype=torch.uint8, device=scale_ENC.device)
    if out.numel() == 0:
        return out
    key = None if tracing() else (
        dev, "3d", E, N, C, *scale_ENC.stride()[:2], block_c, warps, scale_ENC.data_ptr() % 16
    )  # fmt: skip
    if not _bound_launch(key, (scale_ENC, out)):
        bc, nw = _block_c(C, block_c, warps)
        n_tiles = Np // 128
        ints = (N, C, Cp, n_tiles, *scale_ENC.stride()[:2])
        _launch(_blocked_3d, key, (E * n_tiles, cdiv(Cp, bc)), (scale_ENC, out), ints,
                dict(BLOCK_C=bc), nw)  # fmt: skip
    return out


def to_blocked(scale_RC: torch.Tensor, *, block_c: int | None = None) -> torch.Tensor:
    """(R, C) uint8 scales -> (Rp, Cp) in the blocked layout (the 3d kernel with E = 1)."""
    R, C = scale_RC.shape
    out = to_blocked_per_group_3d(scale_RC.unsqueeze(0), block_c=block_c)
    return out.view(_ceil_to(R, 128), _ceil_to(C, 4))
