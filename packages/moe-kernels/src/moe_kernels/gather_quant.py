"""``gather_scale_quant_dense_tokens``: gather token rows into the shuffled (expert-sorted) order,
scale them by their router score and quantise them row-wise to FP8, in one pass; the name,
argument order and results of ``fbgemm_gpu.experimental.gen_ai.moe``.

A ``torch.library`` custom op (``moe_kernels::gather_scale_quant_dense_tokens``) with a fake
implementation: a Triton kernel on CUDA (and on CPU under ``TRITON_INTERPRET=1``), the torch
reference on CPU; no host syncs, safe under ``torch.compile(fullgraph=True)`` and CUDA-graph
capture, deterministic; on the GPU bit for bit FBGEMM's results.

Differences from FBGEMM, all deliberate:

* dead rows (token index -1, expert index -1, i >= valid_token_count) are zero, scale included,
  the conventions of ``moe_kernels.tokens.gather_scale_dense_tokens`` (FBGEMM leaves rows past
  the count unwritten and reads x[-1] for a -1 index);
* any strides for x and scores (FBGEMM asserts a contiguous x), int32 or int64 indices, any D
  (FBGEMM's autotuned blocks need D % 256 == 0), int64 offsets;
* NaN products quantise to NaN (0x7F) where FBGEMM's clamp gives +-448; see
  ``moe_kernels.swiglu``. The scale divides as FBGEMM's does on the GPU (``div.full.f32``): the
  GPU matches FBGEMM bit for bit, the CPU reference (IEEE division) within 2 ulp of the scale.

Not differentiable: the op registers no autograd formula, so a backward through it raises.
"""

from __future__ import annotations

import torch

from moe_kernels import _validate as V
from moe_kernels._dispatch import register_op, triton_kernels, use_triton
from moe_kernels.reference import gather_quant as _ref
from moe_kernels.reference.fp8_rowwise import FP8_DTYPE
from moe_kernels.swiglu import Fp8Rows

__all__ = ["gather_scale_quant_dense_tokens"]


def _triton():
    return triton_kernels("gather_quant")  # imported on first use: triton only when a kernel runs


def _impl(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    scale_ub: torch.Tensor | None,
    valid_token_count: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x.device):
        return _ref.gather_scale_quant_dense_tokens(
            x, token_indices, expert_indices, scores, scale_ub, valid_token_count
        )
    return _triton().gather_scale_quant(
        x,
        token_indices.contiguous(),
        expert_indices.contiguous(),
        scores,
        scale_ub,
        valid_token_count,
    )


def _fake(x, token_indices, expert_indices, scores, scale_ub, valid_token_count):
    n = token_indices.shape[0]
    return x.new_empty((n, x.shape[1]), dtype=FP8_DTYPE), x.new_empty((n,), dtype=torch.float32)


gather_scale_quant_dense_tokens_op = register_op("gather_scale_quant_dense_tokens", _impl, _fake)


def gather_scale_quant_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> Fp8Rows:
    """Rows ``x[tok[i]] * scores[tok[i], exp[i]]``, quantised row-wise to FP8: ``(q, scale)``.

    x: (T, D) float32/bf16/fp16, any strides; token_indices, expert_indices: (N,) int32/int64;
    scores: (T, E) float32/bf16/fp16, any strides (e.g. a column-major view); scale_ub: optional
    one-element float32 tensor (an upper bound on the row maximum); valid_token_count: optional
    one-element int32/int64 tensor (the number of valid rows, read on the device). All on one
    device.

    Returns ``Fp8Rows(data, scale)``, a tuple: data (N, D) float8_e4m3fn, scale (N,) float32,
    with ``data[i] * scale[i] ~= v_i`` for ``v_i = fp32(x[tok_i]) * fp32(scores[tok_i, exp_i])``
    (one fp32 product). Per row: ``m = max(max_j |v_j|, 1e-12)``, bounded by scale_ub;
    ``s = 448 / m``, ``scale = 1 / s`` (FBGEMM's divisions on the GPU);
    ``data = e4m3fn(clamp(v * s, -448, 448))``, rounded to nearest even. Rows with token index
    outside [0, T) (-1: padding), expert index outside [0, E), or i >= valid_token_count are
    dead: data 0 and scale 0 (as in ``gather_scale_dense_tokens``). Specials (NaN, inf,
    scale_ub) as in ``silu_mul_quant``.
    """
    x, token_indices, expert_indices, scores = V.dense_gather(
        x, token_indices, expert_indices, scores
    )
    V.scale_ub(scale_ub, "x", x)
    V.valid_token_count(valid_token_count, "x", x)
    args = (x, token_indices, expert_indices, scores, scale_ub, valid_token_count)
    return Fp8Rows(*gather_scale_quant_dense_tokens_op.call(*args))
