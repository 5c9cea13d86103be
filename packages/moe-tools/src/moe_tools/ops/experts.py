"""Registry entries of the expert computation: ``gather_grouped_mm``, ``grouped_weight_grad``,
``expert_activation``."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_kernels.testing import ULP, oracle_gather_grouped_mm, oracle_grouped_weight_grad
from moe_tools.ops.spec import (
    OpSpec,
    Problem,
    Sizes,
    expect_within,
    randn,
    random_ends,
    softmax_scores,
)

DTYPES = ("float32", "bfloat16")


def _draw_gemm(rng: random.Random, large: bool) -> Sizes:
    E = rng.choice([8, 16, 128] if large else [1, 4, 8])
    T = rng.randint(1, 512 if large else 48)  # the float64 oracle runs on the host
    gathered = rng.choice([True, False])
    return dict(
        T=T,
        E=E,
        k=rng.choice([k for k in (1, 2, 4, 8) if k <= E]) if gathered else 1,
        D=rng.choice([256, 1024] if large else [16, 48, 64]),
        N=rng.choice([256, 512] if large else [16, 40]),
        activation=rng.choice([None, "silu"]),
        dtype=rng.choice(DTYPES),
        gathered=gathered,
        ends=None if gathered else random_ends(rng, T, E, rng.randint(0, T // 4)),
    )


class GemmRows(NamedTuple):
    """A grouped GEMM's tokens and their expert-sorted rows."""

    label: str
    x: torch.Tensor  # (T, D)
    offsets: torch.Tensor  # (E+1,) the groups' bounds
    rows: torch.Tensor | None  # (P,) the source token of each row; None: x is already sorted
    P: int  # rows


def _gemm_problem(
    s: Sizes, gen: torch.Generator, device: torch.device, *, weight_grad: bool
) -> GemmRows:
    """The tokens and their expert-sorted rows, from ``route`` when ``gathered`` (the default),
    else ``x`` already sorted with random group ends."""
    T, E, k, D = s["T"], s["E"], s["k"], s["D"]
    dtype = getattr(torch, s.get("dtype", "bfloat16"))
    x = randn((T, D), gen, device, dtype)
    if s.get("gathered", True):
        import moe_kernels

        plan = moe_kernels.route(softmax_scores(T, E, gen, device), k)
        offsets, rows, P = plan.offsets, plan.token_indices, T * k
    else:
        offsets = torch.tensor([0, *s["ends"]], dtype=torch.int32, device=device)
        rows, P = None, T
    act = s.get("activation")
    name = "" if weight_grad else f" {act or 'no activation'}"
    label = f"T={T} E={E} k={k} D={D} N={s['N']}{name} {str(dtype).removeprefix('torch.')}"
    if rows is None:
        label += " sorted"
    return GemmRows(label, x, offsets, rows, P)


def _bound(exact: torch.Tensor, mag: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rounding to ``dtype`` (a full step: the interpreter truncates), a few fp32 ulps of the
    activation, and the fp32 accumulation's error (1e-5 of the sum of |products|)."""
    return (ULP[dtype] + 1e-6) * exact.abs() + 1e-5 * mag + 1e-30


# ----------------------------------------------------------------------------------------------
# gather_grouped_mm


def _make_gather_mm(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, x, offsets, rows, _ = _gemm_problem(s, gen, device, weight_grad=False)
    w = randn((s["E"], s["N"], s["D"]), gen, device, x.dtype) / math.sqrt(s["D"])
    return Problem(label, s, (x, w, offsets, rows), {"activation": s.get("activation")})


def _gather_mm_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """y[p] = act(x[rows[p]] @ w[e].T) in float64 (``oracle_gather_grouped_mm``); rows past
    offsets[E] and rows whose source is outside [0, T) are zero. The bound's magnitude: |x| @
    |w|.T the same way, times 1.1 (SiLU's slope is at most 1.1)."""
    x, w, offsets, rows = p.args
    exact = oracle_gather_grouped_mm(x, w, offsets, rows, p.kwargs["activation"])
    mag = 1.1 * oracle_gather_grouped_mm(x.abs(), w.abs(), offsets, rows)
    return expect_within("vs oracle", out[0], exact, _bound(exact, mag, x.dtype))


def _gather_mm_native(p: Problem):
    """dispatch (index_select) + ``torch._grouped_mm`` (+ SiLU) on CUDA; a loop elsewhere."""
    x, w, offsets, rows = p.args
    silu = p.kwargs["activation"] == "silu"
    src = None if rows is None else rows.long().clamp(min=0)
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        wt, ends = w.transpose(1, 2), offsets[1:].to(torch.int32)

        def grouped() -> torch.Tensor:
            h = torch._grouped_mm(x if src is None else x.index_select(0, src), wt, offs=ends)
            return F.silu(h) if silu else h

        return grouped
    bounds = offsets.tolist()

    def loop() -> torch.Tensor:
        xs = x if src is None else x.index_select(0, src)
        out = xs.new_zeros(xs.shape[0], w.shape[1])
        for e in range(w.shape[0]):
            h = xs[bounds[e] : bounds[e + 1]] @ w[e].T
            out[bounds[e] : bounds[e + 1]] = F.silu(h) if silu else h
        return out

    return loop


def _gemm_sizes(activation: str | None) -> dict[str, list[Sizes]]:
    return {
        "quick": [dict(T=64, E=8, k=2, D=64, N=32, activation=activation)],
        # the seed-moe layer's first GEMM (SiLU), and the training shape's (SwiGLU's 2 x 768)
        "full": [
            dict(T=2048, E=16, k=8, D=2048, N=1024, activation=activation or "silu"),
            dict(T=16384, E=128, k=8, D=2048, N=1536, activation=None),
        ],
    }


def _gemm_flops(p: Problem) -> int:
    s = p.sizes
    return 2 * s["T"] * s["k"] * s["N"] * s["D"]


def _gather_mm_reference(x, w, offsets, row_indices=None, activation=None):
    from moe_kernels.reference.grouped_mm import gather_grouped_mm

    return gather_grouped_mm(x, w, offsets, row_indices, activation)


GATHER_GROUPED_MM = OpSpec(
    name="gather_grouped_mm",
    sizes=_gemm_sizes("silu"),
    draw=_draw_gemm,
    make=_make_gather_mm,
    reference=_gather_mm_reference,
    oracle=_gather_mm_oracle,
    bytes_moved=lambda p: (
        (p.sizes["T"] * p.sizes["k"] * (p.sizes["D"] + p.sizes["N"])) * p.args[0].element_size()
        + p.args[1].numel() * p.args[1].element_size()
    ),
    flops=_gemm_flops,
    native=_gather_mm_native,
    reference_tol=(2.0**-7, 1e-5),  # the fp32 sum's order differs: one output rounding apart
)


# ----------------------------------------------------------------------------------------------
# grouped_weight_grad


def _make_wgrad(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    label, x, offsets, rows, P = _gemm_problem(s, gen, device, weight_grad=True)
    dy = randn((P, s["N"]), gen, device, x.dtype)
    return Problem(label, s, (dy, x, offsets, rows))


def _wgrad_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """out[e] = sum over e's rows p of outer(dy[p], x[rows[p]]), float64
    (``oracle_grouped_weight_grad``; the bound's magnitude: the same of |dy| and |x|)."""
    dy, x, offsets, rows = p.args
    exact = oracle_grouped_weight_grad(dy, x, offsets, rows)
    mag = oracle_grouped_weight_grad(dy.abs(), x.abs(), offsets, rows)
    return expect_within("vs oracle", out[0], exact, _bound(exact, mag, dy.dtype))


def _wgrad_native(p: Problem):
    """``torch._grouped_mm(dy.mT, x[rows])`` (K-grouped) on CUDA; a loop elsewhere."""
    dy, x, offsets, rows = p.args
    src = None if rows is None else rows.long().clamp(min=0)
    if dy.is_cuda and hasattr(torch, "_grouped_mm"):
        ends = offsets[1:].to(torch.int32)
        return lambda: torch._grouped_mm(
            dy.mT, x if src is None else x.index_select(0, src), offs=ends
        )
    bounds = offsets.tolist()

    def loop() -> torch.Tensor:
        xs = x if src is None else x.index_select(0, src)
        return torch.stack(
            [
                dy[bounds[e] : bounds[e + 1]].T @ xs[bounds[e] : bounds[e + 1]]
                for e in range(len(bounds) - 1)
            ]
        )

    return loop


def _wgrad_reference(dy, x, offsets, row_indices=None, out_dtype=None):
    from moe_kernels.reference.grouped_mm import grouped_weight_grad

    return grouped_weight_grad(dy, x, offsets, row_indices, out_dtype or dy.dtype)


GROUPED_WEIGHT_GRAD = OpSpec(
    name="grouped_weight_grad",
    sizes=_gemm_sizes(None),
    draw=_draw_gemm,
    make=_make_wgrad,
    reference=_wgrad_reference,
    oracle=_wgrad_oracle,
    bytes_moved=lambda p: (
        (p.args[0].numel() + p.sizes["T"] * p.sizes["k"] * p.sizes["D"]) * p.args[0].element_size()
        + p.sizes["E"] * p.sizes["N"] * p.sizes["D"] * p.args[0].element_size()
    ),
    flops=_gemm_flops,
    native=_wgrad_native,
    reference_tol=(2.0**-7, 1e-5),
)


# ----------------------------------------------------------------------------------------------
# expert_activation


def _draw_activation(rng: random.Random, large: bool) -> Sizes:
    return dict(
        M=rng.randint(0, 4096 if large else 100),
        H=rng.randint(1, 1024 if large else 80),
        gated=rng.choice([False, True]),
        dtype=rng.choice(["float32", "bfloat16", "float16"]),
    )


def _make_activation(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    M, H, gated = s["M"], s["H"], bool(s["gated"])
    dtype = getattr(torch, s.get("dtype", "bfloat16"))
    h = randn((M, 2 * H if gated else H), gen, device, torch.float32).mul(2.0).to(dtype)
    label = f"M={M} H={H} {'SwiGLU' if gated else 'SiLU'} {str(dtype).removeprefix('torch.')}"
    return Problem(label, s, (h,), {"gated": gated})


def _activation_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """silu(g) (times u) in float64: one rounding to h's dtype (one subnormal step at least), a few
    fp32 ulps of exp."""
    (h,), gated = p.args, p.kwargs["gated"]
    h64 = h.double().cpu()
    g, u = h64.chunk(2, dim=-1) if gated else (h64, None)
    exact = g / (1.0 + torch.exp(-g)) * (u if gated else 1.0)
    subnormal = torch.finfo(h.dtype).tiny * torch.finfo(h.dtype).eps  # the step below normals
    bound = (ULP[h.dtype] + 8 * ULP[torch.float32]) * exact.abs() + subnormal
    return expect_within("vs oracle", out[0], exact, bound)


def _activation_native(p: Problem):
    (h,), gated = p.args, p.kwargs["gated"]
    if gated:
        g, u = h.chunk(2, dim=-1)
        return lambda: F.silu(g) * u
    return lambda: F.silu(h)


def _activation_reference(h, gated=False):
    from moe_kernels.reference.activation import activation

    return activation(h, gated)


EXPERT_ACTIVATION = OpSpec(
    name="expert_activation",
    sizes={
        "quick": [dict(M=256, H=128, gated=True)],
        # seed-moe's SiLU (2048 tokens x top-8, hidden 1024), the training shape's SwiGLU
        "full": [dict(M=16384, H=1024, gated=False), dict(M=131072, H=768, gated=True)],
    },
    draw=_draw_activation,
    make=_make_activation,
    reference=_activation_reference,
    oracle=_activation_oracle,
    bytes_moved=lambda p: (
        (p.args[0].numel() + p.sizes["M"] * p.sizes["H"]) * p.args[0].element_size()
    ),
    native=_activation_native,
    reference_tol=(2.0**-7, 0.0),  # Triton's exp against torch's: a few fp32 ulps, one rounding
)

ENTRIES = (GATHER_GROUPED_MM, GROUPED_WEIGHT_GRAD, EXPERT_ACTIVATION)
