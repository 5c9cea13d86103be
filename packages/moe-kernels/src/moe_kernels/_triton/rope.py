"""Triton kernel for ``qk_norm_rope``: QK RMS-norm + RoPE + the KV ring write in one launch.

Grid (token blocks, Hq + K) with Hq = H (or 0 without q): program (i, j) takes tokens
i*BLOCK_N .. +BLOCK_N of one head. j < Hq: query head j, written to q_out (H, N, D); else kv head
j - Hq: its k (normed, rotated) and v (copied) written to every slot of ``slots`` (1 or 2, loaded
on the device) in the cache layer. A head's (BLOCK_N, D) tile is loaded once in its own dtype and
upcast; the norm's sum of squares is one reduction over D in registers; the pairs (x[2i],
x[2i+1]) come from ``tl.reshape`` + ``tl.split`` of the tile (stores stay contiguous rows of D).

Numerics (the model's): ``y = x * (1 / sqrt_rn(mean(x^2) + eps)) * w`` in fp32 (IEEE sqrt and
divides, as torch's CPU rsqrt), rounded to x's dtype, then ``(y0 c - y1 s, y0 s + y1 c)`` in fp32
with every product rounded (``mul.rn.f32`` on the GPU, never contracted into an FMA), rounded to
x's dtype. Only the sum over D runs in another order than torch's. No atomics, no host reads.
Loads and stores are in the kernel body and helpers get values only (Inductor's mutation
analysis counts a pointer passed into a helper that feeds a store address as written). Slots
outside [0, S) are skipped (memory-safe). Arguments are checked by ``moe_kernels.rope``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels._dispatch import INTERPRET
from moe_kernels._triton.blocks import cdiv, next_pow2
from moe_kernels._triton.launch import FastKernel


@triton.jit
def _mul(a, b, EXACT_MUL: tl.constexpr):
    """a * b rounded to fp32 (``mul.rn.f32`` where EXACT_MUL: never fused into an add)."""
    if EXACT_MUL:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _normed(x, w, eps, HEAD_DIM: tl.constexpr, EXACT_MUL: tl.constexpr):
    """x (BLOCK_N, BLOCK_D) fp32 (zeros past D), w (BLOCK_D,) fp32 -> x / rms(x) * w, fp32:
    ``x * (1 / sqrt_rn(sum(x^2) / D + eps)) * w`` with IEEE divides, the squares rounded."""
    BLOCK_N: tl.constexpr = x.shape[0]
    sq = _mul(x, x, EXACT_MUL)
    ms = tl.math.div_rn(tl.sum(sq, axis=1), tl.full((BLOCK_N,), HEAD_DIM, tl.float32))
    r = tl.math.div_rn(tl.full((BLOCK_N,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    return (x * r[:, None]) * w[None, :]


@triton.jit
def _rotate(y, c, s, EXACT_MUL: tl.constexpr):
    """y (BLOCK_N, BLOCK_D) fp32 -> pairs rotated: (y0 c - y1 s, y0 s + y1 c), fp32."""
    BLOCK_N: tl.constexpr = y.shape[0]
    BLOCK_D: tl.constexpr = y.shape[1]
    y0, y1 = tl.split(tl.reshape(y, (BLOCK_N, BLOCK_D // 2, 2)))
    o0 = _mul(y0, c, EXACT_MUL) - _mul(y1, s, EXACT_MUL)
    o1 = _mul(y0, s, EXACT_MUL) + _mul(y1, c, EXACT_MUL)
    return tl.reshape(tl.join(o0, o1), (BLOCK_N, BLOCK_D))


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # (N, H*D), any strides (a dummy without q)
    k_ptr,  # (N, K*D), any strides
    v_ptr,  # (N, K*D), any strides
    qw_ptr,  # (D,) any float
    kw_ptr,  # (D,) any float
    cos_ptr,  # (N, P) float, any strides
    sin_ptr,  # (N, P) float, any strides
    slots_ptr,  # (NUM_SLOTS,) int64
    q_out_ptr,  # (H, N, D) contiguous, q's dtype
    k_cache_ptr,  # (L, K, S, N, D) contiguous, k's dtype
    v_cache_ptr,  # (L, K, S, N, D) contiguous, k's dtype
    N,
    HQ,  # query heads handled (H, or 0 without q)
    KV,  # kv heads
    S,
    layer,
    stride_qn,
    stride_qc,
    stride_kn,
    stride_kc,
    stride_vn,
    stride_vc,
    stride_cn,
    stride_cp,
    stride_sn,
    stride_sp,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    EXACT_MUL: tl.constexpr,
    EPS: tl.constexpr,  # a constant: a float argument is fp32 from Triton's launch, fp64 from
    # Inductor's
):
    BLOCK_P: tl.constexpr = BLOCK_D // 2
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    pairs = tl.arange(0, BLOCK_P)
    row_in = rows < N
    if BLOCK_D == HEAD_DIM:
        tile_in = row_in[:, None]
        cs_in = row_in[:, None]
    else:
        tile_in = row_in[:, None] & (cols < HEAD_DIM)[None, :]
        cs_in = row_in[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    c = tl.load(
        cos_ptr + rows[:, None] * stride_cn + pairs[None, :] * stride_cp, mask=cs_in, other=0.0
    ).to(tl.float32)
    s = tl.load(
        sin_ptr + rows[:, None] * stride_sn + pairs[None, :] * stride_sp, mask=cs_in, other=0.0
    ).to(tl.float32)
    # the tile's offsets in the (H, N, D) / (K, N, D) outputs: rows of D, contiguous
    out_off = rows[:, None] * HEAD_DIM + cols[None, :]
    if head < HQ:
        in_cols = (head * HEAD_DIM + cols).to(tl.int64)  # the head's columns of q
        x_raw = tl.load(
            q_ptr + rows[:, None] * stride_qn + in_cols[None, :] * stride_qc,
            mask=tile_in,
            other=0.0,
        )
        w = tl.load(qw_ptr + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
        y = _normed(x_raw.to(tl.float32), w, EPS, HEAD_DIM, EXACT_MUL)
        y = y.to(x_raw.dtype).to(tl.float32)  # the model rounds between norm and rope
        o = _rotate(y, c, s, EXACT_MUL).to(x_raw.dtype)
        dst = q_out_ptr + head.to(tl.int64) * N * HEAD_DIM + out_off
        tl.store(dst, o, mask=tile_in)
    else:
        kvh = head - HQ
        in_cols = (kvh * HEAD_DIM + cols).to(tl.int64)  # the head's columns of k and v
        x_raw = tl.load(
            k_ptr + rows[:, None] * stride_kn + in_cols[None, :] * stride_kc,
            mask=tile_in,
            other=0.0,
        )
        v = tl.load(
            v_ptr + rows[:, None] * stride_vn + in_cols[None, :] * stride_vc,
            mask=tile_in,
            other=0.0,
        )
        w = tl.load(kw_ptr + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
        y = _normed(x_raw.to(tl.float32), w, EPS, HEAD_DIM, EXACT_MUL)
        y = y.to(x_raw.dtype).to(tl.float32)
        o = _rotate(y, c, s, EXACT_MUL).to(x_raw.dtype)
        head_base = (layer * KV + kvh).to(tl.int64) * S
        for j in tl.static_range(NUM_SLOTS):
            slot = tl.load(slots_ptr + j)
            # compared as a vector: Triton 3.9's interpreter rejects a mask from a scalar test
            slot_n = rows.to(tl.int64) * 0 + slot
            keep = tile_in & ((slot_n >= 0) & (slot_n < S))[:, None]
            off = (head_base + slot) * N * HEAD_DIM + out_off
            tl.store(k_cache_ptr + off, o, mask=keep)
            tl.store(v_cache_ptr + off, v, mask=keep)


_qk_norm_rope = FastKernel(_qk_norm_rope_kernel)


class RopeConfig(NamedTuple):
    """Launch shape: tokens per program, warps."""

    block_n: int
    num_warps: int = 4


def pick_config(num_tokens: int, head_dim: int) -> RopeConfig:
    """GPU: 32 tokens of a head per program (a (32, 64) bf16 tile is 4 KiB; 768 programs at the
    seed shape N=512, H=32, K=16), 4 warps; not tuned on a GPU yet
    (``benchmarks/gpu/rope_gpu.py`` sweeps the configs). Interpreter: few, large programs."""
    if INTERPRET:
        return RopeConfig(min(128, max(1, next_pow2(num_tokens))), 4)
    block_n = max(1, min(32, 2048 // next_pow2(head_dim)))
    return RopeConfig(block_n, 4)


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
    config: RopeConfig | None = None,
) -> torch.Tensor:
    """The launch: writes the cache slots, returns q_out (H, N, D) ((0, N, D) without q)."""
    N = k_NC.shape[0]
    _, K, S, _, D = k_cache.shape
    H = 0 if q_NC is None else q_NC.shape[1] // D
    q_out = k_NC.new_empty((H, N, D))
    if N == 0 or H + K == 0:
        return q_out
    cfg = config or pick_config(N, D)
    q_in = k_NC if q_NC is None else q_NC
    qw = k_weight_D if q_weight_D is None else q_weight_D
    _qk_norm_rope.launch(
        (cdiv(N, cfg.block_n), H + K),
        (
            q_in,
            k_NC,
            v_NC,
            qw,
            k_weight_D,
            cos_NP,
            sin_NP,
            slots_J,
            q_out,
            k_cache,
            v_cache,
            N,
            H,
            K,
            S,
            layer,
            q_in.stride(0),
            q_in.stride(1),
            k_NC.stride(0),
            k_NC.stride(1),
            v_NC.stride(0),
            v_NC.stride(1),
            cos_NP.stride(0),
            cos_NP.stride(1),
            sin_NP.stride(0),
            sin_NP.stride(1),
        ),
        dict(
            HEAD_DIM=D,
            BLOCK_N=cfg.block_n,
            BLOCK_D=next_pow2(D),
            NUM_SLOTS=slots_J.shape[0],
            EXACT_MUL=not INTERPRET,  # numpy rounds each product itself
            EPS=float(eps),
        ),
        num_warps=cfg.num_warps,
    )
    return q_out
