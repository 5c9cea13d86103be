"""The expert activation of an MoE layer: SiLU, or SwiGLU ``silu(gate) * up``, with its backward.

``expert_activation(h, gated)`` is a ``torch.library`` custom op
(``moe_kernels::expert_activation``) with a fake implementation and an autograd formula whose
backward is one more op (``moe_kernels::expert_activation_backward``): Triton kernels on CUDA
(and under ``TRITON_INTERPRET=1``), the torch reference on CPU. Both are the same code eager and
under ``torch.compile``, so compiled gradients equal eager ones bit for bit (torch's own silu
backward is re-derived by Inductor, with other roundings).
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import activation as _ref

__all__ = ["expert_activation"]


def _triton():
    return triton_kernels("activation")


def _impl(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not use_triton(h.device):
        return _ref.activation(h, gated)
    return _triton().activation(h, gated)


def _fake(h, gated):
    return h.new_empty((h.shape[0], h.shape[1] // 2 if gated else h.shape[1]))


expert_activation_op = register_op("expert_activation", _impl, _fake)


def _backward_impl(grad: torch.Tensor, h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not use_triton(h.device):
        return _ref.activation_backward(grad, h, gated)
    return _triton().activation_backward(grad, h, gated)


def _backward_fake(grad, h, gated):
    return torch.empty_like(h)


expert_activation_backward_op = register_op(
    "expert_activation_backward", _backward_impl, _backward_fake
)


def _setup_context(ctx, inputs, output):
    h, gated = inputs
    ctx.save_for_backward(h)
    ctx.gated = gated


def _backward(ctx, grad):
    (h,) = ctx.saved_tensors
    return expert_activation_backward(grad, h, ctx.gated), None


def expert_activation_backward(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, gated: bool
) -> torch.Tensor:
    """The gradient of ``expert_activation``'s input h_MX (M, H or 2H) in h's dtype, given the
    output gradient grad_MH (M, H). Inputs are trusted (the backward formulas call it)."""
    return expert_activation_backward_op.call(grad_MH, h_MX, gated)


expert_activation_op.register_autograd(_backward, _setup_context)


def _grad_and_out_impl(
    grad: torch.Tensor, h: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(h.device):
        return _ref.activation_backward(grad, h, gated), _ref.activation(h, gated)
    out = torch.empty(grad.shape, dtype=h.dtype, device=h.device)
    return _triton().activation_backward(grad, h, gated, out), out


def _grad_and_out_fake(grad, h, gated):
    return torch.empty_like(h), h.new_empty(grad.shape)


activation_grad_and_out_op = register_op(
    "expert_activation_grad_and_out", _grad_and_out_impl, _grad_and_out_fake
)


def activation_grad_and_out(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_activation_backward`` and ``expert_activation(h_MX)`` (M, H) from one pass over
    h: (dh in h's dtype, the activation in h's dtype, the forward's bits). Inputs are trusted
    (a backward formula calls it)."""
    return activation_grad_and_out_op.call(grad_MH, h_MX, gated)


def _grad_weighted_impl(
    grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(h.device):
        return _ref.activation_backward_weighted(grad, h, w, tok, gated)
    return _triton().activation_backward_weighted(
        grad.contiguous(), h.contiguous(), w.contiguous(), tok.contiguous(), gated
    )


def _grad_weighted_fake(grad, h, w, tok, gated):
    dw = w.new_empty(h.shape[0], dtype=torch.float32)
    return torch.empty_like(h), h.new_empty(grad.shape), dw


activation_grad_weighted_op = register_op(
    "expert_activation_grad_weighted", _grad_weighted_impl, _grad_weighted_fake
)


def activation_grad_weighted(
    grad_MH: torch.Tensor, h_MX: torch.Tensor, w_M: torch.Tensor, tok_M: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``w[m] * expert_activation(h)[m]`` (rows weighted after the activation, as
    a weighted combine does after the next GEMM) from its unweighted gradient grad_MH (M, H), in
    one pass over h: (dh (M, X) in h's dtype, ``w * act(h)`` (M, H) in h's dtype, dw (M,) fp32 =
    ``sum_j grad[m, j] * act(h)[m, j]``, summed in a fixed order). w_M (M,) float, tok_M (M,)
    int: rows with tok < 0 count as weight 0 and get dw 0. fp32 math, one cast per output.
    Inputs are trusted (a backward formula calls it)."""
    return activation_grad_weighted_op.call(grad_MH, h_MX, w_M, tok_M, gated)


def expert_activation(h_MX: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """SiLU of h_MX (M, H), or with ``gated`` SwiGLU of h_MX (M, 2H): ``silu(h[:, :H]) *
    h[:, H:]`` (gate first, then up). float32/bf16/fp16, any strides; returns (M, H) in h's dtype,
    computed in fp32 (``g / (1 + exp(-g))``) and cast once. Differentiable in h (the input is saved,
    not the output)."""
    h_MX = V.tensor("h_MX", h_MX)
    V.dtype("h_MX", h_MX, V.FLOAT_DTYPES)
    V.rank("h_MX", h_MX, 2)
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {type(gated).__name__}")
    if gated and h_MX.shape[1] % 2:
        raise ValueError(f"gated h_MX must have an even number of columns, got {tuple(h_MX.shape)}")
    return expert_activation_op.call(h_MX, gated)
