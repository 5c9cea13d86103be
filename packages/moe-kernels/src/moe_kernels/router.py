"""The MoE router in one op: ``scores = router_scores(x, w)``, the first arrow of a MoE forward.

``router_scores`` replaces ``softmax(F.linear(x.float(), w.float()), -1)`` (or the sigmoid) with
one kernel that reads x once in its own dtype, accumulates the logits in fp32 registers and
applies the score function before writing (T, E) fp32 scores, instead of writing an fp32 copy of
x, running an fp32 GEMM and a separate softmax. It is a ``torch.library`` custom op
(``moe_kernels::router_scores``) with a fake implementation: no host syncs on CUDA, safe under
``torch.compile(fullgraph=True)`` and CUDA-graph capture, deterministic (no split-K, no atomics).
Differentiable in x and weight (a torch backward from the saved scores: two small fp32 GEMMs).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import pick, register_autograd, register_op, triton_kernels, use_triton
from moe_kernels._reference import router as _ref

__all__ = ["SCORE_FNS", "router_scores"]

SCORE_FNS = ("softmax", "sigmoid")


def _triton():
    return triton_kernels("router")  # imported on first use: triton only when a kernel runs


def _router_impl(x: torch.Tensor, weight: torch.Tensor, score_fn: str) -> torch.Tensor:
    if not use_triton(x.device):
        return _ref.router_scores(x, weight, score_fn)
    return _triton().router_scores(x, weight, score_fn == "sigmoid")


def _router_fake(x, weight, score_fn):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


_router_op = register_op("router_scores", _router_impl, _router_fake)


def _setup_context(ctx, inputs, output):
    x, weight, score_fn = inputs
    ctx.save_for_backward(x, weight, output)
    ctx.score_fn = score_fn


def _backward_impl(
    grad_TE: torch.Tensor,
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    s_TE: torch.Tensor,
    score_fn: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch backward of score_fn(x @ w.T) in fp32, from the saved scores s:
    dlogits = s * (g - sum_e g s) (softmax) or g * s * (1 - s) (sigmoid); then (dx, dw)."""
    g_TE = grad_TE.float()
    if score_fn == "softmax":
        dl_TE = s_TE * (g_TE - (g_TE * s_TE).sum(dim=-1, keepdim=True))
    else:
        dl_TE = g_TE * s_TE * (1.0 - s_TE)
    grad_x = (dl_TE @ weight_ED.float()).to(x_TD.dtype)
    grad_w = (dl_TE.T @ x_TD.float()).to(weight_ED.dtype)
    return grad_x, grad_w


def _backward_fake(grad_TE, x_TD, weight_ED, s_TE, score_fn):
    return torch.empty_like(x_TD), torch.empty_like(weight_ED)


# Opaque under torch.compile: compiled gradients equal eager ones bit for bit.
_backward_op = register_op("router_scores_backward", _backward_impl, _backward_fake, traced=False)


def _backward(ctx, grad_TE):
    x_TD, weight_ED, s_TE = ctx.saved_tensors
    grad_x, grad_w = _backward_op(grad_TE, x_TD, weight_ED, s_TE, ctx.score_fn)
    return grad_x, grad_w, None


_router_eager = register_autograd(_router_op, _router_impl, _backward, _setup_context)


def router_scores(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, *, score_fn: str = "softmax"
) -> torch.Tensor:
    """Router scores (T, E) float32: ``score_fn(x @ weight.T)`` with the logits in fp32.

    x_TD: (T, D) float32/bf16/fp16, any strides (T may be 0); weight_ED: (E, D) float32 (bf16 and
    fp16 are upcast), E >= 1, any strides. ``logits[t, e] = sum_d float(x[t, d]) * float(w[e, d])``
    accumulated in fp32 with IEEE multiply-adds (no TF32), then ``score_fn``: ``"softmax"`` over E
    (max-subtracted, exp, sum, divide, all fp32) or ``"sigmoid"`` elementwise.

    Matches the reference ``torch.softmax(F.linear(x.float(), w.float()), -1)`` (or
    ``torch.sigmoid``) to fp32 rounding, not bit for bit: the kernel sums D in a different order
    than the fp32 GEMM, and the GPU's exp (ex2.approx) is within a few ulps (divides are IEEE).
    Bitwise reproducible run to run on a given device and launch config. Differentiable in x_TD
    and weight_ED.
    """
    x_TD = V.tensor("x_TD", x_TD)
    V.dtype("x_TD", x_TD, V.FLOAT_DTYPES)
    V.rank("x_TD", x_TD, 2)
    weight_ED = V.tensor("weight_ED", weight_ED)
    V.dtype("weight_ED", weight_ED, V.FLOAT_DTYPES)
    V.rank("weight_ED", weight_ED, 2)
    V.same_device("x_TD", x_TD, weight_ED=weight_ED)
    V.dim_size("weight_ED", weight_ED, 1, x_TD.shape[1], "D, the columns of x_TD")
    if weight_ED.shape[0] < 1:
        raise ValueError(f"weight_ED must have at least one expert (row), got {weight_ED.shape}")
    if not isinstance(score_fn, str):
        raise TypeError(f"score_fn must be a str, got {type(score_fn).__name__}")
    if score_fn not in SCORE_FNS:
        raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
    op = pick(_router_op, _router_impl, _router_eager, x_TD, weight_ED)
    return op(x_TD, weight_ED, score_fn)
