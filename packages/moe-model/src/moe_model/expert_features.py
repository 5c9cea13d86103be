"""The experts' optional features, for families whose experts are not plain SiLU(-gated) MLPs:
per-expert biases on both projections, a configurable gated activation (``SwiGLU``: GPT-OSS's
``alpha``, ``limit`` and ``up + 1``, gate/up interleaved), and the routing weight on the
expert's input (Llama4). A layer with any of them runs its experts as composed steps
(``composed_experts_combine``) through its implementation's own gather and grouped GEMM
(``MoEImpl.gather`` / ``MoEImpl.expert_mm``); plain layers keep the fused kernels.

Shapes: T tokens, R rows grouped by expert (the plan's pairs), E experts, D model width, H the
expert hidden size, H' the first GEMM's width (2H gated).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from moe_model.expert_ops import activation

if TYPE_CHECKING:
    from moe_kernels import RoutingPlan
    from moe_model.expert_ops import ExpertRows
    from moe_model.impls import MoEImpl


class SwiGLU(NamedTuple):
    """A gated activation of the first GEMM's output h (R, 2H) -> (R, H), in fp32:
    ``(clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g)`` with ``g = min(gate,
    limit)`` (no clamp when ``limit`` is None). gate, up: the first and second H columns of h, or
    with ``interleaved`` its even and odd columns (GPT-OSS's storage).

    ``SwiGLU()`` is the standard ``silu(gate) * up`` (MoELayer's ``gated=True``); GPT-OSS's is
    ``SwiGLU(alpha=1.702, limit=7.0, up_offset=1.0, interleaved=True)``.
    """

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    interleaved: bool = False

    def __call__(self, h_RX: torch.Tensor) -> torch.Tensor:
        h_RX = h_RX.float()
        if self.interleaved:
            gate_RH, up_RH = h_RX[..., 0::2], h_RX[..., 1::2]
        else:
            gate_RH, up_RH = h_RX.chunk(2, dim=-1)
        if self.limit is not None:
            gate_RH = gate_RH.clamp(max=self.limit)
            up_RH = up_RH.clamp(min=-self.limit, max=self.limit)
        if self.alpha == 1.0:
            glu_RH = F.silu(gate_RH)
        else:
            glu_RH = gate_RH * torch.sigmoid(gate_RH * self.alpha)
        return (up_RH + self.up_offset) * glu_RH if self.up_offset else up_RH * glu_RH


def check_swiglu(swiglu: object, gated: bool) -> SwiGLU | None:
    """The checked activation: None for None or ``SwiGLU()`` (the standard one); TypeError
    unless a ``SwiGLU``, ValueError for a non-gated layer, an ``alpha`` not finite and > 0, a
    ``limit`` not None or finite and > 0, an ``up_offset`` not finite."""
    if swiglu is None:
        return None
    if not isinstance(swiglu, SwiGLU):
        raise TypeError(f"swiglu must be None or a moe_model.SwiGLU, got {type(swiglu).__name__}")
    if not gated:
        raise ValueError("swiglu needs gated=True (it is the gate/up activation)")
    alpha, limit, offset = swiglu.alpha, swiglu.limit, swiglu.up_offset
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"swiglu.alpha must be a finite float > 0, got {alpha!r}")
    if limit is not None and not (
        isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0
    ):
        raise ValueError(f"swiglu.limit must be None or a finite float > 0, got {limit!r}")
    if not (isinstance(offset, (int, float)) and math.isfinite(offset)):
        raise ValueError(f"swiglu.up_offset must be a finite float, got {offset!r}")
    if not isinstance(swiglu.interleaved, bool):
        raise TypeError(f"swiglu.interleaved must be a bool, got {swiglu.interleaved!r}")
    return None if swiglu == SwiGLU() else swiglu


class _RowBias(torch.autograd.Function):
    """out[r] = b[expert[r]] (zero where expert[r] is -1); the backward sums each expert's rows
    by a one-hot GEMM in fp32: deterministic, where ``index_select``'s backward adds with
    atomics on CUDA."""

    @staticmethod
    def forward(ctx, b_EN, expert_R):
        ok_R = expert_R >= 0
        ctx.save_for_backward(expert_R)
        ctx.experts = b_EN.shape[0]
        rows_RN = b_EN.index_select(0, torch.where(ok_R, expert_R, 0).long())
        return torch.where(ok_R[:, None], rows_RN, 0)

    @staticmethod
    def backward(ctx, grad_RN):
        (expert_R,) = ctx.saved_tensors
        E = ctx.experts
        hot_RE = F.one_hot(torch.where(expert_R >= 0, expert_R, E).long(), E + 1)[:, :E]
        return (hot_RE.float().mT @ grad_RN.float()).to(grad_RN.dtype), None


def row_bias(b_EN: torch.Tensor, expert_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(R, N) in ``dtype``: each row's expert's bias ``b_EN[expert_R[r]]`` (zero for -1),
    differentiable in b with a deterministic backward."""
    return _RowBias.apply(b_EN.to(dtype), expert_R)


class ExpertFeatures(NamedTuple):
    """What a layer's experts add to the plain MLP: ``in_bias`` (E, H') and ``out_bias`` (E, D)
    or None, ``swiglu`` (None: SiLU, or ``silu(gate) * up`` when gated), ``weight_on_input``
    (the routing weight scales the expert's input, the combine then unweighted)."""

    in_bias: torch.Tensor | None
    out_bias: torch.Tensor | None
    swiglu: SwiGLU | None
    weight_on_input: bool


def composed_experts_combine(
    impl: MoEImpl,
    rows: ExpertRows,
    plan: RoutingPlan,
    in_proj: torch.Tensor,
    out_proj: torch.Tensor,
    gated: bool,
    features: ExpertFeatures,
    x_TD: torch.Tensor,
) -> torch.Tensor:
    """y_TD (T, D) in x's dtype: each token's k experts with ``features``, as steps: the rows
    gathered (scaled by their routing weight with ``weight_on_input``, in fp32, rounded once),
    ``impl.expert_mm`` with ``in_proj`` (E, H', D), the in-bias, the activation in fp32, the
    second ``expert_mm`` with ``out_proj`` (E, D, H), the out-bias, then ``impl.combine``
    (weighted unless ``weight_on_input``). Differentiable in x, the weights, the biases and the
    routing weights; deterministic."""
    xs_RD = impl.gather(rows)
    expert_R, offsets = rows.expert_indices, rows.offsets
    if features.weight_on_input:
        xs_RD = (xs_RD.float() * plan.weights[:, None]).to(xs_RD.dtype)
    h_RX = impl.expert_mm(xs_RD, in_proj, offsets, expert_R)
    if features.in_bias is not None:
        h_RX = h_RX + row_bias(features.in_bias, expert_R, h_RX.dtype)
    if features.swiglu is not None:
        a_RH = features.swiglu(h_RX).to(h_RX.dtype)
    else:
        a_RH = activation(h_RX, gated)
    o_RD = impl.expert_mm(a_RH.contiguous(), out_proj, offsets, expert_R)
    if features.out_bias is not None:
        o_RD = o_RD + row_bias(features.out_bias, expert_R, o_RD.dtype)
    return impl.combine(o_RD, plan, x_TD, weighted=not features.weight_on_input)
