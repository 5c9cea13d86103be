"""The launches the routed experts' autograd nodes (``expert_mlp``, ``routed_experts``) are built
from: each a ``KernelOp.call`` of a public op (its implementation directly in plain eager mode,
no dispatcher round trip a launch; the registered op otherwise, what torch.compile traces).
The node validates its arguments once; nothing here checks them again."""

from __future__ import annotations

import torch

from moe_kernels.activation import expert_activation_op
from moe_kernels.fp8 import fp8_grouped_mm_op
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens_op
from moe_kernels.grouped_mm import gather_grouped_mm_op, grouped_weight_grad_op
from moe_kernels.swiglu import Fp8Rows, silu_mul_quant_op
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


def input_grads(dh_RX, x_ND, xs_RD, w_in, offsets, rows_R, inverse_NK, want_x, want_in,
                fp8=False):  # fmt: skip
    """(dx (N, D), dw_in (E, X, D)) from the up-projection's output gradient dh_RX (None where
    not wanted): ``dw_in[e] = dh_e.T @ xs_e`` (xs gathered from x_ND again when ``xs_RD`` is
    None), ``dx[n] = sum over j of (dh @ w_in[e])[inverse[n, j]]`` in j order, fp32; with
    ``fp8`` the data-gradient GEMM on e4m3 operands (``fp8_mm``)."""
    grad_x = grad_in = None
    if want_in:
        src, rows = (xs_RD, None) if xs_RD is not None else (x_ND, rows_R)
        grad_in = weight_grad(dh_RX, src, offsets, rows, w_in.dtype)
    if want_x:
        if fp8:
            dx_RD = fp8_mm(quantize_rows(dh_RX), w_in.mT, offsets, dh_RX.dtype)
        else:
            dx_RD = sorted_mm(dh_RX, w_in.mT, offsets, None, zero_tail=False)
        grad_x = _sum_choices(dx_RD, inverse_NK, rows_R, dh_RX.dtype)
    return grad_x, grad_in


# --------------------------------------------------------------------------------------------
# FP8 steps (``routed_experts(fp8=True)``): e4m3 operands with FBGEMM's row-wise scales, bf16 or
# the rows' dtype out; each a public op's launch.


def gather_quant(x_ND, rows_R):
    """``Fp8Rows`` of x[rows[r]] (data and scale 0 for -1): one gather-and-quantise pass
    (``gather_scale_quant_dense_tokens`` with unit scores)."""
    zeros_R = torch.zeros_like(rows_R)
    ones_N1 = x_ND.new_ones((1, 1), dtype=torch.float32).expand(x_ND.shape[0], 1)
    return Fp8Rows(*gather_scale_quant_dense_tokens_op.call(x_ND, rows_R, zeros_R, ones_N1,
                                                            None, None))  # fmt: skip


def quantize_rows(v_RK):
    """``Fp8Rows`` of v's rows, row-wise as ``gather_quant`` (the identity gather)."""
    return gather_quant(v_RK, torch.arange(v_RK.shape[0], dtype=torch.int32, device=v_RK.device))


def activation_quant(h_RX, gated):
    """``Fp8Rows`` of SiLU(h) (SwiGLU ``silu(gate) * up`` with ``gated``): ``silu_mul_quant``."""
    if gated:
        H = h_RX.shape[1] // 2
        return Fp8Rows(*silu_mul_quant_op.call(h_RX[:, :H], h_RX[:, H:], None, None))
    ones = h_RX.new_ones((1, 1)).expand(h_RX.shape)
    return Fp8Rows(*silu_mul_quant_op.call(h_RX, ones, None, None))


def fp8_mm(a8, w_ENK, offsets, out_dtype):
    """Per group ``a @ w[e].T`` from a8 (``Fp8Rows`` of a (R, K)) and w (E, N, K) quantised here
    per output channel (each row of w[e] over K, as ``quantize_rows``; a transposed view is
    copied K-contiguous first): ``fp8_grouped_mm`` on sorted rows, (R, N) in ``out_dtype``."""
    E, N, K = w_ENK.shape
    w8 = quantize_rows(w_ENK.reshape(E * N, K))
    return fp8_grouped_mm_op.call(a8.data, a8.scale, w8.data.view(E, N, K), w8.scale.view(E, N),
                                  offsets, None, out_dtype)  # fmt: skip


def fp8_experts(x_ND, w_in, w_out, offsets, rows_R, gated):
    """(h_RX, o_RD): the experts' forward with FP8 GEMMs (x's rows gathered and quantised in one
    pass, the activation quantised in its pass), each GEMM's output in x's dtype."""
    h_RX = fp8_mm(gather_quant(x_ND, rows_R), w_in, offsets, x_ND.dtype)
    return h_RX, fp8_mm(activation_quant(h_RX, gated), w_out, offsets, x_ND.dtype)
