"""Pure-torch reference for the fused router (the CPU path and the tests' oracle).

Exactly ``moe_model.MoELayer.scores``: ``softmax(F.linear(x.float(), w.float()), -1)`` (or
sigmoid). Inputs are assumed checked by ``moe_kernels.router``. Sync-free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores(x_TD: torch.Tensor, weight_ED: torch.Tensor, score_fn: str) -> torch.Tensor:
    """(T, E) float32 scores: softmax (over E) or sigmoid of the fp32 logits ``x @ w.T``."""
    logits_TE = F.linear(x_TD.float(), weight_ED.float())
    if score_fn == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    return torch.sigmoid(logits_TE)
