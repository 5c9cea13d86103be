"""Registry entry of the attention prologue: ``qk_norm_rope`` (QK RMS-norm + RoPE + KV write)."""

from __future__ import annotations

import math
import random

import torch

from moe_kernels.testing import oracle_norm_rope
from moe_tools.ops.spec import OpSpec, Problem, Sizes, expect_equal, expect_within, randn, ulps

# ulps of the dtype at a rotated pair's magnitude: a normed value may round one ulp apart (the
# fp32 sum's order), the rotation moves that by at most sqrt(2) ulp, then one more rounding
TOL_ULPS = {torch.bfloat16: 3.0, torch.float16: 3.0, torch.float32: 8.0}
EPS = 1e-6


def _draw(rng: random.Random, large: bool) -> Sizes:
    S = 3
    return dict(
        N=rng.randint(1, 512 if large else 24),
        K=rng.choice([2, 16] if large else [1, 2]),
        G=rng.choice([1, 2]),
        D=rng.choice([64, 128] if large else [8, 16]),
        L=2,
        S=S,
        slots=rng.sample(range(S), rng.choice([1, 2])),
        q=rng.choice([True, False]),
        dtype=rng.choice(["bfloat16", "float16", "float32"]),
    )


def _make(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    N, K, G, D, L, S = s["N"], s["K"], s["G"], s["D"], s["L"], s["S"]
    dtype = getattr(torch, s.get("dtype", "bfloat16"))
    H = K * G
    with_q = s.get("q", True)
    q = randn((N, H * D), gen, device, dtype) if with_q else None
    k, v = randn((N, K * D), gen, device, dtype), randn((N, K * D), gen, device, dtype)
    q_weight = 1 + 0.1 * randn((D,), gen, device, torch.float32) if with_q else None
    k_weight = 1 + 0.1 * randn((D,), gen, device, torch.float32)
    angles = torch.rand(N, D // 2, generator=gen, device=gen.device).mul(2 * math.pi).to(device)
    k_cache = randn((L, K, S, N, D), gen, device, dtype)
    v_cache = randn((L, K, S, N, D), gen, device, dtype)
    slots = torch.tensor(s["slots"], dtype=torch.int64, device=device)
    args = (q, k, v, q_weight, k_weight, angles.cos(), angles.sin(), k_cache, v_cache, L - 1, slots)
    label = f"N={N} H={H} K={K} D={D} slots={len(s['slots'])}{'' if with_q else ' no q'}"
    return Problem(f"{label} {str(dtype).removeprefix('torch.')}", s, args, {"eps": EPS})


def _tolerance(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TOL_ULPS steps of ``dtype`` at each value's pair magnitude."""
    pairs = exact.unflatten(-1, (-1, 2))
    r = pairs.pow(2).sum(-1, keepdim=True).sqrt().expand_as(pairs).flatten(-2)
    return TOL_ULPS[dtype] * ulps(r, dtype)


def _oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """q_out against the oracle; in the caches the slots' rows against it (k) or bit for bit (v),
    every other entry unchanged."""
    q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots = p.args
    q_out, k_out, v_out = out
    N, K, D = k.shape[0], k_cache.shape[1], k_cache.shape[-1]
    worst = 0.0
    if q is None:
        expect_equal("q_out", q_out, torch.zeros(0, N, D))
    else:
        exact_q = oracle_norm_rope(q, q_weight, cos, sin, EPS).transpose(0, 1)
        bound = _tolerance(exact_q, q.dtype)
        worst = expect_within("q vs oracle", q_out, exact_q, bound)
    exact_k = oracle_norm_rope(k, k_weight, cos, sin, EPS).transpose(0, 1)  # (K, N, D)
    want_k, bound_k = k_cache.double().cpu(), torch.zeros(k_cache.shape, dtype=torch.float64)
    want_v = v_cache.double().cpu()
    for s in slots.tolist():
        want_k[layer, :, s] = exact_k
        bound_k[layer, :, s] = _tolerance(exact_k, k.dtype)
        want_v[layer, :, s] = v.double().cpu().reshape(N, K, D).transpose(0, 1)
    worst = max(worst, expect_within("k_cache vs oracle", k_out, want_k, bound_k))
    expect_equal("v_cache vs oracle", v_out, want_v)
    return worst


def _reference(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps=EPS):
    from moe_kernels.reference.rope import qk_norm_rope

    return qk_norm_rope(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, layer, slots, eps)


def _bytes(p: Problem) -> int:
    q, k, v = p.args[:3]
    qkv = sum(t.numel() for t in (q, k, v) if t is not None) * k.element_size()
    writes = (0 if q is None else q.numel()) + 2 * k.numel() * p.args[10].numel()
    return qkv + writes * k.element_size() + 2 * p.args[5].numel() * 4


QK_NORM_ROPE = OpSpec(
    name="qk_norm_rope",
    sizes={
        "quick": [dict(N=16, K=2, G=2, D=16, L=2, S=3, slots=[1])],
        # the seed-moe attention (512 tokens, 32 / 16 heads of 64, 8 layers, window 16 + the
        # scratch slot): a denoise pass (q, the scratch slot) and a cache pass (no q, a ring slot)
        "full": [
            dict(N=512, K=16, G=2, D=64, L=8, S=17, slots=[16]),
            dict(N=512, K=16, G=2, D=64, L=8, S=17, slots=[3], q=False),
        ],
    },
    draw=_draw,
    make=_make,
    reference=_reference,
    oracle=_oracle,
    bytes_moved=_bytes,
    native=lambda p: lambda: _reference(*p.args, **p.kwargs),
    mutates=(7, 8),
    reference_tol=(2.0**-6, 2.0**-6),  # the fp32 sum's order over D: a few ulps per pair
)

ENTRIES = (QK_NORM_ROPE,)
