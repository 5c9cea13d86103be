"""Kernel B: exclusive scans of the (local experts, programs) histogram rows over programs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK: tl.constexpr):
    """Programs [c, c + CHUNK) of the hist rows -> their exclusive prefix plus carry; returns
    carry plus the chunk's totals."""
    idx = c + tl.arange(0, CHUNK)
    ok = l_ok[:, None] & (idx[None, :] < n_programs)
    h = tl.load(rows + idx[None, :], mask=ok, other=0)
    incl = tl.cumsum(h, axis=1)
    tl.store(rows + idx[None, :], incl - h + carry[:, None], mask=ok)
    return carry + tl.sum(h, axis=1)


@triton.jit
def scan_kernel(
    hist_ptr,
    counts_ptr,
    L,
    n_programs,
    BLOCK_L: tl.constexpr,
    CHUNK: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """Rows of hist (pairs per program), BLOCK_L experts per program -> their exclusive prefix
    over programs; counts[l] = the row's total."""
    ls = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = ls < L
    rows = hist_ptr + ls[:, None] * n_programs
    carry = tl.zeros([BLOCK_L], dtype=tl.int32)
    if WHILE_LOOPS:
        c = n_programs * 0
        while c < n_programs:
            carry = _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK)
            c += CHUNK
    else:
        for c in range(0, n_programs, CHUNK):
            carry = _scan_chunk(rows, l_ok, c, n_programs, carry, CHUNK)
    tl.store(counts_ptr + ls, carry, mask=l_ok)
