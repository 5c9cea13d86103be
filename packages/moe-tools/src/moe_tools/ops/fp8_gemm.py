"""Registry entries of the FP8 grouped GEMM: ``fp8_grouped_mm`` and ``quantize_fp8_weights``.

The oracles compute in float64: the GEMM from the fp8 values and their scales written out (each
weight element times its channel's or block's scale), within one rounding of the output plus
1e-5 of the sum of |products| (fp32 accumulation); the weights' quantisation within one e4m3
step of each value (2^-4 relative, or the subnormal step 2^-9 of 448 times the scale).
"""

from __future__ import annotations

import random

import torch

from moe_kernels.testing import ULP
from moe_tools.ops.spec import OpSpec, Problem, Sizes, expect_within, randn, softmax_scores

FP8 = torch.float8_e4m3fn


def _draw(rng: random.Random, large: bool) -> Sizes:
    E = rng.choice([8, 16] if large else [1, 3, 4])
    return dict(
        T=rng.randint(1, 256 if large else 40),
        E=E,
        k=rng.choice([k for k in (1, 2, 4) if k <= E]),
        D=rng.choice([512, 1024] if large else [64, 200, 256]),
        N=rng.choice([256, 384] if large else [16, 72]),
        block=rng.choice([False, True]),
    )


def _make(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    import moe_kernels
    from moe_kernels.reference.fp8_rowwise import quantize_rows

    T, E, k, D, N = s["T"], s["E"], s["k"], s["D"], s["N"]
    x = randn((T, D), gen, device, torch.float32)
    w = randn((E, N, D), gen, device, torch.float32) / D**0.5
    xq, xs = quantize_rows(x, None, None)
    q = moe_kernels.quantize_fp8_weights(w, block=s.get("block", False))
    plan = moe_kernels.route(softmax_scores(T, E, gen, device), k)
    label = f"T={T} E={E} k={k} D={D} N={N} {'block' if s.get('block') else 'channel'} scales"
    args = (xq, xs, q.weight, q.scale, plan.offsets, plan.token_indices)
    return Problem(label, s, args)


def _oracle_mm(xq, xs, wq, ws, offsets, rows) -> torch.Tensor:
    """float64 y (P, N) on the host: each group's rows times its dequantised weight."""
    xq, xs, wq, ws = (t.cpu() for t in (xq, xs, wq, ws))
    E, N, D = wq.shape
    src = rows.cpu().long()
    bounds = [0] + [min(max(int(b), 0), src.shape[0]) for b in offsets.cpu().tolist()[1:]]
    y = torch.zeros(src.shape[0], N, dtype=torch.float64)
    for e in range(E):
        if ws.dim() == 3:
            s = ws[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :D]
        else:
            s = ws[e].double()[:, None].expand(N, D)
        r = src[bounds[e] : bounds[e + 1]]
        ok = (r >= 0) & (r < xq.shape[0])
        a = xq.double()[r.clamp(min=0)] * xs.double()[r.clamp(min=0), None]
        y[bounds[e] : bounds[e + 1]] = torch.where(ok[:, None], a @ (wq[e].double() * s).T, 0.0)
    return y


def _oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    xq, xs, wq, ws, offsets, rows = p.args
    exact = _oracle_mm(xq, xs, wq, ws, offsets, rows)
    mag = _oracle_mm(xq.float().abs().to(FP8), xs, wq.float().abs().to(FP8), ws, offsets, rows)
    bound = ULP[torch.bfloat16] * exact.abs() + 1e-5 * mag + 1e-30
    return expect_within("vs oracle", out[0].cpu(), exact, bound)


def _native(p: Problem):
    """torch's FP8 rowwise ``torch._scaled_grouped_mm`` on the gathered rows where it runs (CUDA,
    per-channel scales); elsewhere the weights dequantised to bf16 and a loop of matmuls."""
    xq, xs, wq, ws, offsets, rows = p.args
    src = rows.long().clamp(min=0)
    a, sa = xq.index_select(0, src), xs.index_select(0, src)
    if xq.is_cuda and hasattr(torch, "_scaled_grouped_mm") and ws.dim() == 2:
        return lambda: torch._scaled_grouped_mm(a, wq.transpose(1, 2), sa, ws, offs=offsets[1:],
                                                out_dtype=torch.bfloat16)  # fmt: skip
    bounds = offsets.tolist()

    def loop() -> torch.Tensor:
        out = torch.zeros(a.shape[0], wq.shape[1], dtype=torch.bfloat16, device=a.device)
        for e in range(wq.shape[0]):
            s = ws[e] if ws.dim() == 2 else ws[e].repeat_interleave(128, 0)[: wq.shape[1], :1]
            w = (wq[e].float() * s.reshape(-1, 1)).to(torch.bfloat16)
            rows_e = slice(bounds[e], bounds[e + 1])
            h = (a[rows_e].float() * sa[rows_e, None]).to(torch.bfloat16) @ w.T
            out[rows_e] = h
        return out

    return loop


def _reference(xq, xs, wq, ws, offsets, row_indices=None, out_dtype=torch.bfloat16):
    from moe_kernels.reference.fp8_grouped_mm import fp8_grouped_mm

    return fp8_grouped_mm(xq, xs, wq, ws, offsets, row_indices, out_dtype)


def _flops(p: Problem) -> int:
    s = p.sizes
    return 2 * s["T"] * s["k"] * s["N"] * s["D"]


FP8_GROUPED_MM = OpSpec(
    name="fp8_grouped_mm",
    sizes={
        "quick": [dict(T=64, E=4, k=2, D=256, N=64)],
        "full": [
            dict(T=4096, E=16, k=4, D=2048, N=1024),  # 1024 rows per expert
            dict(T=4096, E=128, k=8, D=2048, N=1536, block=True),
        ],  # fmt: skip
    },
    draw=_draw,
    make=_make,
    reference=_reference,
    oracle=_oracle,
    bytes_moved=lambda p: (
        p.args[0].numel() * p.sizes["k"] + p.args[2].numel() + 2 * p.args[5].numel() * p.sizes["N"]
    ),
    native=_native,
    flops=_flops,
    reference_tol=(ULP[torch.bfloat16], 1e-5),
)


# ----------------------------------------------------------------------------------------------
# quantize_fp8_weights


def _draw_quant(rng: random.Random, large: bool) -> Sizes:
    return dict(E=rng.choice([2, 8]), N=rng.choice([64, 200, 256]), D=rng.choice([72, 128, 300]),
                block=rng.choice([False, True]))  # fmt: skip


def _make_quant(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    w = randn((s["E"], s["N"], s["D"]), gen, device, torch.float32)
    label = f"E={s['E']} N={s['N']} D={s['D']} {'block' if s.get('block') else 'channel'}"
    return Problem(label, s, (w,), {"block": s.get("block", False)})


def _oracle_quant(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """Each dequantised value within one e4m3 step of the weight (relative 2^-4, or the
    subnormal step 2^-9 of the scale's 448), the scale amax / 448 of its channel or block."""
    (w,) = p.args
    q, scale = out
    E, N, D = w.shape
    w64 = w.double().cpu()
    if p.kwargs["block"]:
        s = scale.double().cpu().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :D]
    else:
        s = scale.double().cpu()[:, :, None].expand(E, N, D)
    deq = q.cpu().double() * s
    return expect_within("vs oracle", deq, w64, 2.0**-4 * w64.abs() + 2.0**-9 * 448 * s)


def _reference_quant(w, block=False):
    from moe_kernels.reference.fp8_grouped_mm import quantize_fp8_weights

    return quantize_fp8_weights(w, block)


QUANTIZE_FP8_WEIGHTS = OpSpec(
    name="quantize_fp8_weights",
    sizes={"quick": [dict(E=4, N=256, D=256)], "full": [dict(E=128, N=1536, D=2048)]},
    draw=_draw_quant,
    make=_make_quant,
    reference=_reference_quant,
    oracle=_oracle_quant,
    bytes_moved=lambda p: p.args[0].numel() * (p.args[0].element_size() + 1),
)

ENTRIES = (FP8_GROUPED_MM, QUANTIZE_FP8_WEIGHTS)
