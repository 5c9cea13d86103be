"""``MOE_PRESETS``: the MoE layers of published models, as ``MoELayer`` keyword arguments.

``MoELayer.from_preset(name, **overrides)`` builds one (overrides replace any argument: a
smaller ``d_model`` for a test, ``impl``, ``device``, ``dtype``). The sizes are one MoE layer of
each model (attention, dense layers and embeddings are not part of it):

- ``deepseek-v3``: DeepSeek-V3 / R1 (671B total, 37B active): 256 routed SwiGLU experts of
  hidden 2048 and one shared expert, sigmoid scores, selection by ``scores + expert_bias``
  (auxiliary-loss-free balancing) within the top 4 of 8 expert groups, top-8 weights
  renormalised and scaled by 2.5. 22 GB of weights in bf16: build it with ``device="cuda",
  dtype=torch.bfloat16``.
- ``qwen3-30b-a3b``: Qwen3-30B-A3B: 128 SwiGLU experts of hidden 768, softmax, top-8
  renormalised.
- ``mixtral-8x7b``: Mixtral 8x7B: 8 SwiGLU experts of hidden 14336, softmax, top-2
  renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


def _frozen(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType(kwargs)


MOE_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "deepseek-v3": _frozen(
            d_model=7168,
            n_experts=256,
            top_k=8,
            hidden=2048,
            gated=True,
            score_fn="sigmoid",
            renormalize=True,
            expert_bias=True,
            n_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
        ),
        "qwen3-30b-a3b": _frozen(
            d_model=2048,
            n_experts=128,
            top_k=8,
            hidden=768,
            gated=True,
            score_fn="softmax",
            renormalize=True,
        ),
        "mixtral-8x7b": _frozen(
            d_model=4096,
            n_experts=8,
            top_k=2,
            hidden=14336,
            gated=True,
            score_fn="softmax",
            renormalize=True,
        ),
    }
)


def preset_kwargs(name: object, **overrides: Any) -> dict[str, Any]:
    """The ``MoELayer`` keyword arguments of preset ``name`` with ``overrides`` applied
    (ValueError listing the presets for an unknown name)."""
    if not isinstance(name, str) or name not in MOE_PRESETS:
        raise ValueError(f"unknown MoE preset {name!r}; presets: {', '.join(MOE_PRESETS)}")
    return {**MOE_PRESETS[name], **overrides}
