"""Registry entries of ``expert_mlp`` (the routed experts: gather, up-projection, activation,
down-projection) and ``routed_experts`` (the same, then the weighted combine). Their forwards
are what ``verify`` and ``kernels`` call; their backwards are tested in
``packages/moe-kernels/tests/test_expert_mlp.py`` / ``test_routed_experts.py`` and timed by
``moe-bench train``."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from moe_kernels.testing import ULP, oracle_expert_mlp_rows
from moe_tools.ops.spec import (
    OpSpec,
    Problem,
    Sizes,
    expect_within,
    randn,
    softmax_scores,
)


def _draw(rng: random.Random, large: bool) -> Sizes:
    E = rng.choice([8, 16, 128] if large else [1, 4, 8])
    return dict(
        T=rng.randint(1, 256 if large else 40),  # the float64 oracle runs on the host
        E=E,
        k=rng.choice([k for k in (1, 2, 4, 8) if k <= E]),
        D=rng.choice([256, 512] if large else [16, 48]),
        H=rng.choice([128, 256] if large else [8, 24]),
        gated=rng.choice([False, True]),
        dtype=rng.choice(["float32", "bfloat16"]),
    )


def _make(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    import moe_kernels

    T, E, k, D, H, gated = s["T"], s["E"], s["k"], s["D"], s["H"], bool(s["gated"])
    dtype = getattr(torch, s.get("dtype", "bfloat16"))
    plan = moe_kernels.route(softmax_scores(T, E, gen, device), k)
    x = randn((T, D), gen, device, dtype)
    w_in = randn((E, 2 * H if gated else H, D), gen, device, dtype) / math.sqrt(D)
    w_out = randn((E, D, H), gen, device, dtype) / math.sqrt(H)
    act = "SwiGLU" if gated else "SiLU"
    label = f"T={T} E={E} k={k} D={D} H={H} {act} {str(dtype).removeprefix('torch.')}"
    args = (x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse)
    return Problem(label, s, args, {"gated": gated}, aux={"plan": plan})


def _activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.silu(h)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _bound(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Each grouped row in float64 and its rounding bound (``oracle_expert_mlp_rows``)."""
    x, w_in, w_out, offsets, rows, _ = p.args
    return oracle_expert_mlp_rows(x, w_in, w_out, offsets, rows, p.kwargs["gated"])


def _oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    return expect_within("vs oracle", out[0], *_bound(p))


def _native(p: Problem):
    """index_select + ``torch._grouped_mm`` + the activation + ``torch._grouped_mm`` on CUDA;
    a loop over experts elsewhere."""
    x, w_in, w_out, offsets, rows, _ = p.args
    gated = p.kwargs["gated"]
    src = rows.long().clamp(min=0)
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        ends = offsets[1:].to(torch.int32)

        def grouped() -> torch.Tensor:
            h = torch._grouped_mm(x.index_select(0, src), w_in.mT, offs=ends)
            return torch._grouped_mm(_activation(h, gated), w_out.mT, offs=ends)

        return grouped
    bounds = offsets.tolist()

    def loop() -> torch.Tensor:
        xs = x.index_select(0, src)
        out = xs.new_zeros(xs.shape[0], w_out.shape[1])
        for e in range(w_in.shape[0]):
            h = xs[bounds[e] : bounds[e + 1]] @ w_in[e].T
            out[bounds[e] : bounds[e + 1]] = _activation(h, gated) @ w_out[e].T
        return out

    return loop


def _reference(x, w_in, w_out, offsets, row_indices, inverse, gated=False, save_rows=True):
    """The references of its steps: the gathered first GEMM (SiLU on its fp32 accumulator), the
    SwiGLU, the second GEMM."""
    from moe_kernels.reference.activation import activation
    from moe_kernels.reference.grouped_mm import gather_grouped_mm

    h = gather_grouped_mm(x, w_in, offsets, row_indices, None if gated else "silu")
    return gather_grouped_mm(activation(h, True) if gated else h, w_out, offsets, None, None)


def _flops(p: Problem) -> int:
    s = p.sizes
    width = (3 if s["gated"] else 2) * s["H"]  # first GEMM's X plus the second's H
    return 2 * s["T"] * s["k"] * s["D"] * width


EXPERT_MLP = OpSpec(
    name="expert_mlp",
    sizes={
        "quick": [dict(T=64, E=8, k=2, D=64, H=32, gated=True)],
        # the seed-moe layer's experts (SiLU), the Qwen3-30B-A3B layer's (SwiGLU 2 x 768)
        "full": [
            dict(T=2048, E=16, k=8, D=2048, H=1024, gated=False),
            dict(T=8192, E=128, k=8, D=2048, H=768, gated=True),
        ],
    },
    draw=_draw,
    make=_make,
    reference=_reference,
    oracle=_oracle,
    bytes_moved=lambda p: (
        2 * p.sizes["T"] * p.sizes["k"] * p.sizes["D"] * p.args[0].element_size()
        + (p.args[1].numel() + p.args[2].numel()) * p.args[1].element_size()
    ),
    flops=_flops,
    native=_native,
    reference_tol=(2.0**-6, 1e-5),  # the fp32 sums' order, and h rounded once more on CUDA
    bound=_bound,
)


def _make_routed(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    p = _make(s, gen, device)
    x, w_in, w_out = p.args[:3]
    plan = p.aux["plan"]
    return Problem(p.label, s, (x, w_in, w_out, plan), dict(p.kwargs))


def _routed_bound(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t] = sum_j s_r y_r over r = inverse[t, j] in float64 from the rows' oracle; bound: the
    rows' bounds times |s|, one rounding of y, fp32 accumulation over the k choices."""
    x, w_in, w_out, plan = p.args
    rows_y, rows_b = oracle_expert_mlp_rows(
        x, w_in, w_out, plan.offsets, plan.token_indices, p.kwargs["gated"]
    )
    inv = plan.inverse.long().cpu()
    ok = (inv >= 0)[..., None]
    safe = inv.clamp(min=0)
    s = plan.weights.double().cpu()[safe][..., None]
    exact = torch.where(ok, s * rows_y[safe], 0.0).sum(1)
    mass = torch.where(ok, (s * rows_y[safe]).abs(), 0.0).sum(1)
    carried = torch.where(ok, s.abs() * rows_b[safe], 0.0).sum(1)
    return exact, ULP[x.dtype] * exact.abs() + carried + 1e-6 * mass + 1e-30


def _routed_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    return expect_within("vs oracle", out[0], *_routed_bound(p))


def _routed_native(p: Problem):
    """The expert MLP's native form, then the weighted sum over each token's choices."""
    x, w_in, w_out, plan = p.args
    mlp = _native(Problem(p.label, p.sizes, (x, w_in, w_out, plan.offsets, plan.token_indices,
                                             plan.inverse), p.kwargs))  # fmt: skip
    inv = plan.inverse.long()
    ok, safe = (inv >= 0)[..., None], inv.clamp(min=0)

    def run() -> torch.Tensor:
        y = mlp().float()[safe] * plan.weights.float()[safe][..., None]
        return torch.where(ok, y, 0.0).sum(1).to(x.dtype)

    return run


def _routed_reference(x, w_in, w_out, plan, gated=False, out_dtype=None, save_rows=True):
    """expert_mlp's reference, then combine's."""
    from moe_kernels.reference.tokens import combine

    y = _reference(x, w_in, w_out, plan.offsets, plan.token_indices, plan.inverse, gated)
    return combine(y, plan.inverse, plan.weights, True, out_dtype or x.dtype)


ROUTED_EXPERTS = OpSpec(
    name="routed_experts",
    sizes=EXPERT_MLP.sizes,
    draw=_draw,
    make=_make_routed,
    reference=_routed_reference,
    oracle=_routed_oracle,
    bytes_moved=lambda p: (
        p.sizes["T"] * (p.sizes["k"] + 1) * p.sizes["D"] * p.args[0].element_size()
        + (p.args[1].numel() + p.args[2].numel()) * p.args[1].element_size()
    ),
    flops=_flops,
    native=_routed_native,
    # the rows' roundings carried into a weighted sum that may cancel: absolute, at the rows'
    # scale (O(1) here), not relative to y
    reference_tol=(2.0**-6, 2.0**-5),
    bound=_routed_bound,
)

ENTRIES = (EXPERT_MLP, ROUTED_EXPERTS)
