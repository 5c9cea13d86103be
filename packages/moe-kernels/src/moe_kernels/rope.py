"""The attention prologue of a KV-ring-cached transformer in one op: QK RMS-norm, RoPE and the
KV cache write (``qk_norm_rope``).

It replaces, per attention layer and pass, ``q = rope(q_norm(q))``, ``k = rope(k_norm(k))``,
writing k and v into the ring cache slots with ``index_copy_`` and laying q out head-major for
SDPA: one Triton kernel that reads q, k and v once and writes q_out and the cache slots. A
``torch.library`` custom op (``moe_kernels::qk_norm_rope``) that declares its cache mutation;
under ``torch.compile`` on CUDA Inductor emits the kernel itself. No host syncs (the slots are
read on the device), deterministic (no atomics), safe inside CUDA-graph capture. Inference only
(no autograd).
"""

from __future__ import annotations

import math

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import rope as _ref

__all__ = ["qk_norm_rope"]

_MAX_SLOTS = 2


def _triton():
    return triton_kernels("rope")  # imported on first use: triton only when a kernel runs


def _rope_impl(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    args = (q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps)
    if not use_triton(k.device):
        return _ref.qk_norm_rope(*args)
    return _triton().qk_norm_rope(*args)


def _rope_fake(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps):
    D = k_cache.shape[-1]
    H = 0 if q is None else q.shape[1] // D
    return k.new_empty((H, k.shape[0], D))


qk_norm_rope_op = register_op(
    "qk_norm_rope", _rope_impl, _rope_fake, mutates_args=("k_cache", "v_cache")
)


def _like_k(name: str, t: object, k: torch.Tensor, ndim: int) -> torch.Tensor:
    """A tensor of k's dtype and rank ``ndim``."""
    t = V.tensor(name, t)
    if t.dtype != k.dtype:
        raise TypeError(f"{name} must have k's dtype {k.dtype}, got {t.dtype}")
    V.rank(name, t, ndim)
    return t


def _check(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps) -> float:
    """Raises naming the first bad argument; returns eps as a float."""
    k = V.tensor("k", k)
    V.dtype("k", k, V.FLOAT_DTYPES)
    V.rank("k", k, 2)
    v = _like_k("v", v, k, 2)
    k_cache = _like_k("k_cache", k_cache, k, 5)
    v_cache = _like_k("v_cache", v_cache, k, 5)
    if v_cache is k_cache:
        raise ValueError("v_cache must be another tensor than k_cache")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous (L, K, S, N, D), got strides {c.stride()}")
    L, K, S, N, D = k_cache.shape
    if D < 2 or D % 2:
        raise ValueError(f"k_cache's head dim (dim 4) must be even and >= 2, got {D}")
    V.dim_size("k", k, 0, N, "N, the tokens of k_cache (dim 3)")
    V.dim_size("k", k, 1, K * D, "K*D, the kv heads times head dim of k_cache")
    V.dim_size("v", v, 0, N, "N, the tokens of k_cache (dim 3)")
    V.dim_size("v", v, 1, K * D, "K*D, the kv heads times head dim of k_cache")
    V.same_device("k", k, v=v, k_cache=k_cache, v_cache=v_cache)
    if q is not None:
        q = _like_k("q", q, k, 2)
        V.dim_size("q", q, 0, N, "N, the tokens of k_cache (dim 3)")
        if q.shape[1] % D:
            raise ValueError(f"q's columns must be H*D, a multiple of D={D}, got {q.shape}")
        V.same_device("k", k, q=q)
    weights = {"k_weight": k_weight} if q is None else {"q_weight": q_weight, "k_weight": k_weight}
    for name, w in weights.items():
        w = V.tensor(name, w)
        V.dtype(name, w, V.FLOAT_DTYPES)
        V.rank(name, w, 1)
        V.dim_size(name, w, 0, D, "D, the head dim")
        V.same_device("k", k, **{name: w})
    for name, t in (("cos", cos), ("sin", sin)):
        t = V.tensor(name, t)
        V.dtype(name, t, V.FLOAT_DTYPES)
        V.rank(name, t, 2)
        V.dim_size(name, t, 0, N, "N tokens")
        V.dim_size(name, t, 1, D // 2, "D // 2 rotation pairs")
        V.same_device("k", k, **{name: t})
    V.int_arg("layer", layer, 0, L - 1)
    slots = V.tensor("slots", slots)
    V.dtype("slots", slots, (torch.int64,))
    V.rank("slots", slots, 1)
    if not 1 <= slots.shape[0] <= _MAX_SLOTS:
        raise ValueError(f"slots must hold 1 or 2 slot indices, got shape {tuple(slots.shape)}")
    V.same_device("k", k, slots=slots)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    return float(eps)


def qk_norm_rope(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """QK RMS-norm + RoPE of one layer's q and k, and k / v written into KV cache slots.

    Legend: N tokens, H query heads, K kv heads, D head dim (even), P = D // 2 rotation pairs,
    L layers, S cache slots.

    q: (N, H*D) or None; k, v: (N, K*D), 2-D, any strides (column slices of one fused projection
    are fine), bf16/fp16/fp32, one dtype. q_weight (None without q), k_weight: (D,) RMS-norm
    scales, any float dtype. cos, sin: (N, P) float, the token's rotation angles. k_cache,
    v_cache: (L, K, S, N, D) contiguous, k's dtype. layer: int in [0, L). slots: (1,) or (2,)
    int64 on the device, read there (never on the host); each must lie in [0, S): a slot
    outside it (not checked, that would sync) is skipped, nothing written for it, on every
    path (memory-safe; the same result on each).

    For head x (N, D) of q or k, per token: ``y = (x * rsqrt(mean(x^2) + eps)) * w`` in fp32,
    rounded to x's dtype, then pairs (y[2i], y[2i+1]) -> (y0 c - y1 s, y0 s + y1 c) in fp32
    (c, s = cos, sin[:, i]), rounded to x's dtype: the world model's ``RMSNorm`` then
    ``apply_rope``. In place, for each s in slots: ``k_cache[layer, :, s] = rope(norm(k))`` and
    ``v_cache[layer, :, s] = v`` (bit copy), as (K, N, D); nothing else changes.

    Returns q_out = rope(norm(q)) (H, N, D) contiguous in q's dtype (head h = kv head h // G
    times G + g, so ``q_out.view(K, G*N, D)`` is the folded-GQA query of SDPA, G = H // K), or
    an empty (0, N, D) tensor when q is None.

    The kernel matches the reference (``moe_kernels.reference.rope``) except for the order of
    the fp32 sum over D: a normed value may land one ulp of x's dtype away, so an output within
    a couple of ulps at its pair's magnitude (``tests/test_rope.py`` states the bound);
    bitwise reproducible run to run.
    """
    eps = _check(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps)
    args = (q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps)
    return qk_norm_rope_op.call(*args)
