"""Registry entries of the MXFP8 ops: the casts, the blocked scale layouts, the grouped GEMM."""

from __future__ import annotations

import random

import torch

from moe_kernels.testing import (  # the naive oracles of the layouts, the casts in float64
    E4M3_STEP,
    oracle_blocked,
    oracle_blocked_start_rows,
    oracle_gather_grouped_mm,
    oracle_mxfp8,
    oracle_mxfp8_round_trip,
)
from moe_tools.ops.spec import (
    BF16_ULP,
    CheckFailed,
    OpSpec,
    Problem,
    Sizes,
    expect_equal,
    expect_within,
    group_ends,
    interpreted,
    randn,
    random_ends,
)


def _ref():
    from moe_kernels.reference import mxfp8

    return mxfp8


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


# ----------------------------------------------------------------------------------------------
# the casts


def _draw_quant(rng: random.Random, large: bool) -> Sizes:
    n = 64 if large else 8
    return dict(M=32 * rng.randint(1, n), K=32 * rng.randint(1, n), magnitude=rng.uniform(-3, 3))


def _make_quant(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    x = randn((s["M"], s["K"]), gen, device, torch.float32) * 10 ** s.get("magnitude", 0.0)
    return Problem(f"({s['M']},{s['K']}) bf16", s, (x.to(torch.bfloat16),))


def _quant_oracle(dim1: bool):
    def oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
        (x,) = p.args
        data, scale = out
        want_data, want_scale = oracle_mxfp8((x.t() if dim1 else x).float().cpu().contiguous())
        expect_equal("scale vs oracle", _u8(scale), want_scale)
        # the interpreter's fp32 -> e4m3 cast is one step off near powers of two (CPU only)
        rel = E4M3_STEP if interpreted(data) else 0.0
        return expect_equal("data vs oracle", data.float(), want_data, rel=rel)

    return oracle


QUANT_SIZES = {
    "quick": [dict(M=256, K=1024)],
    "full": [dict(M=16384, K=8192), dict(M=131072, K=2048)],
}


def _quant_bytes(p: Problem) -> int:
    M, K = p.sizes["M"], p.sizes["K"]
    return M * K * 2 + M * K + M * K // 32


TO_MXFP8 = OpSpec(
    name="to_mxfp8",
    sizes=QUANT_SIZES,
    draw=_draw_quant,
    make=_make_quant,
    reference=lambda x, scaling_mode="rceil": _ref().to_mxfp8(x, scaling_mode),
    oracle=_quant_oracle(dim1=False),
    bytes_moved=_quant_bytes,
)

TO_MXFP8_DIM1 = OpSpec(
    name="to_mxfp8_dim1",
    sizes=QUANT_SIZES,
    draw=_draw_quant,
    make=_make_quant,
    reference=lambda x, scaling_mode="rceil": _ref().to_mxfp8_dim1(x, scaling_mode),
    oracle=_quant_oracle(dim1=True),
    bytes_moved=_quant_bytes,
)


def _make_dequant(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    M, K = s["M"], s["K"]
    data = torch.randint(0, 256, (M, K), generator=gen, device=gen.device, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0  # no e4m3 NaN codes
    scale = torch.randint(
        100, 155, (M, K // 32), generator=gen, device=gen.device, dtype=torch.uint8
    )
    args = (data.to(device).view(torch.float8_e4m3fn), scale.to(device).view(torch.float8_e8m0fnu))
    return Problem(f"({M},{K}) -> bf16", s, args, {"dtype": torch.bfloat16})


def _dequant_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """The e4m3 value by its bit fields, times 2**(byte - 127), in float64; one bf16 rounding."""
    data, scale = (_u8(t) for t in p.args)
    b = data.long()
    sign = 1 - 2 * (b >> 7)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = torch.where(exp > 0, (1 + man / 8.0) * torch.exp2(exp.double() - 7), man / 8.0 * 2.0**-6)
    want = sign * val * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
    # one rounding to bf16 (the interpreter truncates: within one step)
    return expect_equal("vs oracle", out[0], want, rel=BF16_ULP if interpreted(out[0]) else 2.0**-8)


FROM_MXFP8 = OpSpec(
    name="from_mxfp8",
    sizes=QUANT_SIZES,
    draw=_draw_quant,
    make=_make_dequant,
    reference=lambda data, scale, dtype=torch.bfloat16: _ref().from_mxfp8(data, scale, dtype),
    oracle=_dequant_oracle,
    bytes_moved=_quant_bytes,
    native=lambda p: lambda: _ref().from_mxfp8(*p.args, p.kwargs["dtype"]),
)


# ----------------------------------------------------------------------------------------------
# the blocked scale layouts


def _scales(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random e8m0 scale bytes."""
    u8 = torch.randint(0, 256, shape, generator=gen, device=gen.device, dtype=torch.uint8)
    return u8.to(device).view(torch.float8_e8m0fnu)


def _padded(n: int, m: int) -> int:
    return -(-n // m) * m


def _draw_blocked(rng: random.Random, large: bool) -> Sizes:
    return dict(R=rng.randint(1, 20000 if large else 400), C=rng.randint(1, 260 if large else 70))


def _make_blocked(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    return Problem(f"({s['R']},{s['C']})", s, (_scales((s["R"], s["C"]), gen, device),))


TO_BLOCKED = OpSpec(
    name="to_blocked",
    sizes={"quick": [dict(R=1024, C=64)], "full": [dict(R=16640, C=160), dict(R=131072, C=224)]},
    draw=_draw_blocked,
    make=_make_blocked,
    reference=lambda scale: _ref().to_blocked(scale),
    oracle=lambda p, out: expect_equal("vs oracle", _u8(out[0]), oracle_blocked(p.args[0])),
    bytes_moved=lambda p: (
        p.sizes["R"] * p.sizes["C"] + _padded(p.sizes["R"], 128) * _padded(p.sizes["C"], 4)
    ),
    native=lambda p: lambda: _ref().to_blocked(p.args[0]),
)


def _torchao_layouts():
    from torchao.prototype.moe_training.kernels.mxfp8 import (  # type: ignore[import-not-found]
        triton_mx_block_rearrange_2d_M_groups,
        triton_mx_block_rearrange_per_group_3d,
    )

    return triton_mx_block_rearrange_2d_M_groups, triton_mx_block_rearrange_per_group_3d


def _torchao_2d(p: Problem):
    fn = _torchao_layouts()[0]
    scales, ends = p.args
    return lambda: fn(scales.view(torch.uint8), ends)


def _torchao_3d(p: Problem):
    fn = _torchao_layouts()[1]
    (scales,) = p.args
    return lambda: fn(scales.view(torch.uint8))


def _draw_2d(rng: random.Random, large: bool) -> Sizes:
    R = rng.randint(1, 20000 if large else 700)
    G = rng.randint(1, 16)
    return dict(R=R, C=rng.randint(1, 260 if large else 70), G=G, ends=random_ends(rng, R, G))


def _make_2d(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    R, C, G = s["R"], s["C"], s["G"]
    if "ends" in s:
        ends = torch.tensor(s["ends"], dtype=torch.int32, device=device)
    else:  # the benchmark shapes: distinct multiples of 32
        ends = group_ends(R, G, gen, device)
    return Problem(f"({R},{C}) G={G}", s, (_scales((R, C), gen, device), ends))


def _oracle_2d(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """Each group alone through the tile definition, stacked at 128-row boundaries."""
    scales, ends = p.args
    blocked, start_rows = out
    o_start, parts, begin = [0], [], 0
    for end in ends.tolist():
        if end > begin:
            parts.append(oracle_blocked(scales[begin:end].cpu()))
        o_start.append(o_start[-1] + (parts[-1].shape[0] if end > begin else 0))
        begin = end
    expect_equal("oracle start_rows", start_rows.cpu().long(), torch.tensor(o_start))
    if parts:
        expect_equal("vs oracle", _u8(blocked), torch.cat(parts))
    return 0.0


TO_BLOCKED_PER_GROUP_2D = OpSpec(
    name="to_blocked_per_group_2d",
    sizes={
        "quick": [dict(R=1024, C=64, G=4)],
        # G > 32, C not a multiple of 4 and C < 16 beside the seed shapes
        "full": [
            dict(R=R, C=C, G=G)
            for R, C, G in (
                *((16640, 160, 16), (131072, 224, 8), (131072, 64, 8), (524288, 256, 8)),
                *((20000, 37, 40), (131072, 3, 8), (65536, 15, 64), (8192, 8, 256)),
            )
        ],
    },
    draw=_draw_2d,
    make=_make_2d,
    reference=lambda scales, ends: _ref().to_blocked_per_group_2d(scales, ends),
    oracle=_oracle_2d,
    bytes_moved=lambda p: (
        p.sizes["R"] * p.sizes["C"]
        + (p.sizes["R"] + 128 * p.sizes["G"]) * _padded(p.sizes["C"], 4)
        + p.sizes["G"] * 4
    ),
    native=lambda p: lambda: _ref().to_blocked_per_group_2d(*p.args),
    torchao=_torchao_2d,
    specified=lambda out: (out[0][: int(out[1][-1])], out[1]),  # rows past start_rows[G]: unset
)


def _draw_3d(rng: random.Random, large: bool) -> Sizes:
    return dict(
        E=rng.randint(1, 8),
        N=rng.randint(1, 4096 if large else 300),
        C=rng.randint(1, 224 if large else 40),
    )


def _make_3d(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    E, N, C = s["E"], s["N"], s["C"]
    return Problem(f"({E},{N},{C})", s, (_scales((E, N, C), gen, device),))


def _oracle_3d(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    (scales,) = p.args
    want = torch.stack([oracle_blocked(scales[e].cpu()).flatten() for e in range(scales.shape[0])])
    return expect_equal("vs oracle", _u8(out[0]), want)


TO_BLOCKED_PER_GROUP_3D = OpSpec(
    name="to_blocked_per_group_3d",
    sizes={
        "quick": [dict(E=4, N=256, C=32)],
        "full": [
            dict(E=E, N=N, C=C)
            for E, N, C in (
                *((8, 2048, 224), (8, 7168, 64), (16, 4096, 64)),
                *((8, 2050, 37), (64, 512, 3), (128, 768, 15)),
            )
        ],
    },
    draw=_draw_3d,
    make=_make_3d,
    reference=lambda scales: _ref().to_blocked_per_group_3d(scales),
    oracle=_oracle_3d,
    bytes_moved=lambda p: (
        p.sizes["E"] * p.sizes["N"] * p.sizes["C"]
        + p.sizes["E"] * _padded(p.sizes["N"], 128) * _padded(p.sizes["C"], 4)
    ),
    native=lambda p: lambda: _ref().to_blocked_per_group_3d(p.args[0]),
    torchao=_torchao_3d,
)


def _draw_offsets(rng: random.Random, large: bool) -> Sizes:
    R = rng.randint(0, 200000 if large else 5000)
    G = rng.randint(1, 64 if large else 40)
    return dict(R=R, G=G, ends=random_ends(rng, R, G))


def _make_offsets(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    if "ends" in s:
        ends = torch.tensor(s["ends"], dtype=torch.int32, device=device)
    else:
        ends = group_ends(s["R"], s["G"], gen, device)
    return Problem(f"R={s['R']} G={s['G']}", s, (ends,))


def _oracle_offsets(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """A loop over the groups: size = end - previous end, start rows advance by the size rounded
    up to a multiple of 128 (``oracle_blocked_start_rows``)."""
    sizes, prev = [], 0
    for end in p.args[0].tolist():
        sizes.append(end - prev)
        prev = end
    starts = oracle_blocked_start_rows(sizes)
    expect_equal("oracle group_sizes", out[0].cpu().long(), torch.tensor(sizes))
    expect_equal("oracle start_rows", out[1].cpu().long(), torch.tensor(starts))
    if out[0].dtype != torch.int32 or out[1].dtype != torch.int32:
        raise CheckFailed(f"dtypes {out[0].dtype}, {out[1].dtype}: int32 expected")
    return 0.0


COMPUTE_PER_GROUP_BLOCKED_SCALE_OFFSETS = OpSpec(
    name="compute_per_group_blocked_scale_offsets",
    sizes={"quick": [dict(R=1024, G=8)], "full": [dict(R=131072, G=8), dict(R=524288, G=256)]},
    draw=_draw_offsets,
    make=_make_offsets,
    reference=lambda ends: _ref().compute_per_group_blocked_scale_offsets(ends),
    oracle=_oracle_offsets,
    bytes_moved=lambda p: p.sizes["G"] * 8 + (p.sizes["G"] + 1) * 4,
)


# ----------------------------------------------------------------------------------------------
# mxfp8_grouped_mm


def _draw_mm(rng: random.Random, large: bool) -> Sizes:
    M = rng.randint(1, 2048 if large else 160)  # the float64 oracle runs on the host
    E = rng.randint(1, 16 if large else 5)
    tail = rng.randint(0, M // 4)
    return dict(
        M=M,
        K=32 * rng.randint(1, 16 if large else 3),
        N=rng.choice([16, 256] if large else [8, 24, 40]),
        E=E,
        ends=random_ends(rng, M, E, tail),
    )


def _make_mm(s: Sizes, gen: torch.Generator, device: torch.device) -> Problem:
    M, K, N, E = s["M"], s["K"], s["N"], s["E"]
    rows = torch.exp2(torch.randint(-3, 4, (M, 1), generator=gen, device=gen.device).float())
    a = (torch.randn(M, K, generator=gen, device=gen.device) * rows).to(device, torch.bfloat16)
    b = randn((E, K, N), gen, device, torch.float32).mul(0.1).to(torch.bfloat16)
    if "ends" in s:
        ends = torch.tensor(s["ends"], dtype=torch.int32, device=device)
    else:
        ends = group_ends(M, E, gen, device, multiple=16)
    return Problem(f"M={M} K={K} N={N} E={E}", s, (a, b, ends))


def _mm_oracle(p: Problem, out: tuple[torch.Tensor, ...]) -> float:
    """Both operands through the float64 MXFP8 oracle (a row-wise, each b[e] along K), then the
    grouped GEMM in float64, one group at a time: within one rounding of the output plus the fp32
    accumulation's error (1e-5 of the sum of |products|); rows past the last group are zero."""
    a, b, ends = p.args
    qa = oracle_mxfp8_round_trip(a.float(), 1)  # (M, K) along K
    qb = oracle_mxfp8_round_trip(b.float(), 1)  # (E, K, N) along K
    offsets = torch.tensor([0, *ends.tolist()])
    exact = oracle_gather_grouped_mm(qa, qb.mT, offsets)
    mag = oracle_gather_grouped_mm(qa.abs(), qb.abs().mT, offsets)
    ulp = 2.0**-8 if out[0].dtype == torch.bfloat16 else 2.0**-23
    # the interpreter's e4m3 casts may land one step (2**-3) off: each operand's error then
    quant = 2 * E4M3_STEP + E4M3_STEP**2 if interpreted(a) else 0.0
    bound = ulp * exact.abs() + (1e-5 + quant) * mag + 1e-30
    return expect_within("vs oracle", out[0], exact, bound)


def _mm_reference(a, b, offsets, out_dtype=torch.bfloat16):
    """The CPU path, op for op: quantise a row-wise and b along K, dequantise, grouped GEMM."""
    ref = _ref()
    E, K, N = b.shape
    a_dq = ref.from_mxfp8(*ref.to_mxfp8(a, "rceil"), torch.bfloat16)
    b_q = ref.to_mxfp8(b.transpose(-2, -1).reshape(E * N, K), "rceil")
    b_dq = ref.from_mxfp8(*b_q, torch.bfloat16).view(E, N, K).transpose(-2, -1)
    return ref.grouped_mm_dequantized(a_dq, b_dq, offsets, out_dtype)


def _mm_native(p: Problem):
    """The bf16 grouped GEMM MXFP8 replaces: ``torch._grouped_mm`` on CUDA, else a loop."""
    a, b, ends = p.args
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        b_cm = b.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major, as CUTLASS takes
        return lambda: torch._grouped_mm(a, b_cm, offs=ends)
    bounds = [0, *ends.tolist()]

    def loop() -> torch.Tensor:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e in range(b.shape[0]):
            out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ b[e]
        return out

    return loop


MXFP8_GROUPED_MM = OpSpec(
    name="mxfp8_grouped_mm",
    sizes={
        "quick": [dict(M=256, K=64, N=32, E=4)],
        "full": [dict(M=16384, K=2048, N=1024, E=16), dict(M=131072, K=2048, N=768, E=128)],
    },
    draw=_draw_mm,
    make=_make_mm,
    reference=_mm_reference,
    oracle=_mm_oracle,
    bytes_moved=lambda p: (
        p.args[0].numel() * 2 + p.args[1].numel() * 2 + p.args[0].shape[0] * p.args[1].shape[2] * 2
    ),
    flops=lambda p: 2 * p.args[0].shape[0] * p.args[0].shape[1] * p.args[1].shape[2],
    native=_mm_native,
    reference_tol=(2.0**-7, 1e-4),  # CUTLASS's accumulation order on the GPU, not bitwise
)

ENTRIES = (
    TO_MXFP8,
    TO_MXFP8_DIM1,
    FROM_MXFP8,
    TO_BLOCKED,
    TO_BLOCKED_PER_GROUP_2D,
    TO_BLOCKED_PER_GROUP_3D,
    COMPUTE_PER_GROUP_BLOCKED_SCALE_OFFSETS,
    MXFP8_GROUPED_MM,
)
