"""The ``"moe_kernels"`` experts backend: ``experts_forward``, an ``ExpertsInterface``
function (transformers calls it after the model's own router).

The backend takes HF's routing as given (``top_k_index``, ``top_k_weights``), builds the plan
with ``moe_kernels.plan_from_choices`` and runs the experts on it, deterministic and without host
syncs (torch.compile fullgraph, CUDA graphs); the gradient reaches the router through the
weights. Two paths, by what the experts module holds:

* fused: SiLU or SiLU-gated experts (gate rows first) without biases (Mixtral, Qwen2-MoE,
  Qwen3-MoE, OLMoE, DeepSeek-V3, ...): ``moe_kernels.routed_experts``, one autograd node;
* composed, for everything else an HF experts module can hold (per-expert biases, its own
  ``_apply_gate`` such as GPT-OSS's clamped ``alpha`` SwiGLU on interleaved rows, another
  activation, a post-expert norm): ``moe_kernels.gather_grouped_mm`` for both projections, the
  biases by expert, the module's own gate or activation and norm in torch, then
  ``moe_kernels.combine``.

Outputs in the hidden states' dtype, combined in fp32 in choice order; fp32 inputs compute in
fp32 (the CPU path runs the kernels' torch references).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations import moe as _hf_moe

import moe_kernels as mk
from moe_model.expert_features import row_bias

BACKEND = "moe_kernels"


def fused(experts: nn.Module) -> bool:
    """Whether ``experts`` runs as one ``routed_experts`` node: SiLU(-gated, gate rows first)
    experts without biases, a post-expert norm or a gate of their own."""
    if getattr(experts, "has_bias", False) or getattr(experts, "has_post_expert_norm", False):
        return False
    if getattr(experts, "has_gate", True) and (
        not getattr(experts, "is_concatenated", True)
        or getattr(type(experts), "_apply_gate", None) is not _hf_moe._default_apply_gate
    ):
        return False
    return isinstance(getattr(experts, "act_fn", None), (nn.SiLU, SiLUActivation))


def _check_call(experts: nn.Module, x_TD: object, index_TK: object, weights_TK: object) -> None:
    """ValueError / TypeError naming what is missing or mismatched, before any kernel runs."""
    name = type(experts).__name__
    gated = getattr(experts, "has_gate", True)
    needed = ["num_experts", "gate_up_proj" if gated else "up_proj", "down_proj"]
    if getattr(experts, "has_bias", False):
        needed += ["gate_up_proj_bias" if gated else "up_proj_bias", "down_proj_bias"]
    missing = [a for a in needed if getattr(experts, a, None) is None]
    if missing:
        raise ValueError(f"experts_implementation={BACKEND!r}: {name} has no {', '.join(missing)}")
    for arg, t in (("hidden_states", x_TD), ("top_k_index", index_TK),
                   ("top_k_weights", weights_TK)):  # fmt: skip
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{arg} must be a 2-D tensor, got {got}")
    w_in = experts.gate_up_proj if gated else experts.up_proj
    d = w_in.shape[1] if getattr(experts, "is_transposed", False) else w_in.shape[2]
    if x_TD.shape[1] != d:
        raise ValueError(
            f"hidden_states must have {name}'s hidden size {d} columns, got {tuple(x_TD.shape)}"
        )
    if index_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"top_k_index must have one row per token ({x_TD.shape[0]}), got "
            f"{tuple(index_TK.shape)}"
        )


def _weights(experts: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_in (E, H', D), w_out (E, D, H)) as views in ``dtype``, whatever the storage."""
    gated = getattr(experts, "has_gate", True)
    w_in = experts.gate_up_proj if gated else experts.up_proj
    w_out = experts.down_proj
    if getattr(experts, "is_transposed", False):
        w_in, w_out = w_in.mT, w_out.mT
    return w_in.to(dtype), w_out.to(dtype)


def _bias(b_EN: torch.Tensor | None, expert_R: torch.Tensor, dtype: torch.dtype):
    """(R, N): each row's expert's bias (zero for the tail's -1), or None."""
    return None if b_EN is None else row_bias(b_EN, expert_R, dtype)


def _composed(experts: nn.Module, x_TD: torch.Tensor, plan: mk.RoutingPlan) -> torch.Tensor:
    """The experts as separate steps (any HF experts module): rows grouped by the plan."""
    dtype = x_TD.dtype
    w_in, w_out = _weights(experts, dtype)
    has_bias = getattr(experts, "has_bias", False)
    gated = getattr(experts, "has_gate", True)
    b_in = (experts.gate_up_proj_bias if gated else experts.up_proj_bias) if has_bias else None
    b_out = experts.down_proj_bias if has_bias else None
    h_RX = mk.gather_grouped_mm(x_TD, w_in, plan.offsets, plan.token_indices)
    bias_RX = _bias(b_in, plan.expert_indices, dtype)
    if bias_RX is not None:
        h_RX = h_RX + bias_RX
    a_RH = experts._apply_gate(h_RX) if gated else experts.act_fn(h_RX)
    o_RD = mk.gather_grouped_mm(a_RH.to(dtype).contiguous(), w_out, plan.offsets)
    bias_RD = _bias(b_out, plan.expert_indices, dtype)
    if bias_RD is not None:
        o_RD = o_RD + bias_RD
    if getattr(experts, "has_post_expert_norm", False):
        o_RD = experts.post_expert_norm(o_RD)
    return mk.combine(o_RD.to(dtype), plan, weighted=True, out_dtype=dtype)


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An ``ExpertsInterface`` function: ``self`` is a transformers experts module (weights
    ``gate_up_proj`` (E, 2H, D) or ``up_proj`` (E, H, D), ``down_proj`` (E, D, H); (E, D, 2H) and
    (E, H, D) when ``is_transposed``); hidden_states (T, D); top_k_index (T, k) int, expert ids
    (ids outside [0, E), expert-parallel sentinels, contribute nothing); top_k_weights (T, k)
    float. Returns (T, D) in hidden_states' dtype: ``sum_j w[t, j] * expert_{i[t, j]}(x[t])``,
    accumulated in fp32 in choice order."""
    _check_call(self, hidden_states, top_k_index, top_k_weights)
    x_TD = hidden_states
    plan = mk.plan_from_choices(top_k_index, top_k_weights, self.num_experts)
    if not fused(self):
        return _composed(self, x_TD, plan)
    w_in, w_out = _weights(self, x_TD.dtype)
    gated = getattr(self, "has_gate", True)
    return mk.routed_experts(x_TD, w_in, w_out, plan, gated=gated, out_dtype=x_TD.dtype)


def register(name: str = BACKEND) -> None:
    """Register ``experts_forward`` as ``name`` in transformers' global ``ExpertsInterface``
    (idempotent; done on import under ``"moe_kernels"``)."""
    _hf_moe.ExpertsInterface.register(name, experts_forward)
