"""moe-kernels: Triton kernels for Mixture-of-Experts token routing and MXFP8.

CUDA tensors run Triton kernels; CPU tensors run the pure-torch references (or the Triton kernels
in the interpreter when ``TRITON_INTERPRET=1``). Every op is a ``torch.library`` custom op with a
fake implementation: safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no host
syncs, deterministic.
"""

__version__ = "0.1.0"

import warnings

with warnings.catch_warnings():
    # torch warns at import where numpy is missing (a kernels-only install has none, and none is
    # needed here): silenced for that one message, when this import is torch's first
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from moe_kernels.activation import expert_activation
from moe_kernels.choices_plan import plan_from_choices
from moe_kernels.dense_tokens import gather_scale_dense_tokens, scatter_add_dense_tokens
from moe_kernels.expert_mlp import expert_mlp
from moe_kernels.fp8 import Fp8Weights, fp8_grouped_mm, quantize_fp8_weights
from moe_kernels.gather_quant import gather_scale_quant_dense_tokens
from moe_kernels.grouped_mm import gather_grouped_mm, grouped_weight_grad
from moe_kernels.mxfp8 import (
    compute_per_group_blocked_scale_offsets,
    from_mxfp8,
    mxfp8_grouped_mm,
    to_blocked,
    to_blocked_per_group_2d,
    to_blocked_per_group_3d,
    to_mxfp8,
    to_mxfp8_dim1,
)
from moe_kernels.padded_tokens import scatter_add_padded_tokens
from moe_kernels.rope import qk_norm_rope
from moe_kernels.routed_experts import routed_experts
from moe_kernels.router import router_scores
from moe_kernels.routing import RoutingPlan, ShuffledIndices, index_shuffling, route
from moe_kernels.selection import TopkChoices, topk_choices
from moe_kernels.shuffling import CombinedTokens, combine_shuffling, split_shuffling
from moe_kernels.swiglu import Fp8Rows, silu_mul, silu_mul_quant
from moe_kernels.tokens import combine, dispatch

__all__ = [
    "CombinedTokens",
    "Fp8Rows",
    "Fp8Weights",
    "RoutingPlan",
    "ShuffledIndices",
    "TopkChoices",
    "combine",
    "combine_shuffling",
    "compute_per_group_blocked_scale_offsets",
    "dispatch",
    "expert_activation",
    "expert_mlp",
    "fp8_grouped_mm",
    "from_mxfp8",
    "gather_grouped_mm",
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "grouped_weight_grad",
    "index_shuffling",
    "mxfp8_grouped_mm",
    "plan_from_choices",
    "qk_norm_rope",
    "quantize_fp8_weights",
    "route",
    "routed_experts",
    "router_scores",
    "scatter_add_dense_tokens",
    "scatter_add_padded_tokens",
    "silu_mul",
    "silu_mul_quant",
    "split_shuffling",
    "to_blocked",
    "to_blocked_per_group_2d",
    "to_blocked_per_group_3d",
    "to_mxfp8",
    "to_mxfp8_dim1",
    "topk_choices",
]
