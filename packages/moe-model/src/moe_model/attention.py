"""Grouped-query self-attention with QK-norm and 3-axis RoPE over the KV ring buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moe_kernels import qk_norm_rope
from moe_model.kv_cache import KVRingCache


class RMSNorm(nn.Module):
    """RMS normalisation in fp32 over the last dim, optional learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class Attention(nn.Module):
    """One frame's N tokens attend to the filled ring slots and to themselves.

    Query head h uses kv head h // G (G = n_heads // n_kv_heads). The G query heads sharing a kv
    head are folded into the query length, so a plain SDPA call (no GQA support needed) runs
    (kv_heads, G * N, head_dim) queries against (kv_heads, (window + 1) * N, head_dim) keys.
    QK-norm, RoPE and the KV cache write are one op (``moe_kernels.qk_norm_rope``: one Triton
    kernel on CUDA, the torch formula on the CPU); inference only (no autograd through it).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def _write_ring(self, k_NC, v_NC, cos_NP, sin_NP, cache: KVRingCache, layer: int) -> None:
        """k (normed, rotated) and v of the frame into its ring slot ``frame % window``."""
        qk_norm_rope(
            None, k_NC, v_NC, None, self.k_norm.weight, cos_NP, sin_NP, cache.k, cache.v, layer,
            cache.ring_slot(), eps=self.k_norm.eps,
        )  # fmt: skip

    def forward(
        self,
        x_ND: torch.Tensor,
        ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cache: KVRingCache,
        layer: int,
        biases: Sequence[torch.Tensor | None],
        *,
        commit: bool,
        kv_only: bool = False,
    ) -> torch.Tensor | None:
        """``x_ND`` holds P = ``len(ropes)`` passes of N tokens each, one after another (P = 1, or
        2: the cache pass of the previous frame and a denoise pass of the next, one frame apart),
        with pass p's RoPE tables ``ropes[p]`` ((cos_NP, sin_NP)) and additive mask ``biases[p]``
        over the (window + 1) * N keys (None when every slot is filled: SDPA can then take its
        flash kernel). The projections run once over all rows; each pass attends on its own.

        ``commit``: pass 0 also writes its keys/values into the ring slot ``frame % window``,
        after attending (so it sees the same history as its denoise pass: the slot still holds the
        frame ``window`` back), before the next pass attends (which sees it). ``kv_only``: pass 0
        commits only (no attention); the output then holds the other passes' rows (None for P = 1).

        Per attending pass: one ``qk_norm_rope`` call writing the scratch slot and returning q,
        then SDPA; a commit adds a second call without q for the ring slot."""
        P = len(ropes)
        N = x_ND.shape[0] // P
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        k_NC, v_NC = self.k_proj(x_ND), self.v_proj(x_ND)
        first = 1 if kv_only else 0  # the first pass that attends
        if kv_only:
            self._write_ring(k_NC[:N], v_NC[:N], *ropes[0], cache, layer)
            if P == 1:
                return None
        q_NC = self.q_proj(x_ND[first * N :])
        G = H // Hkv
        outs = []
        for p in range(first, P):
            rows = slice(p * N, (p + 1) * N)
            cos_NP, sin_NP = ropes[p]
            q_HND = qk_norm_rope(
                q_NC[(p - first) * N : (p - first + 1) * N], k_NC[rows], v_NC[rows],
                self.q_norm.weight, self.k_norm.weight, cos_NP, sin_NP, cache.k, cache.v, layer,
                cache.scratch_slot, eps=self.k_norm.eps,
            )  # fmt: skip
            k_HSD, v_HSD = cache.layer_kv(layer)
            q_HMD = q_HND.view(Hkv, G * N, Dh)  # head h = hkv * G + g
            bias_S = biases[p]
            o_HMD = F.scaled_dot_product_attention(
                q_HMD[None],
                k_HSD[None],
                v_HSD[None],
                attn_mask=None if bias_S is None else bias_S.view(1, 1, 1, -1),
            )[0]
            outs.append(o_HMD.view(Hkv, G, N, Dh).permute(2, 0, 1, 3).reshape(N, H * Dh))
            if commit and p == 0:
                self._write_ring(k_NC[rows], v_NC[rows], cos_NP, sin_NP, cache, layer)
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
