"""The routed experts' MLP as one differentiable op: the gathered up-projection, the activation
and the down-projection forward, and a backward of its own.

``expert_mlp(x, w_in, w_out, offsets, row_indices, inverse, gated=...)`` is what an MoE layer's
experts compute between its routing and its combine, as one autograd node (torchtitan's
``GroupedExperts``, with the token gather folded in).

With gradients, forward gathers the rows (xs = x[rows], a copy kernel) and runs both GEMMs on
sorted rows (``gather_grouped_mm``'s sorted-row kernels: on sm90 bf16 the persistent Triton GEMM
up to 1024 rows per expert and CUTLASS above, the Triton grouped GEMM elsewhere;
``_gemm_plan.choose_gemm``), because on the H200 that beat the Triton GEMM that gathers
in its loads at training sizes (``benchmarks/gpu/expert_mlp_gpu.py``, docs/training.md). It
keeps the pre-activation h (R, X) and, with ``save_rows`` (the default), xs (R, D); the
activation's output is not kept: backward recomputes it in the pass that computes its gradient.

Backward, from dy (R, D): ``da = dy @ w_out[e]``, ``(dh, a) = (act'(h) da, act(h))`` in one
pass, ``dw_out[e] = dy_e.T @ a_e``, ``dx_R = dh @ w_in[e]``, ``dx[n] = sum over j of
dx_R[inverse[n, j]]`` in j order in fp32 (no atomics), ``dw_in[e] = dh_e.T @ xs_e`` (xs gathered
again when not saved). Deterministic; the same kernels eager and under ``torch.compile``, so
compiled gradients equal eager ones; in plain eager mode the launches run without a dispatcher
round trip per op (one autograd node instead of four).

Without gradients, up to ``_gemm_plan.FUSED_GATHER_MAX_X`` columns of the first GEMM (or where
CUTLASS does not run), the Triton GEMM gathers its rows in its loads and applies SiLU to its
fp32 accumulator (SwiGLU after it); wider, the gather and CUTLASS as with gradients. At a decode
step's few rows (``_gemm_plan.GEMV_MAX_ROWS`` in all) both GEMMs are grouped GEMVs
(``_triton/grouped_gemv.py``), the first applying SiLU or SwiGLU to its fp32 accumulators.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._expert_steps import activation, gather, input_grads, sorted_mm, weight_grad
from moe_kernels._gemm_plan import plan_gather_mlp
from moe_kernels.activation import activation_grad_and_out_op, expert_activation_backward_op
from moe_kernels.grouped_mm import grouped_gemv_op

__all__ = ["expert_mlp"]


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_in, w_out, offsets, rows_R, inverse_NK, gated, save_rows):
        xs_RD = gather(x_ND, rows_R)
        h_RX = sorted_mm(xs_RD, w_in, offsets, None, zero_tail=False)
        y_RD = sorted_mm(activation(h_RX, gated), w_out, offsets, None)
        ctx.save_for_backward(x_ND if not save_rows else None, xs_RD if save_rows else None,
                              h_RX, w_in, w_out, offsets, rows_R, inverse_NK)  # fmt: skip
        ctx.gated = gated
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_ND, xs_RD, h_RX, w_in, w_out, offsets, rows_R, inverse_NK = ctx.saved_tensors
        dy_RD = dy_RD.to(h_RX.dtype)
        want_x, want_in, want_out = ctx.needs_input_grad[:3]
        da_RH = sorted_mm(dy_RD, w_out.mT, offsets, None, zero_tail=False)
        grad_out = None
        if want_out:
            dh_RX, a_RH = activation_grad_and_out_op.call(da_RH, h_RX, ctx.gated)
            grad_out = weight_grad(dy_RD, a_RH, offsets, None, w_out.dtype)
            del a_RH
        else:
            dh_RX = expert_activation_backward_op.call(da_RH, h_RX, ctx.gated)
        del da_RH
        grad_x, grad_in = input_grads(dh_RX, x_ND, xs_RD, w_in, offsets, rows_R, inverse_NK,
                                      want_x, want_in)  # fmt: skip
        return grad_x, grad_in, grad_out, None, None, None, None, None


# The argument names ``check_args`` reports: expert_mlp's own, or a caller's (routed_experts).
EXPERT_MLP_NAMES = {"x": "x_ND", "offsets": "offsets", "rows": "row_indices",
                    "inverse": "inverse_NK", "N": "N"}  # fmt: skip


def check_args(x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, inverse_NK, gated, save_rows,
               names=None):  # fmt: skip
    """TypeError / ValueError naming the argument unless ``expert_mlp`` can take these;
    ``names`` (``EXPERT_MLP_NAMES``' keys) names x, offsets, row_indices, inverse and x's rows
    as the caller calls them."""
    n = EXPERT_MLP_NAMES if names is None else names
    x_name = n["x"]
    V.float_2d(x_name, x_ND)
    for name, w in (("w_in_EXD", w_in_EXD), ("w_out_EDH", w_out_EDH)):
        w = V.tensor(name, w)
        V.rank(name, w, 3)
        if w.dtype != x_ND.dtype:
            raise TypeError(f"{name} must have {x_name}'s dtype {x_ND.dtype}, got {w.dtype}")
        V.same_device(x_name, x_ND, **{name: w})
    if not isinstance(gated, bool) or not isinstance(save_rows, bool):
        raise TypeError(f"gated and save_rows must be bools, got {gated!r}, {save_rows!r}")
    E, X, D = w_in_EXD.shape
    H = X // 2 if gated else X
    if gated and X % 2:
        raise ValueError(f"gated w_in_EXD needs an even X = 2H, got shape {tuple(w_in_EXD.shape)}")
    V.dim_size("w_in_EXD", w_in_EXD, 2, x_ND.shape[1], f"D, the columns of {x_name}")
    want = (E, D, H)
    if tuple(w_out_EDH.shape) != want:
        got = tuple(w_out_EDH.shape)
        raise ValueError(f"w_out_EDH must have shape (E, D, H) = {want}, got {got}")
    for key, t, rank in (("offsets", offsets, 1), ("rows", row_indices, 1),
                         ("inverse", inverse_NK, 2)):  # fmt: skip
        name = n[key]
        V.tensor(name, t)
        V.dtype(name, t, V.INDEX_DTYPES)
        V.rank(name, t, rank)
        V.same_device(x_name, x_ND, **{name: t})
    V.dim_size(n["offsets"], offsets, 0, E + 1, "E+1, one more than the weights' experts")
    V.dim_size(n["inverse"], inverse_NK, 0, x_ND.shape[0], f"{n['N']}, the rows of {x_name}")


def expert_mlp(
    x_ND: torch.Tensor,
    w_in_EXD: torch.Tensor,
    w_out_EDH: torch.Tensor,
    offsets: torch.Tensor,
    row_indices: torch.Tensor,
    inverse_NK: torch.Tensor,
    *,
    gated: bool = False,
    save_rows: bool = True,
) -> torch.Tensor:
    """The experts' MLP on rows gathered from x and grouped by expert.

    x_ND: (N, D) bf16/fp16/fp32, the tokens (or the rows an expert-parallel rank received).
    w_in_EXD: (E, X, D) and w_out_EDH: (E, D, H), x's dtype, ``nn.Linear`` layout (out x in);
    X = 2H with ``gated`` (SwiGLU ``silu(gate) * up``, gate first), else X = H (SiLU).
    offsets: (E+1,) int32/int64 exclusive prefix sum of the group sizes (offsets[E] <= R).
    row_indices: (R,) int, the row of x each grouped row reads (-1: none; ``RoutingPlan.
    token_indices``). inverse_NK: (N, K) int, the grouped rows that read x's row n (-1: none;
    ``RoutingPlan.inverse``): the order x's gradient sums them in. These are read on the device,
    never checked (that would sync); any values are memory-safe: offsets are clamped as
    ``gather_grouped_mm`` clamps them, and an index outside [0, N) (rows) or [0, R) (inverse)
    counts as -1.

    Returns y_RD (R, D) in x's dtype: for offsets[e] <= r < offsets[e+1],
    ``y[r] = act(x[rows[r]] @ w_in[e].T) @ w_out[e].T``, each GEMM accumulated in fp32 and
    rounded once, the activation in fp32; rows past offsets[E] or reading no row are zero.
    Differentiable in x, w_in and w_out with one backward (module docstring); ``save_rows``:
    keep the gathered rows for the up-projection's weight gradient (R x D memory), else gather
    them again there (one more copy pass). Without gradients the SiLU runs in the first GEMM's
    epilogue (one rounding fewer than with gradients, where h is rounded before the SiLU); so
    does SwiGLU at a few rows in all (the grouped GEMV).
    """
    check_args(x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, inverse_NK, gated, save_rows)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x_ND, w_in_EXD, w_out_EDH))
    if grads:
        return _ExpertMLP.apply(
            x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, inverse_NK, gated, save_rows
        )
    return forward_no_grad(x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, gated)


def forward_no_grad(x_ND, w_in_EXD, w_out_EDH, offsets, row_indices, gated, zero_tail=True):
    """``expert_mlp``'s forward without autograd, arguments checked: the first GEMM gathers its
    rows in its loads or reads them gathered by a copy kernel (``_gemm_plan.plan_gather_mlp``);
    at a few rows in all both are grouped GEMVs, the activation (SwiGLU too) in the first one's
    epilogue. ``zero_tail=False``: the output's rows past the groups are left unwritten (a
    caller that never reads them)."""
    kernel = plan_gather_mlp(x_ND, w_in_EXD, row_indices).kernel
    if kernel == "gemv":  # the down-projection's plan ("rows", as many rows) is the GEMV too
        act = "swiglu" if gated else "silu"
        a_RH = grouped_gemv_op.call(x_ND, w_in_EXD, offsets, row_indices, act)
    elif kernel != "gather_copy":
        h_RX = sorted_mm(x_ND, w_in_EXD, offsets, row_indices, "none" if gated else "silu")
        a_RH = activation(h_RX, True) if gated else h_RX
    else:
        h_RX = sorted_mm(gather(x_ND, row_indices), w_in_EXD, offsets, None, zero_tail=False)
        a_RH = activation(h_RX, gated)
    return sorted_mm(a_RH, w_out_EDH, offsets, None, zero_tail=zero_tail)
