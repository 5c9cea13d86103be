"""The MoE router in one op: ``scores = router_scores(x, w)``, the first arrow of a MoE forward.

``router_scores`` replaces ``softmax(F.linear(x.float(), w.float()), -1)`` (or the sigmoid), the
fp32 formula that writes and keeps an fp32 copy of x and runs fp32 GEMMs, by one of
(``router_variant``, CUDA and the interpreter; the CPU runs the formula):

* ``"fma"`` (E <= ``FMA_MAX_E``): one Triton kernel that reads x once in its own dtype,
  accumulates the logits with fp32 multiply-adds in registers and applies the score function
  before writing (T, E) fp32 scores; backward: the fp32 formula's two GEMMs;
* ``"split"`` (more experts, up to ``SPLIT_MAX_E``, bf16 x): the fp32 logits from bf16
  tensor-core GEMMs against the weight's three exact bf16 pieces, and the backward the same way
  (``_router_split``);
* ``"fp32"`` (fp16 / fp32 x, or more experts): the fp32 formula.

A ``torch.library`` custom op (``moe_kernels::router_scores``) with a fake implementation: no host
syncs on CUDA, safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, deterministic
(no split-K, no atomics). Differentiable in x and weight (from the saved scores).
"""

from __future__ import annotations

import torch

from moe_kernels import _router_split as _split
from moe_kernels import _validate as V
from moe_kernels._dispatch import (
    register_op,
    triton_kernels,
    use_triton,
)
from moe_kernels.reference import router as _ref

__all__ = ["SCORE_FNS", "router_scores"]

SCORE_FNS = ("softmax", "sigmoid")

# The "fma" kernel's reach, from the H200 (benchmarks/gpu/router_sweep.py, D=2048): 11.2 vs
# 24.1 us for the fp32 formula at E=16, 2048 tokens; at E=128 cuBLAS was faster (44 vs 58 us).
FMA_MAX_E = 32
# The "split" variant's backward kernel holds a row of E scores in one program.
SPLIT_MAX_E = 1024


def router_variant(num_experts: int, x_dtype: torch.dtype) -> str:
    """Which router runs on CUDA (and in the interpreter): ``"fma"``, ``"split"`` or ``"fp32"``
    (module docstring)."""
    if num_experts <= FMA_MAX_E:
        return "fma"
    return "split" if x_dtype == torch.bfloat16 and num_experts <= SPLIT_MAX_E else "fp32"


def _score(logits_TE: torch.Tensor, score_fn: str) -> torch.Tensor:
    if score_fn == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    return torch.sigmoid(logits_TE)


def _triton():
    return triton_kernels("router")  # imported on first use: triton only when a kernel runs


def _router_impl(x: torch.Tensor, weight: torch.Tensor, score_fn: str) -> torch.Tensor:
    variant = router_variant(weight.shape[0], x.dtype) if use_triton(x.device) else "fp32"
    if variant == "fma":
        return _triton().router_scores(x, weight, score_fn == "sigmoid")
    if variant == "split":
        return _score(_split.logits(x, weight), score_fn)
    return _ref.router_scores(x, weight, score_fn)


def _router_fake(x, weight, score_fn):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _traceable(x, weight, score_fn) -> bool:
    """Only the "fma" kernel is traced into a compiled graph; the other variants are torch math
    that Inductor would re-derive with other roundings (opaque: compiled scores equal eager)."""
    return router_variant(weight.shape[0], x.dtype) == "fma"


router_scores_op = register_op("router_scores", _router_impl, _router_fake, traced=_traceable)


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
    """Backward of score_fn(x @ w.T) in fp32, from the saved scores s: dlogits = s * (g - sum_e
    g s) (softmax) or g * s * (1 - s) (sigmoid), then (dx, dw) by the forward's variant: the
    split variant's kernels and GEMMs, else fp32 GEMMs."""
    if use_triton(x_TD.device) and router_variant(weight_ED.shape[0], x_TD.dtype) == "split":
        grad_x, grad_w = _split.scores_backward(grad_TE, s_TE, score_fn, x_TD, weight_ED)
        return grad_x, grad_w.to(weight_ED.dtype)
    dl_TE = _split.logits_grad(grad_TE, s_TE, score_fn)
    grad_x = (dl_TE @ weight_ED.float()).to(x_TD.dtype)
    grad_w = (dl_TE.T @ x_TD.float()).to(weight_ED.dtype)
    return grad_x, grad_w


def _backward_fake(grad_TE, x_TD, weight_ED, s_TE, score_fn):
    return torch.empty_like(x_TD), torch.empty_like(weight_ED)


# Opaque under torch.compile: compiled gradients equal eager ones bit for bit.
router_scores_backward_op = register_op(
    "router_scores_backward", _backward_impl, _backward_fake, traced=False
)


def _backward(ctx, grad_TE):
    x_TD, weight_ED, s_TE = ctx.saved_tensors
    # (in plain eager the formula runs directly: the op's dispatcher and output checks cost
    # ~250 us of host time a call on the H200's host, train_gpu.py --py-profile)
    args = (grad_TE, x_TD, weight_ED, s_TE, ctx.score_fn)
    grad_x, grad_w = router_scores_backward_op.call(*args)
    return grad_x, grad_w, None


router_scores_op.register_autograd(_backward, _setup_context)


def router_scores(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, *, score_fn: str = "softmax"
) -> torch.Tensor:
    """Router scores (T, E) float32: ``score_fn(x @ weight.T)`` with the logits in fp32.

    x_TD: (T, D) float32/bf16/fp16, any strides (T may be 0); weight_ED: (E, D) float32 (bf16 and
    fp16 are upcast), E >= 1, any strides. ``logits[t, e] = sum_d float(x[t, d]) * float(w[e, d])``
    accumulated in fp32 with IEEE multiply-adds (no TF32), then ``score_fn``: ``"softmax"`` over E
    (max-subtracted, exp, sum, divide, all fp32) or ``"sigmoid"`` elementwise.

    Matches the reference ``torch.softmax(F.linear(x.float(), w.float()), -1)`` (or
    ``torch.sigmoid``) to fp32 rounding, not bit for bit: the variants (``router_variant``) sum
    D in other orders than the fp32 GEMM, and the "fma" kernel's exp (ex2.approx) is within a
    few ulps (divides are IEEE). Bitwise reproducible run to run on a given device. Differentiable
    in x_TD and weight_ED (x's gradient in x's dtype, the weight's in its dtype).
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
    return router_scores_op.call(x_TD, weight_ED, score_fn)
