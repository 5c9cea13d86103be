"""moe-model: an MoE layer with interchangeable implementations, and a frame-autoregressive world
model (diffusion transformer + KV ring buffer) built on moe-kernels."""

import moe_kernels  # noqa: F401  (first: its import of torch keeps torch's numpy warning quiet)
from moe_model.config import PRESETS, WorldModelConfig
from moe_model.engine import WorldEngine
from moe_model.expert_features import SwiGLU
from moe_model.expert_parallel import ExpertParallelMoE
from moe_model.impls import IMPL_ALIASES, IMPLS, MOE_IMPLS, MoEImpl
from moe_model.moe import MoELayer
from moe_model.presets import MOE_PRESETS
from moe_model.world import count_parameters

__version__ = "0.1.0"

__all__ = [
    "ExpertParallelMoE",
    "IMPL_ALIASES",
    "IMPLS",
    "MOE_IMPLS",
    "MOE_PRESETS",
    "PRESETS",
    "SwiGLU",
    "MoEImpl",
    "MoELayer",
    "WorldEngine",
    "WorldModelConfig",
    "count_parameters",
]
