"""Reference of ``moe_kernels.fp8_grouped_mm`` and of ``quantize_fp8_weights``."""

from __future__ import annotations

import torch

from moe_kernels.reference.fp8_rowwise import FP8_DTYPE, FP8_MAX
from moe_kernels.reference.grouped_mm import row_groups

SCALE_BLOCK = 128


def fp8_grouped_mm(
    x_TD: torch.Tensor,
    x_scale_T: torch.Tensor,
    w_END: torch.Tensor,
    w_scale: torch.Tensor,
    offsets_E1: torch.Tensor,
    row_indices_P: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(P, N) in ``out_dtype``: for offsets[e] <= p < offsets[e+1] and r = rows[p], the fp32 sum
    ``x[r] @ w[e].T`` of the fp8 values (per 128-deep K block times its block scale with block
    scales), times x_scale[r] (and w_scale[e] per output channel); rows past offsets[E] and rows
    whose index is outside [0, T) zero. Offsets clamped by ``group_bounds``."""
    num_tokens, dim = x_TD.shape
    n = w_END.shape[1]
    num_rows = num_tokens if row_indices_P is None else row_indices_P.shape[0]
    y_PN = torch.zeros((num_rows, n), dtype=torch.float32, device=x_TD.device)
    for e, start, end, src, live in row_groups(num_tokens, offsets_E1, row_indices_P, num_rows):
        a = x_TD.index_select(0, src).float()
        b = w_END[e].float()
        if w_scale.dim() == 3:  # per 128 x 128 block: each K block's partial sum times its scale
            s_nk = w_scale[e].float().repeat_interleave(SCALE_BLOCK, 0)[:n]  # (N, D/128)
            h = torch.zeros(end - start, n, device=x_TD.device)
            for kb in range(0, dim, SCALE_BLOCK):
                part = a[:, kb : kb + SCALE_BLOCK] @ b[:, kb : kb + SCALE_BLOCK].T
                h += part * s_nk[:, kb // SCALE_BLOCK][None, :]
        else:
            h = (a @ b.T) * w_scale[e].float()[None, :]
        h = h * x_scale_T.index_select(0, src).float()[:, None]
        y_PN[start:end] = torch.where(live[:, None], h, 0.0)
    return y_PN.to(out_dtype)


CHUNK_ELEMENTS = 2**26  # the experts quantised at a time: fp32 temporaries of ~256 MiB each


def quantize_fp8_weights(
    w_END: torch.Tensor, block: bool, chunk_elements: int = CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q (E, N, D) float8_e4m3fn, scale fp32): per output channel, scale (E, N) = amax over D
    / 448 (1 for an all-zero row); with ``block`` per 128 x 128 block, scale (E, ceil(N/128),
    ceil(D/128)). ``w_q = e4m3(w / scale)`` (round to nearest even, clamped to +-448). Experts
    are independent: quantised a few at a time (``chunk_elements`` weights), so a DeepSeek-V3
    layer's fp32 temporaries stay bounded, with the same bits."""
    E, N, D = w_END.shape
    step = max(1, chunk_elements // max(1, N * D))
    if step < E:
        parts = [_quantize(w_END[e : e + step], block) for e in range(0, E, step)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    return _quantize(w_END, block)


def _quantize(w_END: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    E, N, D = w_END.shape
    w = w_END.float()
    if block:
        nb, kb = -(-N // SCALE_BLOCK), -(-D // SCALE_BLOCK)
        padded = w.new_zeros(E, nb * SCALE_BLOCK, kb * SCALE_BLOCK)
        padded[:, :N, :D] = w.abs()
        amax = padded.view(E, nb, SCALE_BLOCK, kb, SCALE_BLOCK).amax(dim=(2, 4))
    else:
        amax = w.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (w / broadcast_scale(scale, N, D)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def broadcast_scale(scale: torch.Tensor, N: int, D: int) -> torch.Tensor:
    """Weight scales (E, N) per output channel, or (E, ceil(N/128), ceil(D/128)) per 128 x 128
    block, as a tensor that broadcasts against the (E, N, D) weights, fp32."""
    scale = scale.float()
    if scale.dim() == 2:
        return scale[:, :, None]
    full = scale.repeat_interleave(SCALE_BLOCK, 1).repeat_interleave(SCALE_BLOCK, 2)
    return full[:, :N, :D]
