"""Independent oracles of the public ops: naive, obviously-correct formulas (Python loops,
float64, numpy where it reads plainest), by op family. None is the code it checks or its
``moe_kernels.reference`` twin; the tests and ``moe-bench verify`` (``moe_tools.ops``) compare
the ops against these.

Names: ``oracle_<op or what it computes>``; ``*_f64`` / ``*_exact`` are float64 values (with a
bound where the op's rounding needs one), the others the op's own precision (bit-exact
expectations), or numpy bytes (``*_bits``).
"""

from moe_kernels.testing.oracles.experts import (
    oracle_expert_mlp_formula,
    oracle_expert_mlp_rows,
    oracle_gather_grouped_mm,
    oracle_grouped_weight_grad,
    oracle_routed_experts_formula,
)
from moe_kernels.testing.oracles.fp8_rows import (
    oracle_gather_quant,
    oracle_quant_rows,
    oracle_silu_mul,
    oracle_silu_mul_exact,
)
from moe_kernels.testing.oracles.mxfp8 import (
    oracle_blocked,
    oracle_blocked_start_rows,
    oracle_dequant,
    oracle_e4m3,
    oracle_e4m3_bits,
    oracle_e4m3_value,
    oracle_mxfp8,
    oracle_mxfp8_bits,
    oracle_mxfp8_exponent,
    oracle_mxfp8_grouped_mm_grads,
    oracle_mxfp8_round_trip,
    oracle_mxfp8_scale,
)
from moe_kernels.testing.oracles.rope import oracle_norm_rope, oracle_rope_model_formula
from moe_kernels.testing.oracles.routing import (
    oracle_pairs,
    oracle_route_plan,
    oracle_router_scores,
    oracle_selection_grad,
    oracle_selection_plan,
    oracle_token_plan,
    oracle_topk_choices,
    oracle_topk_weights,
)
from moe_kernels.testing.oracles.tokens import (
    oracle_combine,
    oracle_combine_f64,
    oracle_dispatch,
    oracle_fbgemm_combine_shuffling,
    oracle_fbgemm_scatter_add_padded,
    oracle_gather_scale,
    oracle_scatter_add,
    oracle_scatter_add_padded,
    oracle_shuffle,
    oracle_shuffle_chunks,
    oracle_shuffle_counts,
)

__all__ = [
    "oracle_blocked",
    "oracle_blocked_start_rows",
    "oracle_combine",
    "oracle_combine_f64",
    "oracle_dequant",
    "oracle_dispatch",
    "oracle_e4m3",
    "oracle_e4m3_bits",
    "oracle_e4m3_value",
    "oracle_expert_mlp_formula",
    "oracle_expert_mlp_rows",
    "oracle_fbgemm_combine_shuffling",
    "oracle_fbgemm_scatter_add_padded",
    "oracle_gather_grouped_mm",
    "oracle_gather_quant",
    "oracle_gather_scale",
    "oracle_grouped_weight_grad",
    "oracle_mxfp8",
    "oracle_mxfp8_bits",
    "oracle_mxfp8_exponent",
    "oracle_mxfp8_grouped_mm_grads",
    "oracle_mxfp8_round_trip",
    "oracle_mxfp8_scale",
    "oracle_norm_rope",
    "oracle_pairs",
    "oracle_quant_rows",
    "oracle_rope_model_formula",
    "oracle_route_plan",
    "oracle_router_scores",
    "oracle_routed_experts_formula",
    "oracle_scatter_add",
    "oracle_scatter_add_padded",
    "oracle_selection_grad",
    "oracle_selection_plan",
    "oracle_shuffle",
    "oracle_shuffle_chunks",
    "oracle_shuffle_counts",
    "oracle_silu_mul",
    "oracle_silu_mul_exact",
    "oracle_token_plan",
    "oracle_topk_choices",
    "oracle_topk_weights",
]
