"""The routed experts' MLP as one differentiable op: the gathered up-projection, the activation
and the down-projection forward, and a backward of its own.

``expert_mlp(x, w_in, w_out, offsets, row_indices, inverse, gated=...)`` is what an MoE layer's
experts compute between its routing and its combine, as one autograd node (torchtitan's
``GroupedExperts``, with the token gather folded in). Against the chain of differentiable ops
(``dispatch``, ``gather_grouped_mm``, ``expert_activation``, ``gather_grouped_mm``) it saves:

* the dispatched rows: the up-projection gathers its A rows in its loads, forward and in the
  weight gradient, so no (R, D) copy of the tokens is written or kept for backward;
* the activation's output: backward recomputes it in the pass that computes its gradient;
* host time: one autograd node whose launches run directly in eager mode (no dispatcher round
  trip per op), four kernels forward and seven backward.

Forward keeps the pre-activation h (R, H'), or nothing with ``recompute=True`` (backward then
runs the up-projection again: a third more forward FLOPs for (R, H') less memory).

Backward, from dy (R, D): ``da = dy @ w_out[e]`` (grouped GEMM), ``(dh, a) = act'(h) da, act(h)``
(one pass), ``dw_out[e] = dy_e.T @ a_e``, ``dx_R = dh @ w_in[e]``, ``dx[n] = sum over j of
dx_R[inverse[n, j]]`` in j order in fp32 (no atomics), ``dw_in[e] = dh_e.T @ x[rows_e]`` (the
rows gathered in the GEMM's loads, or by one gather where CUTLASS runs it). Deterministic; the
same kernels eager and under ``torch.compile``, so compiled gradients equal eager ones.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels import activation as _act
from moe_kernels import grouped_mm as _gmm
from moe_kernels import tokens as _tokens
from moe_kernels._dispatch import plain_eager

__all__ = ["expert_mlp"]


def _mm(x, w, offsets, rows, activation="none"):
    """gather_grouped_mm, its launch called directly in plain eager mode."""
    op = _gmm._impl if plain_eager() else _gmm._op
    return op(x, w, offsets, rows, activation)


def _activation(h, gated):
    return (_act._impl if plain_eager() else _act._op)(h, gated)


def _sum_choices(dx_RD, inverse_NK, rows, out_dtype):
    """dx[n] = sum over j of dx_R[inverse[n, j]] in fp32, j order (``combine``, unweighted)."""
    op = _tokens._combine_impl if plain_eager() else _tokens._combine_op
    unused_weights = dx_RD.new_empty(0, dtype=torch.float32)
    return op(dx_RD, inverse_NK, rows, unused_weights, False, out_dtype)


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_in, w_out, offsets, rows_R, inverse_NK, gated, recompute):
        h_RX = _mm(x_ND, w_in, offsets, rows_R)
        y_RD = _mm(_activation(h_RX, gated), w_out, offsets, None)
        ctx.save_for_backward(x_ND, w_in, w_out, offsets, rows_R, inverse_NK,
                              None if recompute else h_RX)  # fmt: skip
        ctx.gated = gated
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_ND, w_in, w_out, offsets, rows_R, inverse_NK, h_RX = ctx.saved_tensors
        if h_RX is None:
            h_RX = _mm(x_ND, w_in, offsets, rows_R)
        dy_RD = dy_RD.to(x_ND.dtype)
        da_RH = _mm(dy_RD, w_out.mT, offsets, None)
        want_x, want_in, want_out = ctx.needs_input_grad[:3]
        if want_out:
            dh_RX, a_RH = _act.activation_grad_and_out(da_RH, h_RX, ctx.gated)
        else:
            dh_RX = _act.expert_activation_backward(da_RH, h_RX, ctx.gated)
        grad_x = grad_in = grad_out = None
        if want_out:
            grad_out = _gmm.grouped_weight_grad(dy_RD, a_RH, offsets, out_dtype=w_out.dtype)
        if want_x:
            dx_RD = _mm(dh_RX, w_in.mT, offsets, None)
            grad_x = _sum_choices(dx_RD, inverse_NK, rows_R, x_ND.dtype)
        if want_in:
            grad_in = _gmm.grouped_weight_grad(dh_RX, x_ND, offsets, rows_R, out_dtype=w_in.dtype)
        return grad_x, grad_in, grad_out, None, None, None, None, None


def expert_mlp(
    x_ND: torch.Tensor,
    w_in_EXD: torch.Tensor,
    w_out_EDH: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor,
    inverse_NK: torch.Tensor,
    *,
    gated: bool = False,
    recompute: bool = False,
) -> torch.Tensor:
    """The experts' MLP on rows gathered from x and grouped by expert.

    x_ND: (N, D) bf16/fp16/fp32, the tokens (or the rows an expert-parallel rank received).
    w_in_EXD: (E, X, D) and w_out_EDH: (E, D, H), x's dtype, ``nn.Linear`` layout (out x in);
    X = 2H with ``gated`` (SwiGLU ``silu(gate) * up``, gate first), else X = H (SiLU).
    offsets: (E+1,) int32/int64 exclusive prefix sum of the group sizes (offsets[E] <= R).
    row_indices: (R,) int, the row of x each grouped row reads (-1: none; ``RoutingPlan.
    token_indices``). inverse_NK: (N, K) int, the grouped rows that read x's row n (-1: none;
    ``RoutingPlan.inverse``): the order x's gradient sums them in.

    Returns y_RD (R, D) in x's dtype: for offsets[e] <= r < offsets[e+1],
    ``y[r] = act(x[rows[r]] @ w_in[e].T) @ w_out[e].T``, each GEMM accumulated in fp32 and
    rounded once, the activation in fp32; rows past offsets[E] or reading no row are zero.
    Differentiable in x, w_in and w_out with one backward (module docstring); ``recompute``:
    keep no activation for it and run the up-projection again there. Without gradients the
    SiLU runs in the first GEMM's epilogue.
    """
    x_ND = V.float_2d("x_ND", x_ND)
    for name, w in (("w_in_EXD", w_in_EXD), ("w_out_EDH", w_out_EDH)):
        w = V.tensor(name, w)
        V.rank(name, w, 3)
        if w.dtype != x_ND.dtype:
            raise TypeError(f"{name} must have x_ND's dtype {x_ND.dtype}, got {w.dtype}")
        V.same_device("x_ND", x_ND, **{name: w})
    if not isinstance(gated, bool) or not isinstance(recompute, bool):
        raise TypeError(f"gated and recompute must be bools, got {gated!r}, {recompute!r}")
    E, X, D = w_in_EXD.shape
    H = X // 2 if gated else X
    if gated and X % 2:
        raise ValueError(f"gated w_in_EXD needs an even X = 2H, got shape {tuple(w_in_EXD.shape)}")
    V.dim_size("w_in_EXD", w_in_EXD, 2, x_ND.shape[1], "D, the columns of x_ND")
    want = (E, D, H)
    if tuple(w_out_EDH.shape) != want:
        got = tuple(w_out_EDH.shape)
        raise ValueError(f"w_out_EDH must have shape (E, D, H) = {want}, got {got}")
    offsets = V.tensor("offsets", offsets)
    V.dtype("offsets", offsets, V.INDEX_DTYPES)
    V.rank("offsets", offsets, 1)
    V.same_device("x_ND", x_ND, offsets=offsets)
    V.dim_size("offsets", offsets, 0, E + 1, "E+1, one more than the weights' experts")
    row_indices = V.tensor("row_indices", row_indices)
    V.dtype("row_indices", row_indices, V.INDEX_DTYPES)
    V.rank("row_indices", row_indices, 1)
    V.same_device("x_ND", x_ND, row_indices=row_indices)
    inverse_NK = V.tensor("inverse_NK", inverse_NK)
    V.dtype("inverse_NK", inverse_NK, V.INDEX_DTYPES)
    V.rank("inverse_NK", inverse_NK, 2)
    V.same_device("x_ND", x_ND, inverse_NK=inverse_NK)
    V.dim_size("inverse_NK", inverse_NK, 0, x_ND.shape[0], "N, the rows of x_ND")
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x_ND, w_in_EXD, w_out_EDH))
    if grads:
        return _ExpertMLP.apply(
            x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, inverse_NK, gated, recompute
        )
    h_RX = _mm(x_ND, w_in_EXD, offsets, row_indices, "none" if gated else "silu")
    a_RH = _activation(h_RX, True) if gated else h_RX
    return _mm(a_RH, w_out_EDH, offsets, None)
