"""``SharedExperts``: the always-on MLP of a DeepSeek-style MoE layer (every token, no routing)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_model._checks import check_device
from moe_model.impls import check_dtype


class SharedExperts(nn.Module):
    """``x (T, d_model) -> (T, d_model)``: SiLU MLP, or SwiGLU ``silu(gate) * up`` when gated.

    Parameters (no biases): ``in_proj (hidden * (2 if gated else 1), d_model)`` (gate rows
    first), ``out_proj (d_model, hidden)``; ``hidden`` is the MoE layer's expert hidden size
    times its number of shared experts (n experts of one token fused into one MLP), or its
    ``shared_hidden``.
    ``device`` is checked when built (``moe_model._checks.check_device``: ValueError naming it),
    ``dtype`` too (None or a float dtype: TypeError naming it).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        gated: bool,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device(device)
        if dtype is not None:
            check_dtype(dtype, None, name="dtype")
        self.d_model, self.hidden, self.gated = d_model, hidden, gated
        h_in = hidden * (2 if gated else 1)
        self.in_proj = nn.Parameter(torch.empty(h_in, d_model, device=device, dtype=dtype))
        self.out_proj = nn.Parameter(torch.empty(d_model, hidden, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.in_proj, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.out_proj, std=1.0 / math.sqrt(self.hidden))

    def forward(
        self,
        x_TD: torch.Tensor,
        compute_dtype: torch.dtype | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The MLP of x_TD (T, d_model), returned in ``out_dtype`` (default: x's dtype). The
        GEMMs run in ``compute_dtype`` (default: the weights' dtype), the activation in fp32."""
        dtype = compute_dtype or self.in_proj.dtype
        h_TH = F.linear(x_TD.to(dtype), self.in_proj.to(dtype)).float()
        if self.gated:
            gate_TH, up_TH = h_TH.chunk(2, dim=-1)
            a_TH = F.silu(gate_TH) * up_TH
        else:
            a_TH = F.silu(h_TH)
        return F.linear(a_TH.to(dtype), self.out_proj.to(dtype)).to(out_dtype or x_TD.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, hidden={self.hidden}, gated={self.gated}"
