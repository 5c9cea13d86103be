"""Which kernel runs each grouped GEMM of the package, with which config and operand layout:
``choose_gemm(problem, device) -> GemmPlan``, one rule for the forward GEMMs, the data and
weight gradients, the gathering GEMM, expert_mlp's no-grad up-projection and the MXFP8 GEMMs
(as routing's ``choose_plan`` is for routing). The ``plan_*`` helpers read a call's tensors
into a ``GemmProblem``; ``choose_gemm`` itself is plain Python on sizes and flags, so its rules
have their own tests (``tests/test_gemm_plan.py``) and the CPU path needs no Triton.

Kernels: "reference" (the torch reference: CPU tensors outside the interpreter, or
``MOE_KERNELS_BACKEND=reference``), "persistent" (``_triton/persistent_grouped_mm.py``),
"cutlass" (``torch._grouped_mm``), "triton" (``_triton/grouped_mm.py``: gathers its rows,
fuses SiLU), "triton_wgrad" (``_triton/grouped_weight_grad.py``), "gather_copy" (expert_mlp's
no-grad up-projection: a row-gather copy, then the sorted-row GEMM's plan), "scaled_cutlass"
(``torch._scaled_grouped_mm``, MXFP8 on sm100), "dequantized" (MXFP8 emulated: exact bf16
dequantisation, then the "dequantized" problem's plan), "masked" (a per-expert masked torch
GEMM with static shapes), "gemv" (``_triton/grouped_gemv.py``: the forward GEMMs at a few rows
in all, a decode step's, each touched expert's weights read once; gathers its rows, fuses SiLU or
SwiGLU), "triton_fp8" (``_triton/fp8_grouped_mm.py``: e4m3 operands, per-row and per-channel or
block scales; tiles, accumulation and grid by ``fp8_config``), "triton_fp8_decoded" (the same
kernel on a GPU without e4m3 tensor cores, before sm_89: the e4m3 bytes decoded to bf16,
exactly, for bf16 MMAs).

From the H200 (``benchmarks/gpu/persistent_grouped_mm_gpu.py``, torch 2.11, triton 3.6, bf16,
two runs on two machines): the flattened persistent Triton kernel (128 x 256 x 64 tiles, 8
warps, 3 stages, TMA) against ``torch._grouped_mm`` (CUTLASS), per row-grouped GEMM of the
layer's step, took 0.71-0.81x CUTLASS's time at 128 rows per expert, 0.88-0.97x at 256,
0.84-0.97x at 512 (the Qwen3-30B-A3B layer) and 0.94-0.98x at 1024 (seed); above, 0.91-1.04x in
one run and 0.99-1.05x in the other, so CUTLASS stays there. Its output bits equal CUTLASS's on
every GEMM measured (both accumulate K in order in fp32, no split-K). docs/training.md has the
tables.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_kernels._dispatch import (
    INTERPRET,
    PORTABLE,
    e4m3_native,
    sm_major,
    triton_kernels,
    use_triton,
)
from moe_kernels._triton.blocks import cdiv, pow2_clamp  # plain Python: no Triton import
from moe_kernels.reference.fp8_grouped_mm import SCALE_BLOCK

# Mean rows per expert up to which the persistent row-grouped GEMM runs (above it CUTLASS was as
# fast).
PERSISTENT_MAX_ROWS_PER_EXPERT = 1024
# Likewise for the K-grouped weight gradient: 0.87-0.91x CUTLASS's time at 128 rows per expert,
# 1.04-1.11x from 256 up, the same bits (benchmarks/gpu/grouped_weight_grad_gpu.py on an H100,
# ragged-descriptor loads; docs/training.md, session 28).
WGRAD_MAX_ROWS_PER_EXPERT = 128
# expert_mlp's no-grad up-projection, from the H200 (expert_mlp_gpu.py, times over the two
# grouped GEMMs alone): the gathering Triton GEMM 1.04x / 1.14x at X = 1024 / 512 (the gather +
# CUTLASS chain 1.14x / 1.24x); the chain 1.11x / 1.10x at X = 1536 / 2048 (the gathering GEMM
# 1.17x / 1.23x). The gather's copy weighs more against a narrower GEMM.
FUSED_GATHER_MAX_X = 1024
# The grouped GEMV runs the forward GEMMs ("rows", "gather", "gather_mlp") up to
# GEMV_MAX_ROWS_PER_EXPERT rows per expert on average and GEMV_MAX_ROWS in all (static sizes:
# P = T * top_k). From the H100 (benchmarks/gpu/decode_gemv_gpu.py, torch 2.11, Triton 3.6, bf16,
# both expert GEMMs in a CUDA graph, against the plan without it): 1.02-1.35x at every measured
# point up to 8 rows per expert (Qwen3-30B-A3B and a 128-expert d 2816 layer to 1024 rows,
# DeepSeek-V3 to 1024, Mixtral to 64), but 0.93x at DeepSeek-V3's one token; past 8 per expert it
# loses (Mixtral 0.67x at 16, 0.42x at 32: an expert's rows 16 at a time re-read its weights).
# The kernel takes any routing (correct for every P), fast for few rows per expert.
GEMV_MAX_ROWS_PER_EXPERT = 8
GEMV_MAX_ROWS = 1024  # the largest P measured


class PersistentConfig(NamedTuple):
    """Tile shape and launch parameters of one persistent grouped-GEMM launch. ``tma``: A and B
    through TMA descriptors where the tensors allow; ``programs_per_sm``: the persistent grid is
    that many programs per multiprocessor; ``flatten``: the tile loop and the K loop as one
    software-pipelined loop (the next tile's loads in flight during a tile's store)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    programs_per_sm: int = 1
    flatten: bool = True


def use_gemv(num_rows: int, num_experts: int) -> bool:
    """Whether a forward GEMM over ``num_rows`` rows in ``num_experts`` groups runs the grouped
    GEMV: 1 to ``GEMV_MAX_ROWS`` rows in all and at most ``GEMV_MAX_ROWS_PER_EXPERT`` per expert
    on average (static sizes: no host read of the groups; no rows or no experts keep the other
    kernels' plans, which launch nothing there)."""
    bound = min(GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT * num_experts)
    return num_experts > 0 and 0 < num_rows <= bound


def use_persistent(
    num_rows: int, num_experts: int, bf16: bool, sm_major: int, tma: bool, wgrad: bool = False
) -> bool:
    """Whether a grouped GEMM over ``num_rows`` sorted rows in ``num_experts`` groups (``wgrad``:
    the K-grouped weight gradient over them) runs the persistent Triton kernel rather than
    CUTLASS: bf16 on sm90 (the chip it was measured on), operands TMA can read (``tma``: eager,
    contiguous, aligned), and at most ``PERSISTENT_MAX_ROWS_PER_EXPERT`` (``wgrad``:
    ``WGRAD_MAX_ROWS_PER_EXPERT``) rows per expert on average (a static bound: no host read of
    the group sizes)."""
    if not (bf16 and sm_major == 9 and tma and num_experts > 0):
        return False
    bound = WGRAD_MAX_ROWS_PER_EXPERT if wgrad else PERSISTENT_MAX_ROWS_PER_EXPERT
    return num_rows <= bound * num_experts


def persistent_config(
    num_rows: int, n: int, k: int, num_experts: int, interpret: bool
) -> PersistentConfig:
    """The launch config for ``num_rows`` x ``n`` outputs over ``k`` in ``num_experts`` groups.
    GPU: 128 x 256 x 64, 8 warps, 3 stages, flattened, TMA (the fastest of the H200 sweep at every
    shape measured); BN and BK shrink to small n and k. Interpreter: 16-32 row tiles, one stage,
    pointer loads, few programs (each costs ~0.4 ms of numpy overhead)."""
    if interpret:
        return PersistentConfig(
            block_m=pow2_clamp(num_rows, 16, 32),
            block_n=pow2_clamp(n, 16, 64),
            block_k=pow2_clamp(k, 16, 64),
            num_warps=4,
            num_stages=1,
            tma=False,
            flatten=False,
        )
    return PersistentConfig(block_n=pow2_clamp(n, 16, 256), block_k=pow2_clamp(k, 16, 64))


class WgradConfig(NamedTuple):
    """Tile shape and launch parameters of one weight-gradient launch (``_triton/
    grouped_weight_grad.py``): BN x BD output tiles over BK-row steps; ``tma``: which operands
    come through TMA descriptors where they allow it (bf16, sorted rows, contiguous, aligned):
    "none" (pointer loads), "x" or "both"; ``programs_per_sm``: the persistent grid is that many
    programs per multiprocessor."""

    block_n: int = 128
    block_d: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: str = "x"
    programs_per_sm: int = 1


def wgrad_config(n: int, d: int, interpret: bool, fp32: bool = False) -> WgradConfig:
    """The weight-gradient launch config for (E, n, d) outputs. GPU, 16-bit: 128 x 256 x 64,
    8 warps, 3 stages, x through TMA (wgmma, 200-210 registers, no spills, 176 KiB of shared
    memory on sm_90a); fp32 (an exact fp32 dot on CUDA cores): 128 x 128 x 32, pointer loads
    (147 registers, no spills; 128 x 256 x 64 spilled 38 KB); BN and BD shrink to small n and
    d. Interpreter: 16-64 tiles, one stage, pointer loads."""
    if interpret:
        return WgradConfig(pow2_clamp(n, 16, 64), pow2_clamp(d, 16, 64), 16, 4, 1, tma="none")
    if fp32:
        return WgradConfig(pow2_clamp(n, 16, 128), pow2_clamp(d, 16, 128), 32, tma="none")
    return WgradConfig(block_n=pow2_clamp(n, 16, 128), block_d=pow2_clamp(d, 16, 256))


# ---------------------------------------------------------------------------------------------
# the plan

KINDS = ("rows", "gather", "gather_mlp", "wgrad", "mxfp8", "dequantized", "fp8")
GEMV_KINDS = ("rows", "gather", "gather_mlp")  # the forward GEMMs


class GemmDevice(NamedTuple):
    """What the plan needs of a device: ``path`` ("triton", "interpreter" or "reference",
    ``moe_kernels.testing.execution_path``), ``sm_major`` (the CUDA compute capability's
    major, 0 off CUDA), and whether this torch has ``torch._grouped_mm`` (``grouped_mm``) and
    an MXFP8 ``torch._scaled_grouped_mm`` (``scaled_grouped_mm``: torch >= 2.9). ``gemv``: the
    plan may pick the grouped GEMV (False: the plan without it, which
    ``benchmarks/gpu/decode_gemv_gpu.py`` times it against). ``fp8_mma``: Triton may use the
    e4m3 type there (CUDA sm_89+; off CUDA the interpreter's own path decides)."""

    path: str
    sm_major: int = 0
    grouped_mm: bool = True
    scaled_grouped_mm: bool = True
    gemv: bool = True
    fp8_mma: bool = True


class Fp8Config(NamedTuple):
    """Tile shape and launch parameters of one FP8 grouped-GEMM launch; ``tma``: B (and sorted
    A) through TMA descriptors where the tensors allow (pointer tiles of 128-deep fp8 K steps
    spill: 380-1400 bytes a thread at sm_90a); ``fast_accum``: per-channel scales' K loop
    accumulated in the MMA without promoting each 128-deep step to fp32 (FBGEMM's
    ``use_fast_accum``, its default; within 2^-7 of the sum of |products|, against 2^-12 with
    the promotion); ``persistent``: sorted rows with per-channel scales through the persistent
    grouped GEMM (``persistent_grouped_mm``'s scaled form: a persistent grid, tile and K loops
    flattened, fast accumulation)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    fast_accum: bool = False
    persistent: bool = False


# Sorted rows, per-channel scales: the persistent kernel from this many 128 x 256 tiles on at
# most this K (H100, session 61's sweep, docs/kernel-ops.md: it won at Qwen3-30B-A3B's up and
# down projections, 3072 and 4096 tiles on K 2048 / 768; the plain grid won at the seed shape,
# 512 tiles, and at SonicMoE's K 4096).
PERSISTENT_MIN_TILES = 2048
PERSISTENT_MAX_K = 2048


def fp8_config(
    num_rows: int,
    n: int,
    d: int,
    block_scales: bool,
    gathered: bool = False,
    *,
    interpret: bool = INTERPRET,
) -> Fp8Config:
    """GPU, per-channel scales (fast accumulation): sorted rows in 128 x 256 x 128 tiles, 4
    stages, or through the persistent kernel (3 stages) from ``PERSISTENT_MIN_TILES`` tiles on
    K <= ``PERSISTENT_MAX_K``; gathered rows in 64 x 128 x 128 tiles. Block scales: 128 x 128
    x 128 (64 x 128 gathered), each 128-deep step promoted to fp32 with its scale. 8 warps; BN
    down to 16 for small n. Register use at sm_90a (``moe_kernels.testing.register_use``,
    test_compile_sm90.py): no spill for the plain grid's tiles (sorted: 234-255 registers,
    gathered: 219-234); a gathered 128-row tile spills 350-530 bytes a thread (its A tile is
    loaded through registers). Interpreter: few, large programs. Block scales need BK = 128 and
    BN dividing 128."""
    if interpret:
        bk = SCALE_BLOCK if block_scales else pow2_clamp(d, 16, 128)
        return Fp8Config(pow2_clamp(num_rows, 16, 32), pow2_clamp(n, 16, 128), bk, 4, 4, 1, False)
    if block_scales or gathered:
        return Fp8Config(
            block_m=64 if gathered else 128,
            block_n=pow2_clamp(n, 16, 128),
            fast_accum=not block_scales,
        )
    bn = pow2_clamp(n, 16, 256)
    tiles = cdiv(num_rows, 128) * cdiv(n, bn)
    if bn == 256 and d <= PERSISTENT_MAX_K and tiles >= PERSISTENT_MIN_TILES:
        return Fp8Config(block_n=bn, fast_accum=True, persistent=True)
    return Fp8Config(block_n=bn, num_stages=4 if bn == 256 else 3, fast_accum=True)


class GemmProblem(NamedTuple):
    """One grouped GEMM: ``kind`` (``KINDS``), over ``rows`` rows in ``experts`` groups (the
    output's rows: with row indices their count, not x's), n output columns, k the contraction
    (for "wgrad": dy (rows, n), x (x_rows, k), out (E, n, k)); ``dtype`` the operands';
    ``out_dtype`` the result's. ``layout``: how w reads for the persistent kernel ("nk": (E, N,
    K) contiguous, "kn": the ``.mT`` view of a contiguous (E, K, N), "": neither); ``tma``: the
    operands suit TMA descriptors (CUDA sm90+, contiguous, 16-byte aligned, no trace in
    progress); ``aligned``: x's rows are unit-stride from a 16-byte base (CUTLASS's forward);
    ``gathered``: rows come through row indices; ``compiling``: under ``torch.compile``."""

    kind: str
    rows: int
    n: int
    k: int
    experts: int
    dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype = torch.bfloat16
    x_rows: int = 0
    layout: str = ""
    tma: bool = False
    aligned: bool = False
    gathered: bool = False
    compiling: bool = False


class GemmPlan(NamedTuple):
    """The kernel (module docstring), its launch config (None: the launcher's default), and the
    weight's operand layout for the persistent kernel ("nk" / "kn")."""

    kernel: str
    config: PersistentConfig | WgradConfig | None = None
    layout: str = ""


def _cutlass(p: GemmProblem, dev: GemmDevice) -> bool:
    """``torch._grouped_mm`` takes these bf16 operands: sm90+, n and k multiples of 16."""
    return (
        dev.grouped_mm and dev.sm_major >= 9 and p.dtype == torch.bfloat16
    ) and p.n % 16 == 0 and p.k % 16 == 0  # fmt: skip


def choose_gemm(p: GemmProblem, dev: GemmDevice) -> GemmPlan:
    """The plan for problem ``p`` on ``dev`` (the rules: module docstring and comments)."""
    if p.kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {p.kind!r}")
    interpret = dev.path == "interpreter"
    bf16 = p.dtype == torch.bfloat16
    if p.kind == "mxfp8":  # sm100's native MXFP8 GEMM, else the exact emulation
        native = dev.scaled_grouped_mm and dev.sm_major == 10
        return GemmPlan("scaled_cutlass" if native else "dequantized")
    if p.kind == "dequantized":  # CUTLASS on the exact bf16 dequantisations, fp32 accumulation
        ok = dev.grouped_mm and dev.sm_major >= 9 and p.out_dtype == torch.bfloat16
        return GemmPlan("cutlass" if ok and p.k % 8 == 0 and p.n % 8 == 0 else "masked")
    if dev.path == "reference":
        return GemmPlan("reference")
    if p.kind == "fp8":  # e4m3 x e4m3: the Triton kernel, its e4m3 bytes decoded before sm_89
        return GemmPlan("triton_fp8" if dev.fp8_mma else "triton_fp8_decoded")
    if dev.gemv and p.kind in GEMV_KINDS and use_gemv(p.rows, p.experts):
        return GemmPlan("gemv")  # few rows in all: one read of the touched experts' weights
    if p.kind == "gather":  # a row gather or the SiLU epilogue: only the Triton GEMM has them
        return GemmPlan("triton")
    if p.kind == "gather_mlp":  # gather in the GEMM's loads, or copy the rows for CUTLASS
        chain = _cutlass(p, dev) and p.n > FUSED_GATHER_MAX_X
        return GemmPlan("gather_copy" if chain else "triton")
    if p.kind == "rows":
        if p.layout and use_persistent(p.rows, p.experts, bf16, dev.sm_major, p.tma):
            cfg = persistent_config(p.rows, p.n, p.k, p.experts, interpret)
            return GemmPlan("persistent", cfg, p.layout)
        if p.experts > 0 and p.aligned and _cutlass(p, dev):
            return GemmPlan("cutlass")
        return GemmPlan("triton")
    # "wgrad": the persistent kernel at few rows per expert, CUTLASS above where it takes the
    # operands (not with row indices: it reads sorted rows, which the plan then gathers first)
    persistent = not p.gathered and not p.compiling
    persistent = persistent and use_persistent(p.rows, p.experts, bf16, dev.sm_major, p.tma, True)
    if not persistent and _cutlass(p, dev) and min(p.rows, p.x_rows, p.experts) > 0:
        return GemmPlan("cutlass")
    cfg = wgrad_config(p.n, p.k, interpret, p.dtype == torch.float32)
    return GemmPlan("triton_wgrad", cfg)


# ---------------------------------------------------------------------------------------------
# problems read from a call's tensors


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")[:2]
    return tuple(int(p) for p in parts) >= (major, minor)


_GROUPED_MM = hasattr(torch, "_grouped_mm")
_SCALED_GROUPED_MM = hasattr(torch, "_scaled_grouped_mm") and _torch_at_least(2, 9)


def gemm_device(device: torch.device) -> GemmDevice:
    """``device`` as the plan sees it (``sm_major`` is a trace-time constant under compile);
    ``MOE_KERNELS_BACKEND=portable``: without torch's grouped GEMMs (CUTLASS), whose TMA and
    wgmma kernels a GPU before sm90 lacks (TMA: ``_dispatch.has_tma``)."""
    index = device.index if device.index is not None else 0
    major = sm_major(index) if device.type == "cuda" else 0
    if not use_triton(device):
        path = "reference"
    else:  # the interpreter as the launchers see it: INTERPRET set, or CPU tensors
        path = "interpreter" if INTERPRET or device.type != "cuda" else "triton"
    cutlass = not PORTABLE
    fp8_mma = path != "triton" or e4m3_native(device)
    return GemmDevice(path, major, _GROUPED_MM and cutlass, _SCALED_GROUPED_MM and cutlass,
                      fp8_mma=fp8_mma)  # fmt: skip


def _tma(*tensors: torch.Tensor) -> bool:
    """Each tensor suits a TMA descriptor (``persistent_grouped_mm.tma_ok``): bf16 CUDA only,
    so the Triton module is imported only where a persistent kernel could run."""
    if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors):
        return False
    tma_ok = triton_kernels("persistent_grouped_mm").tma_ok
    return all(tma_ok(t) for t in tensors)


def plan_rows(
    x_PD: torch.Tensor, w_END: torch.Tensor, rows_P: torch.Tensor | None, act: bool
) -> GemmPlan:
    """The plan of ``gather_grouped_mm(x, w, offsets, rows_P, activation)``: "gather" with row
    indices or an activation, else "rows" (w's layout and TMA read from the tensors)."""
    E, N, D = w_END.shape
    if rows_P is not None or act:
        num_rows = x_PD.shape[0] if rows_P is None else rows_P.shape[0]
        p = GemmProblem("gather", num_rows, N, D, E, x_PD.dtype, x_rows=x_PD.shape[0],
                        gathered=rows_P is not None)  # fmt: skip
        return choose_gemm(p, gemm_device(x_PD.device))
    layout, w = "", w_END
    if w_END.is_contiguous():
        layout = "nk"
    elif w_END.mT.is_contiguous():
        layout, w = "kn", w_END.mT
    aligned = x_PD.stride(1) == 1 and x_PD.storage_offset() % 8 == 0
    p = GemmProblem("rows", x_PD.shape[0], N, D, E, x_PD.dtype, layout=layout,
                    tma=bool(layout) and _tma(x_PD, w), aligned=aligned)  # fmt: skip
    return choose_gemm(p, gemm_device(x_PD.device))


def plan_gather_mlp(x_ND: torch.Tensor, w_in_EXD: torch.Tensor, rows_R: torch.Tensor) -> GemmPlan:
    """The plan of expert_mlp's no-grad up-projection of the rows ``x[rows_R]`` (no stride test:
    the gathered rows CUTLASS would read are a fresh contiguous copy)."""
    E, X, D = w_in_EXD.shape
    p = GemmProblem("gather_mlp", rows_R.shape[0], X, D, E, x_ND.dtype, x_rows=x_ND.shape[0],
                    gathered=True)  # fmt: skip
    return choose_gemm(p, gemm_device(x_ND.device))


def plan_wgrad(dy_PN: torch.Tensor, x_TD: torch.Tensor, experts: int, gathered: bool) -> GemmPlan:
    """The plan of ``grouped_weight_grad(dy, x, offsets, rows)`` with ``experts`` groups."""
    p = GemmProblem("wgrad", dy_PN.shape[0], dy_PN.shape[1], x_TD.shape[1], experts, dy_PN.dtype,
                    x_rows=x_TD.shape[0], tma=not gathered and _tma(dy_PN, x_TD),
                    gathered=gathered, compiling=torch.compiler.is_compiling())  # fmt: skip
    return choose_gemm(p, gemm_device(dy_PN.device))


def plan_mxfp8(a: torch.Tensor) -> GemmPlan:
    """The plan of ``mxfp8_grouped_mm`` on a's device."""
    return choose_gemm(GemmProblem("mxfp8", a.shape[0], 0, a.shape[1], 0), gemm_device(a.device))


def plan_dequantized(a_MK: torch.Tensor, b_EKN: torch.Tensor, out_dtype: torch.dtype) -> GemmPlan:
    """The plan of the MXFP8 emulation's GEMM of exact bf16 dequantisations (and dA's)."""
    E, K, N = b_EKN.shape
    p = GemmProblem("dequantized", a_MK.shape[0], N, K, E, a_MK.dtype, out_dtype)
    return choose_gemm(p, gemm_device(a_MK.device))


def plan_fp8(x_TD: torch.Tensor, w_END: torch.Tensor, rows_P: torch.Tensor | None) -> GemmPlan:
    """The plan of ``fp8_grouped_mm(x, ..., w, ...)``."""
    E, N, D = w_END.shape
    num_rows = x_TD.shape[0] if rows_P is None else rows_P.shape[0]
    p = GemmProblem("fp8", num_rows, N, D, E, x_TD.dtype, gathered=rows_P is not None)
    return choose_gemm(p, gemm_device(x_TD.device))
