"""The op registry: one :class:`OpSpec` per public op of ``moe_kernels``.

``moe-bench verify``, ``moe-bench kernels`` and the pytest-benchmark suite iterate ``REGISTRY``;
a test checks that it covers ``moe_kernels.__all__`` (the result types in ``RESULT_TYPES``
aside), so a new public op needs exactly one entry here: add it to a family module's
``ENTRIES`` (or a new module's, listed below).
"""

from __future__ import annotations

from moe_tools.ops import (
    attention,
    ep_tokens,
    expert_mlp,
    experts,
    fp8_gemm,
    fp8_rows,
    mxfp8,
    routing,
    tokens,
)
from moe_tools.ops.spec import SIZE_CLASSES, CheckFailed, OpSpec, Problem, Sizes, fbgemm_ops

FAMILIES = (routing, tokens, ep_tokens, fp8_rows, experts, expert_mlp, fp8_gemm, mxfp8, attention)
REGISTRY: dict[str, OpSpec] = {spec.name: spec for family in FAMILIES for spec in family.ENTRIES}

# Public names of moe_kernels that are result types, not ops: the op that returns each.
RESULT_TYPES = {
    "CombinedTokens": "combine_shuffling",
    "Fp8Rows": "silu_mul_quant",  # gather_scale_quant_dense_tokens returns one too
    "Fp8Weights": "quantize_fp8_weights",
    "RoutingPlan": "route",
    "ShuffledIndices": "index_shuffling",
    "TopkChoices": "topk_choices",
}

__all__ = [
    "REGISTRY",
    "RESULT_TYPES",
    "SIZE_CLASSES",
    "CheckFailed",
    "OpSpec",
    "Problem",
    "Sizes",
    "fbgemm_ops",
    "missing_ops",
]


def missing_ops() -> list[str]:
    """Public names of ``moe_kernels`` that neither the registry nor ``RESULT_TYPES`` covers."""
    import moe_kernels

    return sorted(set(moe_kernels.__all__) - set(REGISTRY) - set(RESULT_TYPES))
