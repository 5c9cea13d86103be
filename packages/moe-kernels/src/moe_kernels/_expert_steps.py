"""The launches the routed experts' autograd nodes (``expert_mlp``, ``routed_experts``) are built
from: each a ``KernelOp.call`` of a public op (its implementation directly in plain eager mode,
no dispatcher round trip a launch; the registered op otherwise, what torch.compile traces).
The node validates its arguments once; nothing here checks them again."""

from __future__ import annotations

import torch

from moe_kernels.activation import expert_activation_op
from moe_kernels.grouped_mm import gather_grouped_mm_op, grouped_weight_grad_op
from moe_kernels.tokens import combine_op, dispatch_op, gather_dots_op


def sorted_mm(x, w, offsets, rows, act="none", zero_tail=True):
    """``gather_grouped_mm``'s launch (rows: None for sorted rows, else the gather; act: "none"
    or "silu" on the accumulator): on sorted rows the persistent Triton GEMM or CUTLASS where
    they run (``_gemm_plan.choose_gemm``), else the gathering Triton GEMM.
    ``zero_tail=False`` for intermediates whose rows past the groups nothing reads (the grouped
    GEMMs read group rows only, the k-sums and combines skip unrouted rows): the GEMM then leaves
    them unwritten."""
    return gather_grouped_mm_op.call(x, w, offsets, rows, act, zero_tail)


def activation(h, gated):
    """``expert_activation``'s launch (no autograd)."""
    return expert_activation_op.call(h, gated)


def gather(x_ND, rows_R):
    """xs[r] = x[rows[r]] (zero for -1): ``dispatch``'s copy kernel."""
    unused_weights = x_ND.new_empty(0, dtype=torch.float32)
    return dispatch_op.call(x_ND, rows_R, unused_weights, rows_R, False)


def _sum_choices(dx_RD, inverse_NK, rows, out_dtype):
    """dx[n] = sum over j of dx_R[inverse[n, j]] in fp32, j order (``combine``, unweighted)."""
    unused_weights = dx_RD.new_empty(0, dtype=torch.float32)
    return combine_op.call(dx_RD, inverse_NK, rows, unused_weights, False, out_dtype)


def combine_rows(o_RD, inverse_NK, rows_R, weights_R, out_dtype):
    """y[n] = sum over j of weights[r] o[r], r = inverse[n, j], in fp32, j order (``combine``)."""
    return combine_op.call(o_RD, inverse_NK, rows_R, weights_R, True, out_dtype)


def gather_grad_rows(dy_ND, rows_R, dtype):
    """dY[rows[r]] in ``dtype`` (zero for -1): ``combine``'s backward, unscaled. The row copy
    kernel where no cast is needed (it ran 83 against 107 us for the other at the Qwen3 layer's
    65536 rows of 2048 on the H200: ``train_gpu.py --shapes=qwen3 --profile``)."""
    if dy_ND.dtype == dtype:
        return gather(dy_ND, rows_R)
    return gather_dots_op.call(None, dy_ND, rows_R, None, dtype)[0]


def weight_grad(dy_RN, x_RD, offsets, rows, out_dtype):
    """``grouped_weight_grad``'s launch: per expert ``dy_e.T @ x_e`` (rows: None for sorted rows,
    else the gather), (E, N, D) in ``out_dtype``."""
    return grouped_weight_grad_op.call(dy_RN, x_RD, offsets, rows, out_dtype)


def input_grads(dh_RX, x_ND, xs_RD, w_in, offsets, rows_R, inverse_NK, want_x, want_in):
    """(dx (N, D), dw_in (E, X, D)) from the up-projection's output gradient dh_RX (None where
    not wanted): ``dw_in[e] = dh_e.T @ xs_e`` (xs gathered from x_ND again when ``xs_RD`` is
    None), ``dx[n] = sum over j of (dh @ w_in[e])[inverse[n, j]]`` in j order, fp32."""
    grad_x = grad_in = None
    if want_in:
        src, rows = (xs_RD, None) if xs_RD is not None else (x_ND, rows_R)
        grad_in = weight_grad(dh_RX, src, offsets, rows, w_in.dtype)
    if want_x:
        dx_RD = sorted_mm(dh_RX, w_in.mT, offsets, None, zero_tail=False)
        grad_x = _sum_choices(dx_RD, inverse_NK, rows_R, dh_RX.dtype)
    return grad_x, grad_in
