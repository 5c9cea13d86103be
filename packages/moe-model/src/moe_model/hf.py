"""Hugging Face transformers' MoE models on moe-kernels: the ``"moe_kernels"`` experts backend.

transformers (5.x) runs every MoE experts module through its ``ExpertsInterface``
(``config._experts_implementation``). Importing this module (it needs transformers; importing
``moe_model`` never does) registers ``"moe_kernels"`` there::

    import moe_model.hf  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moe_kernels")
    model.set_experts_implementation("moe_kernels")  # or switch a loaded model

The backend takes HF's routing as given (``top_k_index``, ``top_k_weights``, from the model's
own router) and runs the experts and the weighted combine as ``moe_kernels.routed_experts`` on
the plan ``moe_kernels.plan_from_choices`` builds: one autograd node, deterministic, no host
sync (torch.compile fullgraph, CUDA graphs); the gradient reaches the router through the
weights. Outputs in the hidden states' dtype; fp32 inputs compute in fp32 (the CPU path: the
kernels' torch references).

Experts it runs: SiLU-gated (``gate_up_proj`` (E, 2H, D), gate rows first: Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3, ...) or SiLU (``up_proj``), transposed storage too. Experts with
per-expert biases, another activation or gate (GPT-OSS), interleaved gate/up rows or a post-expert
norm get a ValueError naming the feature, not a silent fallback.
"""

from __future__ import annotations

import torch
from torch import nn

import moe_kernels as mk

try:
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as _hf_moe
except ImportError as e:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(
        "moe_model.hf needs Hugging Face transformers >= 5 (pip install 'moe-model[hf]')"
    ) from e

BACKEND = "moe_kernels"


def _check_experts(experts: nn.Module) -> None:
    """ValueError naming what this backend cannot run (no silent fallback)."""
    name = type(experts).__name__
    problems = []
    if getattr(experts, "has_bias", False):
        problems.append("per-expert biases (has_bias=True)")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("a post-expert norm")
    if getattr(experts, "has_gate", True):
        if not getattr(experts, "is_concatenated", True):
            problems.append("interleaved gate/up rows (is_concatenated=False)")
        if type(experts)._apply_gate is not _hf_moe._default_apply_gate:
            problems.append(f"its own gate ({name}._apply_gate)")
    if getattr(experts, "limit", None) is not None:
        problems.append("clamped activations (limit)")
    if not isinstance(getattr(experts, "act_fn", None), (nn.SiLU, SiLUActivation)):
        problems.append(f"activation {type(getattr(experts, 'act_fn', None)).__name__}")
    if problems:
        raise ValueError(
            f"experts_implementation={BACKEND!r} cannot run {name}: {', '.join(problems)} "
            "(supported: SiLU or SiLU-gated experts, gate rows first, no biases); use "
            "experts_implementation='grouped_mm' for this model"
        )


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
    _check_experts(self)
    gated = getattr(self, "has_gate", True)
    w_in = self.gate_up_proj if gated else self.up_proj
    w_out = self.down_proj
    if getattr(self, "is_transposed", False):
        w_in, w_out = w_in.mT, w_out.mT
    x_TD = hidden_states
    dtype = x_TD.dtype
    plan = mk.plan_from_choices(top_k_index, top_k_weights, w_in.shape[0])
    return mk.routed_experts(
        x_TD, w_in.to(dtype), w_out.to(dtype), plan, gated=gated, out_dtype=dtype
    )


def register(name: str = BACKEND) -> None:
    """Register ``experts_forward`` as ``name`` in transformers' global ``ExpertsInterface``
    (idempotent; done on import under ``"moe_kernels"``)."""
    _hf_moe.ExpertsInterface.register(name, experts_forward)


register()
