"""What the MoE implementations (``moe_model.impls``) are built from: their experts' input
(``ExpertRows``), row gathers with a fixed-order backward, torch's grouped GEMM and expert
activation.

Shapes: T tokens, k choices, P = T * k pairs, E experts (L of them local), R rows grouped by
expert, D model width, H' the first GEMM's width (2H gated), N the rows of a gather's source.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_kernels import RoutingPlan, dispatch

ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what moe_kernels.dispatch moves


class ExpertRows(NamedTuple):
    """The experts' input: R rows grouped by expert, as a gather from ``source``.

    source:         (N, D): the rows read: the layer's tokens, or under expert parallelism the
                    rows this rank received.
    source_indices: (R,) int: the source row of each grouped row (-1: a zero row).
    inverse:        (N, K) int: the grouped rows that read source row n (-1 for none), what the
                    gather's backward sums, in K order; None where no backward runs (fbgemm).
    offsets:        (L+1,) int32: group bounds on the device (offsets[0] = 0).
    expert_indices: (R,) int: the expert (0..L-1) of each grouped row.
    host_offsets:   (L+1,) Python ints where known without a host sync, else None.
    """

    source: torch.Tensor
    source_indices: torch.Tensor
    inverse: torch.Tensor | None
    offsets: torch.Tensor
    expert_indices: torch.Tensor
    host_offsets: list[int] | None


# ---------------------------------------------------------------------------------------------
# Row gathers: out[m] = x[src[m]], backward through dst_NK (the out rows that read x row n)


class _GatherRows(torch.autograd.Function):
    """index_select forward; backward: each source row's gradient rows gathered through dst_NK
    and summed over K by one reduction (in fp32 or wider): no scatter, so no atomics."""

    @staticmethod
    def forward(ctx, x_ND, src_M, dst_NK):
        ctx.save_for_backward(dst_NK)
        ok_M = src_M >= 0
        rows_MD = x_ND.index_select(0, torch.where(ok_M, src_M, 0).long())
        return torch.where(ok_M[:, None], rows_MD, 0)

    @staticmethod
    def backward(ctx, grad_MD):
        (dst_NK,) = ctx.saved_tensors
        ok_NK = dst_NK >= 0
        rows_NKD = grad_MD[torch.where(ok_NK, dst_NK, 0).long()]
        acc = torch.promote_types(grad_MD.dtype, torch.float32)
        grad_ND = torch.where(ok_NK[..., None], rows_NKD, 0).sum(dim=1, dtype=acc)
        return grad_ND.to(grad_MD.dtype), None, None


def gather_rows(x_ND: torch.Tensor, src_M: torch.Tensor, dst_NK: torch.Tensor) -> torch.Tensor:
    """(M, D) in x's dtype: ``out[m] = x[src[m]]``, zero for src -1; ``dst_NK`` (N, K): the out
    rows that read x row n (-1 for none). Plain torch, any float dtype; differentiable in x with
    a deterministic backward (torch's own ``x[src]`` backward adds with atomics on CPU)."""
    return _GatherRows.apply(x_ND, src_M, dst_NK)


def move_rows(x_ND: torch.Tensor, src_M: torch.Tensor, dst_NK: torch.Tensor) -> torch.Tensor:
    """``gather_rows`` by ``moe_kernels.dispatch`` (a Triton gather on CUDA; its backward an
    fp32 ``combine`` in K order) for the dtypes it moves, else (float64) ``gather_rows``."""
    if x_ND.dtype not in ROW_DTYPES:
        return gather_rows(x_ND, src_M, dst_NK)
    ones_M = torch.ones(src_M.shape[0], dtype=torch.float32, device=src_M.device)
    # A plan that only dispatch reads: token_indices = src, inverse = dst, unit weights.
    return dispatch(x_ND, RoutingPlan(src_M, src_M, src_M, src_M, ones_M, dst_NK))


# ---------------------------------------------------------------------------------------------
# Grouped GEMM: torch._grouped_mm where it runs, else a static loop.

GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# torch._grouped_mm on CPU: torch <= 2.8 has no CPU kernel, torch 2.9 and 2.10 need 16-byte
# aligned data pointers (a check torch.compile cannot trace). From 2.11 a static rule suffices.
_CPU_GROUPED_MM = hasattr(torch, "_grouped_mm") and torch.__version__ >= (2, 11)


def _grouped_mm_strides_ok(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule for an operand (its meta check): the last two dims
    row- or column-major, the other stride a multiple of 16 bytes."""
    align = 16 // t.element_size()
    s_rows, s_cols = t.stride()[-2:]
    n_rows, n_cols = t.shape[-2:]
    if s_rows == 1 and s_cols >= max(1, n_rows):
        return s_cols % align == 0
    if s_cols == 1 and s_rows >= max(1, n_cols):
        return s_rows % align == 0
    return False


def grouped_mm_supported(a_MK: torch.Tensor, b_EKN: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs a @ b[e], forward and backward. CUDA: sm90+, bf16
    operands, K and N % 16. CPU: torch 2.11+, a and b of one dtype among float32, bfloat16 and
    float16 (bfloat16 alone under torch.compile: the op's fake kernel refuses the others), K and
    N multiples of 16 bytes, each operand row- or column-major with its other stride a multiple
    of 16 bytes. A static rule (shapes, strides, dtypes, the torch version): no data pointer."""
    if not hasattr(torch, "_grouped_mm") or a_MK.dtype != b_EKN.dtype:
        return False
    if a_MK.device.type == "cpu":
        if not _CPU_GROUPED_MM or a_MK.dtype not in GROUPED_MM_CPU_DTYPES:
            return False
        if torch.compiler.is_compiling() and a_MK.dtype != torch.bfloat16:
            return False
        align = 16 // a_MK.element_size()
        if a_MK.shape[1] % align or b_EKN.shape[2] % align:
            return False
        return _grouped_mm_strides_ok(a_MK) and _grouped_mm_strides_ok(b_EKN)
    if a_MK.device.type != "cuda" or a_MK.dtype != torch.bfloat16:
        return False
    # get_device_properties (not get_device_capability) is constant-folded by dynamo.
    if torch.cuda.get_device_properties(a_MK.device).major < 9:
        return False
    return a_MK.shape[1] % 16 == 0 and b_EKN.shape[2] % 16 == 0


class _GroupedMM(torch.autograd.Function):
    """CPU: ``torch._grouped_mm`` with the rows in no group (after offsets[-1], which the op leaves
    unwritten) zeroed in place, in the output and in a's gradient; the backward's GEMMs on a
    contiguous gradient (the op refuses the stride-0 one ``y.sum().backward()`` sends)."""

    @staticmethod
    def forward(ctx, a_MK, b_EKN, offs_E, tail_M1):
        ctx.save_for_backward(a_MK, b_EKN, offs_E, tail_M1)
        return torch._grouped_mm(a_MK, b_EKN, offs=offs_E).masked_fill_(tail_M1, 0)

    @staticmethod
    def backward(ctx, grad_MN):
        a_MK, b_EKN, offs_E, tail_M1 = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch._grouped_mm(grad_MN, b_EKN.mT, offs=offs_E).masked_fill_(tail_M1, 0)
        if ctx.needs_input_grad[1]:
            # In b's layout (b = w.mT: the weight gradient of w directly, as torch's own).
            if b_EKN.stride(-2) == 1:
                grad_b = torch._grouped_mm(grad_MN.mT, a_MK, offs=offs_E).mT
            else:
                grad_b = torch._grouped_mm(a_MK.mT, grad_MN, offs=offs_E)
        return grad_a, grad_b, None, None


def grouped_mm(
    a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets: torch.Tensor, expert_M: torch.Tensor
) -> torch.Tensor:
    """Rows of ``a_MK`` grouped by expert times that expert's ``b_EKN[e]`` -> (M, N), a's dtype.

    offsets: (E+1,) int32 exclusive prefix sum of group sizes; expert_M: (M,) expert of each row
    (-1 or any id outside [0, E) for rows in no group, which follow row offsets[-1]: their
    output rows are zero, and so are their gradient rows).
    """
    b_EKN = b_EKN.to(a_MK.dtype)
    if grouped_mm_supported(a_MK, b_EKN):
        # The rows in no group, as a mask on the device (no host sync).
        tail_M1 = (torch.arange(a_MK.shape[0], device=a_MK.device) >= offsets[-1]).unsqueeze(1)
        offs_E = offsets[1:].to(torch.int32)
        if a_MK.is_cuda:  # torch's own backward: _GroupedMM's hit an alignment assert on the H100
            return torch._grouped_mm(a_MK, b_EKN, offs=offs_E).masked_fill(tail_M1, 0)
        return _GroupedMM.apply(a_MK, b_EKN, offs_E, tail_M1)
    # Static-shape fallback (float64, older torch, older GPUs, CPU float32 under torch.compile):
    # every expert's GEMM over all rows, keep the rows of that expert. E times the FLOPs, but no
    # data-dependent shape and no host sync.
    out_MN = a_MK.new_zeros(a_MK.shape[0], b_EKN.shape[2])
    for e in range(b_EKN.shape[0]):
        rows_M1 = (expert_M == e).unsqueeze(1)
        out_MN = torch.where(rows_M1, a_MK @ b_EKN[e], out_MN)
    return out_MN


def grouped_mlp(
    xs_RD: torch.Tensor,
    in_proj: torch.Tensor,
    out_proj: torch.Tensor,
    gated: bool,
    offsets: torch.Tensor,
    expert_R: torch.Tensor,
) -> torch.Tensor:
    """The experts' MLP on rows grouped by expert, in torch: ``grouped_mm`` with ``in_proj``
    (L, H', D), the activation, ``grouped_mm`` with ``out_proj`` (L, D, H) -> (R, D)."""
    h_RH = grouped_mm(xs_RD, in_proj.mT, offsets, expert_R)
    return grouped_mm(activation(h_RH, gated), out_proj.mT, offsets, expert_R)


def activation(h_MH: torch.Tensor, gated: bool) -> torch.Tensor:
    """SiLU, or SwiGLU ``silu(gate) * up`` with gate = first half of the columns; fp32 math
    (torch's silu computes bf16 inputs in fp32 and rounds once)."""
    if not gated:
        return F.silu(h_MH)
    gate_MH, up_MH = h_MH.float().chunk(2, dim=-1)
    return (F.silu(gate_MH) * up_MH).to(h_MH.dtype)
