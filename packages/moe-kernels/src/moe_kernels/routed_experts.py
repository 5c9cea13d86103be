"""The routed experts of an MoE layer, from the tokens to their combined output, as one
differentiable op: ``y = routed_experts(x, w_in, w_out, plan)`` is ``combine(expert_mlp(x, ...),
plan)`` with a backward that never needs the experts' outputs.

Forward with gradients: ``expert_mlp``'s forward (the row gather, the up-projection, the
activation, the down-projection on sorted rows), then ``combine``'s weighted fp32 sum; it keeps
what ``expert_mlp`` keeps (h, and the gathered rows with ``save_rows``), not the (R, D) expert
outputs that a separate ``combine`` keeps for its weight gradient.

Backward from dY (T, D), with o_r = a_r @ w_out[e].T the down-projection of the activation a_r
and y[t] = sum_j s_r o_r over the rows r = inverse[t, j] (SonicMoE's identity for ds):

* ``dyg_r = dY[tok_r]`` (a gather, unscaled), ``da'_r = dyg_r @ w_out[e]`` (a sorted-row GEMM);
* one pass over h (``activation_grad_weighted``): ``ds_r = <da'_r, a_r>`` (= <dY[tok_r], o_r>),
  ``dh_r = act'(h_r) (s_r da'_r)`` and ``s_r a_r``;
* ``dw_out[e] = dyg_e.T @ (s a)_e``, then ``expert_mlp``'s input side (``dw_in``, ``dx``).

FP8 (``fp8=True``, bf16 master weights): the forward gathers and quantises x's rows in one pass
(``gather_scale_quant_dense_tokens``, FBGEMM's row-wise e4m3 scales), runs the up-projection
against w_in quantised per output channel on the spot (``fp8_grouped_mm``), quantises the
activation in its pass (``silu_mul_quant``) and runs the down-projection against w_out so
quantised; backward quantises ``dyg`` and ``dh`` per row and the transposed weights (w_out^T
(E, H, D), w_in^T (E, D, X), copied K-contiguous) per output channel for the two data-gradient
GEMMs; the weight gradients are the bf16 (x's dtype) GEMMs of the unquantised ``dyg``, ``s a``,
``dh`` and gathered x (the FP8 GEMM has no form grouped along the contraction, and FP8 weight
gradients would need both operands quantised column-wise per group: two more passes). Only h
(R, X) is kept, as in bf16.

Deterministic, no atomics; the same kernels eager and under ``torch.compile``. The forward is bit
for bit ``combine(expert_mlp(...))``; the gradients are the same math with the router weight
applied after the data-gradient GEMM instead of before it (other bf16 roundings, same size).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._expert_steps import (
    activation,
    combine_rows,
    fp8_experts,
    fp8_mm,
    gather,
    gather_grad_rows,
    input_grads,
    quantize_rows,
    sorted_mm,
    weight_grad,
)
from moe_kernels.activation import activation_grad_weighted_op
from moe_kernels.expert_mlp import check_args, forward_no_grad
from moe_kernels.routing import RoutingPlan

__all__ = ["routed_experts"]

# The names ``check_args`` reports: this function's arguments, not expert_mlp's.
_NAMES = {"x": "x_TD", "offsets": "plan.offsets", "rows": "plan.token_indices",
          "inverse": "plan.inverse", "N": "T"}  # fmt: skip


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_in, w_out, weights_R, offsets, rows_R, inverse_NK, gated, save_rows,
                out_dtype, fp8):  # fmt: skip
        if fp8:  # (the up-projection's weight gradient gathers x's rows again)
            save_rows, xs_RD = False, None
            h_RX, o_RD = fp8_experts(x_ND, w_in, w_out, offsets, rows_R, gated)
        else:
            xs_RD = gather(x_ND, rows_R)
            h_RX = sorted_mm(xs_RD, w_in, offsets, None, zero_tail=False)
            o_RD = sorted_mm(activation(h_RX, gated), w_out, offsets, None, zero_tail=False)
        y_ND = combine_rows(o_RD, inverse_NK, rows_R, weights_R, out_dtype)
        ctx.save_for_backward(x_ND if not save_rows else None, xs_RD if save_rows else None,
                              h_RX, w_in, w_out, weights_R, offsets, rows_R,
                              inverse_NK)  # fmt: skip
        ctx.gated, ctx.fp8 = gated, fp8
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, xs_RD, h_RX, w_in, w_out, weights_R, offsets, rows_R, inverse_NK = ctx.saved_tensors
        want_x, want_in, want_out, want_s = ctx.needs_input_grad[:4]
        dyg_RD = gather_grad_rows(dy_ND, rows_R, h_RX.dtype)
        if ctx.fp8:
            da_RH = fp8_mm(quantize_rows(dyg_RD), w_out.mT, offsets, h_RX.dtype)
        else:
            da_RH = sorted_mm(dyg_RD, w_out.mT, offsets, None, zero_tail=False)
        dh_RX, sa_RH, ds_R = activation_grad_weighted_op.call(da_RH, h_RX, weights_R, rows_R,
                                                              ctx.gated)  # fmt: skip
        del da_RH
        grad_out = None
        if want_out:
            grad_out = weight_grad(dyg_RD, sa_RH, offsets, None, w_out.dtype)
        del dyg_RD, sa_RH
        grad_x, grad_in = input_grads(dh_RX, x_ND, xs_RD, w_in, offsets, rows_R, inverse_NK,
                                      want_x, want_in, ctx.fp8)  # fmt: skip
        grad_s = ds_R.to(weights_R.dtype) if want_s else None
        return grad_x, grad_in, grad_out, grad_s, None, None, None, None, None, None, None


def routed_experts(
    x_TD: torch.Tensor,
    w_in_EXD: torch.Tensor,
    w_out_EDH: torch.Tensor,
    plan: RoutingPlan,
    *,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
    save_rows: bool = True,
    fp8: bool = False,
) -> torch.Tensor:
    """An MoE layer's routed experts: y_TD (T, D) in ``out_dtype`` (default x's dtype).

    x_TD: (T, D) bf16/fp16/fp32 tokens; w_in_EXD (E, X, D), w_out_EDH (E, D, H) in x's dtype as
    for ``expert_mlp`` (X = 2H with ``gated``: SwiGLU); plan: the ``RoutingPlan`` of x's tokens
    (``route``). ``y[t] = sum_j s_r * o_r`` over the rows r = ``plan.inverse[t, j]`` in j order
    (-1 skipped), accumulated in fp32 (``combine``), where s = ``plan.weights`` and
    o = ``expert_mlp(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse)``.

    Differentiable in x, w_in, w_out and ``plan.weights`` with one backward that keeps no expert
    outputs (module docstring); ``save_rows`` as for ``expert_mlp``.

    ``fp8``: FP8 training (module docstring, "FP8"): the two forward GEMMs and the two
    data-gradient GEMMs on e4m3 operands, the weight gradients in x's dtype from unquantised
    operands; ``save_rows`` does not apply (the rows are gathered again). The plan's contents are
    read on the device, never checked: any values are memory-safe (as for ``expert_mlp``), but
    an inverse entry naming a row past the clamped groups reads a row the GEMMs left
    unwritten, so such plans give unspecified results. Errors name this function's arguments
    (``x_TD``, ``plan.offsets``, ``plan.token_indices``, ``plan.inverse``, ...).
    """
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be a RoutingPlan, got {type(plan).__name__}")
    rows_R, inverse_NK, weights_R = plan.token_indices, plan.inverse, plan.weights
    check_args(x_TD, w_in_EXD, w_out_EDH, plan.offsets, rows_R, inverse_NK, gated, save_rows,
               _NAMES)  # fmt: skip
    V.tensor("plan.weights", weights_R)
    V.dtype("plan.weights", weights_R, V.FLOAT_DTYPES)
    V.rank("plan.weights", weights_R, 1)
    V.same_device("x_TD", x_TD, **{"plan.weights": weights_R})
    V.dim_size("plan.weights", weights_R, 0, rows_R.shape[0], "len(plan.token_indices)")
    if out_dtype is None:
        out_dtype = x_TD.dtype
    if out_dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    tensors = (x_TD, w_in_EXD, w_out_EDH, weights_R)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _RoutedExperts.apply(x_TD, w_in_EXD, w_out_EDH, weights_R, plan.offsets, rows_R,
                                    inverse_NK, gated, save_rows, out_dtype, fp8)  # fmt: skip
    if fp8:
        o_RD = fp8_experts(x_TD, w_in_EXD, w_out_EDH, plan.offsets, rows_R, gated)[1]
    else:
        o_RD = forward_no_grad(x_TD, w_in_EXD, w_out_EDH, plan.offsets, rows_R, gated,
                               zero_tail=False)  # fmt: skip
    return combine_rows(o_RD, inverse_NK, rows_R, weights_R, out_dtype)
