"""Every public op with small arguments, built from plain torch only: no op of this package runs
while they are made, so a process that calls one of them compiled first meets every module
cache of ours cold (``cold.py``).

Legend: T tokens, E experts, K choices per token, D model width, H expert hidden width,
P = T*K routed rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from moe_kernels._routing_outputs import RoutingPlan, ShuffledIndices

__all__ = ["Problem", "Sizes", "naive_plan", "naive_shuffle", "op_problems"]


class Sizes(NamedTuple):
    """Problem sizes: GPU sizes are 16-aligned bf16 (CUTLASS and the persistent GEMM take them)."""

    T: int
    E: int
    K: int
    D: int
    H: int

    @classmethod
    def for_device(cls, device: torch.device) -> Sizes:
        return cls(256, 8, 2, 256, 128) if device.type == "cuda" else cls(16, 4, 2, 64, 32)


class Problem(NamedTuple):
    """``fn(*args)`` calls one public op; ``grads``: the indices of args it differentiates in
    (empty: forward only). Tensors in ``args`` are the caller's to clone (some are written)."""

    fn: Callable
    args: tuple
    grads: tuple[int, ...] = ()


def naive_plan(scores_TE: torch.Tensor, top_k: int) -> RoutingPlan:
    """A ``RoutingPlan`` of every token (no valid-token limit, full expert range) by torch's
    ``topk`` and a stable sort of the pairs by expert: pairs in (expert, token, choice) order."""
    T, E = scores_TE.shape
    w_TK, e_TK = scores_TE.float().topk(top_k, dim=1)
    e_P = e_TK.flatten()
    order = torch.sort(e_P, stable=True).indices
    counts = torch.bincount(e_P, minlength=E).to(torch.int32)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0).to(torch.int32)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return RoutingPlan(
        counts,
        offsets,
        e_P[order].to(torch.int32),
        (order // top_k).to(torch.int32),
        w_TK.flatten()[order],
        inverse.view(T, top_k).to(torch.int32),
    )


def naive_shuffle(plan: RoutingPlan) -> ShuffledIndices:
    """``index_shuffling``'s outputs for the same choices as ``plan`` (full range, all tokens)."""
    E = plan.counts.shape[0]
    tcpe = torch.cat([plan.counts, plan.counts.sum().view(1), plan.counts.sum().view(1)])
    assert tcpe.shape[0] == E + 2
    return ShuffledIndices(tcpe.to(torch.int32), plan.expert_indices, plan.token_indices)


def op_problems(device: str | torch.device, seed: int = 0) -> dict[str, Problem]:
    """name -> ``Problem`` for every public op (and its backward where it has one)."""
    import moe_kernels as mk  # the public API only

    dev = torch.device(device)
    T, E, K, D, H = Sizes.for_device(dev)
    P = T * K
    gen = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    scores = randn(T, E, dtype=torch.float32).softmax(-1)
    plan = naive_plan(scores, K)
    top = torch.topk(scores, K)
    shuf = naive_shuffle(plan)
    x, ys, h = randn(T, D), randn(P, D), randn(P, 2 * H)
    w_in, w_out = randn(E, 2 * H, D, scale=D**-0.5), randn(E, D, H, scale=H**-0.5)
    w_router = randn(E, D, dtype=torch.float32, scale=D**-0.5)
    ends = plan.offsets[1:]
    # MXFP8: groups of 32-row multiples
    mx_ends = (torch.arange(1, E + 1, device=dev, dtype=torch.int32) * 32).contiguous()
    a_mx, b_mx = randn(32 * E, D), randn(E, D, H, scale=D**-0.5)
    scale_u8 = torch.randint(100, 140, (P, D // 32), generator=gen, device=dev, dtype=torch.uint8)
    # expert parallelism: EP ranks, counts (EP, E) summing to T rows
    EP = 2
    counts_EPE = torch.full((EP, E), T // (EP * E), device=dev, dtype=torch.int32)
    tok_pad = torch.randperm(T, generator=gen, device=dev).to(torch.int32)
    # attention prologue: N tokens, K kv heads of D head dim, a 2-layer 4-slot cache
    HD, KV, N = 16, 2, 8
    q_, k_, v_ = randn(N, 2 * KV * HD), randn(N, KV * HD), randn(N, KV * HD)
    cos, sin = randn(N, HD // 2, dtype=torch.float32), randn(N, HD // 2, dtype=torch.float32)
    cache = torch.zeros(2, KV, 4, N, HD, device=dev, dtype=dt)
    slots = torch.tensor([1], device=dev)

    # FP8: e4m3 rows with their scales (FBGEMM's row-wise formula), the weights quantised once
    from moe_kernels.reference.fp8_rowwise import quantize_rows

    x8, xs8 = quantize_rows(x.float(), None, None)
    w8, w8b = mk.quantize_fp8_weights(w_in), mk.quantize_fp8_weights(w_in, block=True)

    def scatter_add(out, rows, tok):
        mk.scatter_add_dense_tokens(out, rows, tok)
        return out

    def scatter_padded(inp, counts, tok, out):
        mk.scatter_add_padded_tokens(inp, counts, tok, out)
        return out

    def blocked_2d(scales, ends):  # rows past start_rows[G] are unspecified: zeroed here
        blocked, start_rows = mk.to_blocked_per_group_2d(scales, ends)
        rows = torch.arange(blocked.shape[0], device=dev)[:, None]
        return torch.where(rows < start_rows[-1], blocked, 0), start_rows

    def rope(q, k, v, kc, vc, s):
        qo = mk.qk_norm_rope(q, k, v, torch.ones(HD, device=dev), torch.ones(HD, device=dev),
                             cos, sin, kc, vc, 1, s)  # fmt: skip
        return qo, kc, vc

    return {
        "router_scores": Problem(mk.router_scores, (x, w_router), (1,)),
        "route": Problem(lambda s: mk.route(s, K), (scores,)),
        "route_renorm_vtc": Problem(
            lambda s, v: mk.route(s, K, renormalize=True, valid_token_count=v),
            (scores, torch.tensor([T // 2], device=dev)),
            (0,),
        ),
        "route_range": Problem(
            lambda s: mk.route(s, K, expert_index_start=1, expert_index_end=E - 1), (scores,)
        ),
        "topk_choices": Problem(lambda s: mk.topk_choices(s, K), (scores,)),
        "plan_from_choices": Problem(
            lambda e, w: mk.plan_from_choices(e, w, E, expert_index_start=1),
            (top.indices, top.values),
            (1,),
        ),
        "index_shuffling": Problem(lambda s: mk.index_shuffling(s, top_k=K), (scores.to(dt),)),
        "index_shuffling_range": Problem(
            lambda s, v: mk.index_shuffling(s, 1, E - 1, v, K),
            (scores.to(dt), torch.tensor([T - 3], device=dev)),
        ),
        "dispatch": Problem(mk.dispatch, (x, plan), (0,)),
        "combine": Problem(mk.combine, (ys, plan), (0,)),
        "gather_scale_dense_tokens": Problem(
            mk.gather_scale_dense_tokens, (x, shuf.token_indices, shuf.expert_indices, scores)
        ),
        "scatter_add_dense_tokens": Problem(
            scatter_add, (torch.zeros(T, D, device=dev), ys, shuf.token_indices)
        ),
        "gather_scale_quant_dense_tokens": Problem(
            mk.gather_scale_quant_dense_tokens,
            (x, shuf.token_indices, shuf.expert_indices, scores),
        ),
        "silu_mul": Problem(mk.silu_mul, (h[:, :H], h[:, H:])),
        "silu_mul_quant": Problem(mk.silu_mul_quant, (h[:, :H], h[:, H:])),
        "combine_shuffling": Problem(lambda t, c: mk.combine_shuffling(t, c), (x, counts_EPE)),
        "split_shuffling": Problem(lambda t, c: mk.split_shuffling(t, c), (x, counts_EPE)),
        "scatter_add_padded_tokens": Problem(
            scatter_padded,
            (randn(EP, T, D), counts_EPE[0], tok_pad, torch.zeros(T, D, device=dev, dtype=dt)),
        ),
        "expert_activation": Problem(lambda a: mk.expert_activation(a, True), (h,), (0,)),
        "gather_grouped_mm_silu": Problem(
            lambda a, w, p: mk.gather_grouped_mm(
                a, w, p.offsets, p.token_indices, activation="silu"
            ),
            (x, w_in, plan),
            (0, 1),
        ),
        "gather_grouped_mm_sorted": Problem(
            lambda a, w, p: mk.gather_grouped_mm(a, w, p.offsets), (h, w_out.mT, plan), (0, 1)
        ),
        "fp8_grouped_mm": Problem(
            lambda a, s, w, ws, p: mk.fp8_grouped_mm(a, s, w, ws, p.offsets, p.token_indices),
            (x8, xs8, w8.weight, w8.scale, plan),
        ),
        "fp8_grouped_mm_block": Problem(
            lambda a, s, w, ws, p: mk.fp8_grouped_mm(a, s, w, ws, p.offsets, p.token_indices),
            (x8, xs8, w8b.weight, w8b.scale, plan),
        ),
        "quantize_fp8_weights": Problem(lambda w: tuple(mk.quantize_fp8_weights(w)), (w_in,)),
        "grouped_weight_grad": Problem(
            lambda dy, a, p: mk.grouped_weight_grad(dy, a, p.offsets), (ys, h, plan)
        ),
        "expert_mlp": Problem(
            lambda a, wi, wo, p: mk.expert_mlp(
                a, wi, wo, p.offsets, p.token_indices, p.inverse, gated=True
            ),
            (x, w_in, w_out, plan),
            (0, 1, 2),
        ),
        "routed_experts": Problem(
            lambda a, wi, wo, p: mk.routed_experts(a, wi, wo, p, gated=True),
            (x, w_in, w_out, plan),
            (0, 1, 2),
        ),
        "qk_norm_rope": Problem(rope, (q_, k_, v_, cache, cache.clone(), slots)),
        "to_mxfp8": Problem(mk.to_mxfp8, (x,)),
        "to_mxfp8_dim1": Problem(mk.to_mxfp8_dim1, (ys,)),
        "from_mxfp8": Problem(
            lambda d, s: mk.from_mxfp8(d, s), (x.to(torch.float8_e4m3fn), scale_u8[:T])
        ),
        "to_blocked": Problem(mk.to_blocked, (scale_u8,)),
        "compute_per_group_blocked_scale_offsets": Problem(
            mk.compute_per_group_blocked_scale_offsets, (ends,)
        ),
        "to_blocked_per_group_2d": Problem(blocked_2d, (scale_u8, ends)),
        "to_blocked_per_group_3d": Problem(
            mk.to_blocked_per_group_3d, (scale_u8[: E * 8].view(E, 8, D // 32),)
        ),
        "mxfp8_grouped_mm": Problem(mk.mxfp8_grouped_mm, (a_mx, b_mx, mx_ends), (0, 1)),
    }
