"""Registry entry of ``expert_mlp``: the routed experts (gather, up-projection, activation,
down-projection) as one op. Its forward is what ``verify`` and ``kernels`` call; its backward is
tested in ``packages/moe-kernels/tests/test_expert_mlp.py`` and timed by ``moe-bench train``."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from moe_tools.ops.spec import (
    ULP,
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
    return Problem(label, s, args, {"gated": gated})


def _activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.silu(h)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """y[r] = act(x[rows[r]] @ w_in[e].T) @ w_out[e].T in float64, row block by expert; rows
    past offsets[E] or reading no token are zero. Bound: one rounding of y, plus the roundings
    of h and of the activation (one step of the dtype each, as the interpreter truncates) carried
    through the activation's slope and |w_out|, plus fp32 accumulation."""
    x, w_in, w_out, offsets, rows, _ = p.args
    gated, ulp = p.kwargs["gated"], ULP[x.dtype]
    x64, wi, wo = x.double().cpu(), w_in.double().cpu(), w_out.double().cpu()
    exact = torch.zeros(out[0].shape, dtype=torch.float64)
    bound = torch.zeros_like(exact)
    bounds, src_all = offsets.tolist(), rows.long().cpu()
    for e in range(len(bounds) - 1):
        start, end = bounds[e], max(bounds[e], bounds[e + 1])
        src = src_all[start:end]
        live = ((src >= 0) & (src < x.shape[0]))[:, None]
        xs = torch.where(live, x64[src.clamp(0, max(x.shape[0] - 1, 0))], 0.0)
        h = xs @ wi[e].T
        dh = ulp * h.abs() + 1e-5 * (xs.abs() @ wi[e].abs().T)
        a = _activation(h, gated)
        if gated:
            (g, u), (dg, du) = h.chunk(2, dim=-1), dh.chunk(2, dim=-1)
            da = ulp * a.abs() + 1.1 * u.abs() * dg + F.silu(g).abs() * du
        else:
            da = ulp * a.abs() + 1.1 * dh
        y = a @ wo[e].T
        exact[start:end] = y
        carried = (1.5 * da) @ wo[e].abs().T + 1e-5 * (a.abs() @ wo[e].abs().T)
        bound[start:end] = (ulp + 1e-6) * y.abs() + carried + 1e-30
    return expect_within("vs oracle", out[0], exact, bound)


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
    from moe_kernels._reference.activation import activation
    from moe_kernels._reference.grouped_mm import gather_grouped_mm

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
)

ENTRIES = (EXPERT_MLP,)
