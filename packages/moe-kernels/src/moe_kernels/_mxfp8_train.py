"""The backward of ``moe_kernels.mxfp8_grouped_mm``: torchao's MXFP8 training recipe.

Forward (``mxfp8.py``): ``Y[m] = q_K(A)[m] @ q_K(B[g])`` for the rows m of group g, A (M, K) cast
row-wise along K, each B[e] (K, N) column-wise along K. Backward, for the upstream gradient dY (M,
N) (every cast rceil, the forward's numerics, see ``moe_kernels.mxfp8``):

* dA = q_N(dY) @ q_N(B[g]).T per group: dY cast row-wise along N, each B[e] row-wise along N (the
  same MXFP8 grouped GEMM as the forward, of dY with B^T (E, N, K)). Rows past offsets[-1] get 0.
  N need not be a multiple of 32: the last block along N is then partial, as if dY and B were
  zero-padded to a multiple of 32 (zeros change no block's amax); torchao requires N % 32 == 0.
* dB[e] = q_M(A_e).T @ q_M(dY_e) over the rows of group e, both cast column-wise (``to_mxfp8_dim1``,
  along the tokens) in blocks of 32 rows that start at each group's start. For that, each group's
  rows are copied to a padded layout whose groups start at multiples of 32 (zero rows between
  them; the same rule as ``compute_per_group_blocked_scale_offsets`` with 32 for its 128, and
  the same blocks as in its 128-row layout, which only adds all-zero blocks). The layout has a
  static size, (M + 31 E) // 32 * 32 rows, an upper bound of sum_e ceil(size_e / 32) * 32, so
  nothing reads the offsets on the host. Rows past offsets[-1] take no part.

Each product is emulated exactly on every device: the casts are dequantised (to bf16, exact for
every block whose amax is above about 2**-116) and multiplied with fp32 accumulation, the result
rounded once to the input's dtype: dA by the forward's emulation GEMM (``torch._grouped_mm`` on
CUDA sm90+, else a per-expert masked GEMM), dB by ``grouped_weight_grad`` (K-grouped CUTLASS GEMM
on sm90+ bf16, else its Triton kernel, or the torch reference on CPU). Deterministic (no
atomics, fixed orders: identical inputs give bitwise-identical gradients), sync-free, static
shapes (safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture).

On compute capability 10.x torchao runs both with ``torch._scaled_grouped_mm`` on the e4m3 data:
dA as a 2d-3d grouped GEMM (dY data (M, N), B's (E, N, K) with ``to_blocked_per_group_2d`` /
``to_blocked_per_group_3d`` scales), dB as a 2d-2d one grouped along the contraction (dY^T data
(N, Mp) times A's (Mp, K) with offs = the padded group ends, scales in a per-K-group blocked
layout, each group's scale columns padded to 4). That path is not implemented: it could not be
tested here (no sm100), and the emulation above has its numerics.

Memory: ``setup_context`` saves a, b and offsets (the inputs themselves, no copy and nothing
quantised); the casts are recomputed in the backward, whose transient buffers are the padded
copies of A and dY ((M + 31 E) x (K + N) elements), their casts and bf16 dequantisations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels._dispatch import register_op
from moe_kernels._gemm_plan import plan_dequantized
from moe_kernels.grouped_mm import grouped_weight_grad
from moe_kernels.mxfp8_casts import from_mxfp8, to_mxfp8, to_mxfp8_dim1
from moe_kernels.reference import mxfp8 as _ref
from moe_kernels.reference.grouped_mm import clamp_group_ends

BLOCK = 32


def setup_context(ctx, inputs, output) -> None:
    a, b, offsets, _out_dtype = inputs
    ctx.save_for_backward(a, b, offsets)


def backward(ctx, grad_out: torch.Tensor):
    a, b, offsets = ctx.saved_tensors
    grad_a = grad_b = None
    if b.shape[0] == 0:  # no experts: the forward was all zeros
        return (
            torch.zeros_like(a) if ctx.needs_input_grad[0] else None,
            torch.zeros_like(b) if ctx.needs_input_grad[1] else None,
            None,
            None,
        )
    offsets = clamp_group_ends(offsets, a.shape[0]).to(torch.int32)  # the forward's rule
    if ctx.needs_input_grad[0]:
        grad_a = grad_input(grad_out, b, offsets, a.dtype)
    if ctx.needs_input_grad[1]:
        grad_b = grad_weight(grad_out, a, offsets, b.dtype)
    return grad_a, grad_b, None, None


def _dequantized(x: torch.Tensor, dim1: bool) -> torch.Tensor:
    """The bf16 dequantisation of x's MXFP8 cast: row-wise (``to_mxfp8``, (M, K)), or column-wise
    (``to_mxfp8_dim1``, returned transposed: (K, M))."""
    data, scale = to_mxfp8_dim1(x) if dim1 else to_mxfp8(x)
    return from_mxfp8(data, scale, torch.bfloat16)


def grad_input(
    grad_out: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dA (M, K) ``dtype``: q_N(dY) @ q_N(b[g]).T for the rows of group g, zero past offsets[-1]."""
    E, K, N = b.shape
    if N % BLOCK:  # a partial last block: zero padding along N
        pad = BLOCK - N % BLOCK
        grad_out, b = F.pad(grad_out, (0, pad)), F.pad(b, (0, pad))
        N += pad
    dy_dq = _dequantized(grad_out, dim1=False)  # (M, N)
    b_dq = _dequantized(b.reshape(E * K, N), dim1=False).view(E, K, N).transpose(-2, -1)
    return dequantized_grouped_mm(dy_dq, b_dq, offsets, dtype)


def zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out with its rows at or past offsets[-1] zeroed (out of place)."""
    rows = torch.arange(out.shape[0], device=out.device, dtype=offsets.dtype)
    return torch.where((rows < offsets[-1])[:, None], out, out.new_zeros(()))


def dequantized_grouped_mm(
    a_dq: torch.Tensor, b_dq: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The MXFP8 emulation's GEMM of exact bf16 dequantisations, the forward's and dA's: a_dq
    (M, K) @ b_dq[e] (E, K, N) for the rows of group e (offsets (E,) int32 clamped ends),
    fp32-accumulated, rounded once to ``out_dtype``, zero tail rows; the kernel by
    ``_gemm_plan.plan_dequantized`` (CUTLASS, or a per-expert masked GEMM)."""
    if plan_dequantized(a_dq, b_dq, out_dtype).kernel == "cutlass":
        out = torch._grouped_mm(a_dq, b_dq, offs=offsets, out_dtype=out_dtype)
        return zero_tail(out, offsets)
    return _ref.grouped_mm_dequantized(a_dq, b_dq, offsets, out_dtype)


def _padded_rows_impl(
    offsets: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 32-row-aligned group layout of (E,) end offsets over ``num_rows`` rows.

    Returns src (Mp,) int64, the source row of every padded row (0 where ``valid`` is False),
    valid (Mp,) bool, and starts (E + 1,) int64, the padded group starts with starts[0] = 0 and
    starts[e + 1] = starts[e] + ceil(size_e / 32) * 32; Mp = (num_rows + 31 E) // 32 * 32.
    Each end offset is clamped into [previous clamped end, num_rows] to stay memory-safe (the
    forward's rule: invalid offsets give unspecified groups, the same in both). E >= 1.
    Under ``torch.compile`` an opaque op (``padded_rows``).
    """
    E = offsets.shape[0]
    ends = clamp_group_ends(offsets, num_rows)
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - begins
    starts = torch.cat([ends.new_zeros(1), torch.cumsum((sizes + BLOCK - 1) // BLOCK * BLOCK, 0)])
    Mp = (num_rows + (BLOCK - 1) * E) // BLOCK * BLOCK
    rows = torch.arange(Mp, device=offsets.device, dtype=torch.int64)
    g = torch.searchsorted(starts[1:], rows, right=True)  # E for rows past the last group
    gc = g.clamp(max=E - 1)
    local = rows - starts[gc]
    valid = (g < E) & (local < sizes[gc])
    src = torch.where(valid, begins[gc] + local, 0)
    return src, valid, starts


def _padded_rows_fake(offsets: torch.Tensor, num_rows: int):
    E = offsets.shape[0]
    Mp = (num_rows + (BLOCK - 1) * E) // BLOCK * BLOCK
    i64 = dict(dtype=torch.int64, device=offsets.device)
    return (
        torch.empty(Mp, **i64),
        torch.empty(Mp, dtype=torch.bool, device=offsets.device),
        torch.empty(E + 1, **i64),
    )


# Opaque under torch.compile: Inductor (torch 2.11, CUDA) compiled this index arithmetic into
# wrong group ids, so the compiled weight gradient was wrong (docs/compile-cold-start.md); a
# few tiny launches a backward.
mxfp8_padded_rows_op = register_op(
    "mxfp8_padded_rows", _padded_rows_impl, _padded_rows_fake, traced=False
)


def padded_rows(
    offsets: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_padded_rows_impl`` through its op (opaque under compile)."""
    return mxfp8_padded_rows_op.call(offsets, num_rows)


def _gather_padded(x: torch.Tensor, src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_zeros((src.shape[0], x.shape[1]))
    return torch.where(valid[:, None], x.index_select(0, src), 0).to(x.dtype)


def grad_weight(
    grad_out: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dB (E, K, N) ``dtype``: sum over the rows of group e of outer(q_M(a), q_M(dY))."""
    src, valid, starts = padded_rows(offsets, a.shape[0])
    a_t = _dequantized(_gather_padded(a, src, valid), dim1=True)  # (K, Mp)
    dy_t = _dequantized(_gather_padded(grad_out, src, valid), dim1=True)  # (N, Mp)
    return grouped_weight_grad(a_t.t(), dy_t.t(), starts, out_dtype=dtype)
