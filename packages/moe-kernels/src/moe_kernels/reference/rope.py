"""Pure-torch reference for ``qk_norm_rope`` (the CPU path and the tests' oracle).

Exactly the world model's attention prologue (``moe_model.attention.RMSNorm`` then
``moe_model.rope.apply_rope``), op for op, followed by the KV ring write the model did with
``index_copy_``. Inputs are assumed checked by ``moe_kernels.rope``. Sync-free (the slots are
read by ``index_copy_`` on the device; one outside [0, S) is skipped, as in the kernel).

Legend: N tokens, H query heads, K kv heads, D head dim, P = D // 2 rotation pairs, L layers,
S cache slots.
"""

from __future__ import annotations

import torch


def rms_norm(x_NhD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over D in fp32 times the scale, cast back to x's dtype (the model rounds here)."""
    x32 = x_NhD.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight_D.float()
    return y.to(x_NhD.dtype)


def rope(x_NhD: torch.Tensor, cos_NP: torch.Tensor, sin_NP: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) by the token's angles in fp32, x's dtype."""
    N, h, D = x_NhD.shape
    x_NhP2 = x_NhD.float().view(N, h, D // 2, 2)
    x0, x1 = x_NhP2[..., 0], x_NhP2[..., 1]
    c, s = cos_NP[:, None, :], sin_NP[:, None, :]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return out.view(N, h, D).to(x_NhD.dtype)


def norm_rope(
    x_NC: torch.Tensor, weight_D: torch.Tensor, cos_NP: torch.Tensor, sin_NP: torch.Tensor,
    eps: float,
) -> torch.Tensor:  # fmt: skip
    """(N, h, D): rope(rms_norm(x viewed as (N, h, D)))."""
    D = weight_D.shape[0]
    x_NhD = x_NC.reshape(x_NC.shape[0], x_NC.shape[1] // D, D)
    return rope(rms_norm(x_NhD, weight_D, eps), cos_NP, sin_NP)


def qk_norm_rope(
    q_NC: torch.Tensor | None,
    k_NC: torch.Tensor,
    v_NC: torch.Tensor,
    q_weight_D: torch.Tensor | None,
    k_weight_D: torch.Tensor,
    cos_NP: torch.Tensor,
    sin_NP: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots_J: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Writes ``k_cache[layer, :, s] = rope(norm(k))`` (K, N, D) and ``v_cache[layer, :, s] = v``
    for each s in slots; returns rope(norm(q)) as (H, N, D) contiguous, or (0, N, D) without q.
    A slot outside [0, S) is skipped, as the kernel skips it (no sync: such a slot rewrites
    slot 0 with its own contents)."""
    N, D = k_NC.shape[0], k_cache.shape[-1]
    S = k_cache.shape[2]
    k_KND = norm_rope(k_NC, k_weight_D, cos_NP, sin_NP, eps).transpose(0, 1)
    v_KND = v_NC.reshape(N, v_NC.shape[1] // D, D).transpose(0, 1)
    for j in range(slots_J.shape[0]):  # in order: a later slot sees an earlier one's write
        slot = slots_J[j : j + 1]
        ok = (slot >= 0) & (slot < S)
        safe = torch.where(ok, slot, 0)
        for cache, new_KND in ((k_cache, k_KND), (v_cache, v_KND)):
            old = cache[layer].index_select(1, safe)
            cache[layer].index_copy_(1, safe, torch.where(ok, new_KND.unsqueeze(1), old))
    if q_NC is None:
        return k_NC.new_empty((0, N, D))
    q_NHD = norm_rope(q_NC, q_weight_D, cos_NP, sin_NP, eps)
    return q_NHD.transpose(0, 1).contiguous()
