"""The roofline of one world-model frame: FLOPs and minimum bytes per profile category, counted
from a ``moe_model.WorldModelConfig``'s shapes, each category's floor at a device's peaks, and
(joined with a ``rollout_profile`` breakdown) the achieved rate and measured / floor.

Shape legend: L layers, D d_model, H / Hkv query / kv heads of Dh, N tokens per frame, W window,
S = (W + 1) N keys (SDPA reads the ring and the scratch slot, masked or not), E experts, k top_k,
R = N k expert rows, F moe_hidden (F2 = 2F when gated), C cond_dim, P patch_dim, I itemsize of
the engine's dtype (bf16: 2 B; the router's weight is fp32).

A frame (``moe_model.engine``) is ``denoise_steps`` denoise passes (every layer, then the final
layer) and one cache pass: layers 0..L-2 in full (they attend, then write the frame's keys and
values into the ring), the last layer only its modulation and K/V projections and the ring write
(no attention, no MLP, no final layer); then the decoder, once, when images are on. A steady
frame runs the previous frame's cache pass and its first denoise pass as one forward of 2N rows
(``WorldModel.commit_and_denoise``): its matmuls read each weight once for both passes.

FLOPs: 2 per multiply-add of the matmuls (linear layers, the experts' R routed rows, the router),
attention 4 H N S Dh (QK^T and PV), the decoder's 3x3 convolutions 18 Hout Wout Cin Cout. Norms,
softmax, RoPE, routing and residuals count no FLOPs (their floor is their bytes).

Bytes, the minimum each op moves to or from HBM, ops as the model writes them (what one kernel
hands the next counts as written and read, even where L2 could hold it): a matmul reads its
weight once per pass (the experts: every expert a row can reach, min(E, R) of them) and its input
once (the experts' up-projection: the N tokens, not the R gathered rows), and writes its output
once; attention reads Q and the K/V window and writes O; the pointwise groups (norm +
modulation, QK-norm + RoPE + KV write, residual + norm, residual, final norm, the Euler step) and
the combine read their inputs and write their outputs once; the experts' activation is fused into
the up-projection (0 B); the decoder's upsampling is fused into the next convolution (its input
is counted at the small size). Biases and the conditioning's vectors are ignored.

Floors: each op's floor is max(FLOPs / peak FLOP/s, bytes / peak B/s) (ms), summed per category
(the kernels run one after another); ``frame_bound`` is the looser max(all FLOPs / peak, all
bytes / bandwidth) of the frame as one kernel.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from moe_model import WorldModelConfig
from moe_tools.rollout_profile import CATEGORIES


class Peak(NamedTuple):
    """A device's peaks: dense bf16 tensor-core TFLOP/s and HBM GB/s (1e9 B/s)."""

    name: str
    tflops: float
    gbps: float


# Spec sheets, dense bf16 (no sparsity). Keyed by device name prefix, "NVIDIA " stripped; the
# longest matching prefix wins ("H100 PCIe" before "H100").
PEAKS: dict[str, Peak] = {
    "H200": Peak("H200", 989.0, 4800.0),
    "H100 PCIe": Peak("H100 PCIe", 756.0, 2000.0),
    "H100": Peak("H100 SXM", 989.0, 3350.0),
}


def find_peak(
    device_name: str | None, *, tflops: float | None = None, gbps: float | None = None
) -> Peak | None:
    """The peaks of ``device_name`` (``torch.cuda.get_device_name``) from :data:`PEAKS`, either
    figure replaced by ``tflops`` / ``gbps``; None when one of the two stays unknown."""
    name = (device_name or "").removeprefix("NVIDIA ").strip()
    keys = sorted((k for k in PEAKS if name.startswith(k)), key=len, reverse=True)
    base = PEAKS[keys[0]] if keys else Peak(name or "custom", math.nan, math.nan)
    peak = Peak(base.name, tflops or base.tflops, gbps or base.gbps)
    return None if math.isnan(peak.tflops) or math.isnan(peak.gbps) else peak


class OpCount(NamedTuple):
    """One op of the frame: its category, FLOPs and bytes per call, calls per frame."""

    name: str
    category: str
    flops: float
    bytes: float
    calls: int

    def floor_ms(self, peak: Peak) -> float:
        """All its calls' floor (ms): max(FLOPs / peak, bytes / bandwidth) per call."""
        return self.calls * max(self.flops / peak.tflops / 1e9, self.bytes / peak.gbps / 1e6)


def _mm(
    name: str, category: str, m: int, k: int, n: int, it: int, calls: int, **kw: int
) -> OpCount:
    """(m, k) @ (k, n): weight k n (``w_copies`` of it), input m k (``in_rows`` k when its rows
    are gathered from fewer), output m n; ``it`` bytes an element."""
    copies, in_rows = kw.get("w_copies", 1), kw.get("in_rows", m)
    return OpCount(
        name, category, 2 * m * k * n, (copies * k * n + in_rows * k + m * n) * it, calls
    )


def _io(name: str, category: str, elems: int, it: int, calls: int) -> OpCount:
    """A memory pass moving ``elems`` elements of ``it`` bytes (reads + writes), no FLOPs."""
    return OpCount(name, category, 0, elems * it, calls)


def frame_ops(cfg: WorldModelConfig, *, itemsize: int = 2, images: bool = True) -> list[OpCount]:
    """Every op of one steady frame of ``cfg`` (see the module docstring), calls per frame."""
    it, L, D, N = itemsize, cfg.n_layers, cfg.d_model, cfg.tokens_per_frame
    H, Hkv, Dh, C, P = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.cond_dim, cfg.patch_dim
    S = (cfg.window + 1) * N
    den = cfg.denoise_steps  # denoise passes; + 1 cache pass
    passes, full = den + 1, den * L + (L - 1)  # passes; layers run in full per frame
    # (rows, calls) of the forwards' matmuls: the pair forward (cache pass + first denoise pass)
    # at 2N rows, where its last layer runs the denoise pass alone, and den - 1 denoise passes.
    embed = [(2 * N, 1), (N, den - 1)]
    per_layer = [(2, L), (1, (den - 1) * L)]  # modulation: one conditioning row per pass
    kv_runs = [(2 * N, L), (N, (den - 1) * L)]
    runs = [(2 * N, L - 1), (N, 1), (N, (den - 1) * L)]  # layers in full
    q, kv = H * Dh, Hkv * Dh
    cond_w = cfg.freq_dim * C + C * C + cfg.n_buttons * C + 2 * C
    ops = [
        *(_mm("patch_embed", "gemm", m, P, D, it, n) for m, n in embed),
        OpCount("cond", "gemm", 2 * cond_w, cond_w * it, passes),  # one row: weights only
        *(_mm("modulation", "gemm", m, C, 6 * D, it, n) for m, n in per_layer),
        _io("norm1_modulate", "pointwise", 2 * N * D, it, passes * L),
        *(_mm("k_v_proj", "gemm", m, D, 2 * kv, it, n) for m, n in kv_runs),
        *(_mm("q_proj", "gemm", m, D, q, it, n) for m, n in runs),
        _io("qk_norm_rope", "pointwise", 2 * N * (q + 2 * kv), it, full),
        OpCount("attention", "attention", 4 * H * N * S * Dh, (2 * N * q + 2 * S * kv) * it, full),
        *(_mm("o_proj", "gemm", m, q, D, it, n) for m, n in runs),
        _io("residual_norm2", "pointwise", 4 * N * D, it, full),
        _io("residual", "pointwise", 3 * N * D, it, full),
        _io("kv_ring_write", "pointwise", 4 * N * kv, it, L),  # the cache pass, every layer
    ]
    if cfg.mlp == "moe":
        E, F = cfg.n_experts, cfg.moe_hidden
        F2 = F * (2 if cfg.gated else 1)
        for m, n in runs:
            R, reached = m * cfg.top_k, min(E, m * cfg.top_k)  # rows; experts they can reach
            ops += [
                OpCount("router", "routing", 2 * m * D * E, D * E * 4 + m * D * it + m * E * 4, n),
                _mm("experts_up", "gemm", R, D, F2, it, n, w_copies=reached, in_rows=m),
                _mm("experts_down", "gemm", R, F, D, it, n, w_copies=reached),
                _io("combine", "routing", R * D + m * D, it, n),
            ]
    else:
        F2 = cfg.dense_hidden * (2 if cfg.gated else 1)
        for m, n in runs:
            ops += [
                _mm("mlp_in", "gemm", m, D, F2, it, n),
                _mm("mlp_out", "gemm", m, cfg.dense_hidden, D, it, n),
            ]
    latent = cfg.latent_channels * cfg.latent_h * cfg.latent_w
    ops += [
        _mm("final_mod", "gemm", 1, C, 2 * D, it, den),
        _io("final_norm", "pointwise", 2 * N * D, it, den),
        _mm("final_proj", "gemm", N, D, P, it, den),
        _io("euler_step", "pointwise", 3 * latent, 4, den),  # fp32 latent
    ]
    if images:
        ops += decoder_ops(cfg, itemsize=it)
    return [o for o in ops if o.calls]


def decoder_ops(cfg: WorldModelConfig, *, itemsize: int = 2) -> list[OpCount]:
    """The decoder's convolutions (``moe_model.autoencoder.LatentDecoder``'s channels) and its
    final pass to uint8 RGB, once per frame."""
    ch, h, w = cfg.decoder_channels, cfg.latent_h, cfg.latent_w
    chs = [ch, ch, max(ch // 2, 1), max(ch // 4, 1)]
    # (cin, cout, input pixels, output pixels): conv_in, the three upsampling convs, conv_out
    layers = [(cfg.latent_channels, chs[0], h * w, h * w)]
    layers += [(chs[i], chs[i + 1], 4**i * h * w, 4 ** (i + 1) * h * w) for i in range(3)]
    layers.append((chs[3], 3, 64 * h * w, 64 * h * w))
    ops = [
        OpCount(
            f"conv{i}",
            "decode",
            18 * pix_out * cin * cout,
            (9 * cin * cout + pix_in * cin + pix_out * cout) * itemsize,
            1,
        )
        for i, (cin, cout, pix_in, pix_out) in enumerate(layers)
    ]
    return [*ops, OpCount("to_rgb_uint8", "decode", 0, 3 * 64 * h * w * (itemsize + 1), 1)]


class CategoryRoof(NamedTuple):
    """A category's work per frame: FLOPs, bytes, and its floor (ms; None without peaks)."""

    category: str
    flops: float
    bytes: float
    floor_ms: float | None


class Roofline(NamedTuple):
    """A frame's roofline: one entry per profile category, the totals, and the frame as one
    kernel (``frame_bound_ms``: max(all FLOPs / peak, all bytes / bandwidth))."""

    peak: Peak | None
    categories: tuple[CategoryRoof, ...]
    flops: float
    bytes: float
    floor_ms: float | None
    frame_bound_ms: float | None


def roofline(ops: Iterable[OpCount], peak: Peak | None) -> Roofline:
    """Per-category sums of ``ops`` (FLOPs, bytes, floors at ``peak``) in CATEGORIES order."""
    ops = list(ops)
    cats = []
    for c in CATEGORIES:
        mine = [o for o in ops if o.category == c]
        floor = None if peak is None else math.fsum(o.floor_ms(peak) for o in mine)
        flops = math.fsum(o.flops * o.calls for o in mine)
        cats.append(CategoryRoof(c, flops, math.fsum(o.bytes * o.calls for o in mine), floor))
    flops, nbytes = math.fsum(c.flops for c in cats), math.fsum(c.bytes for c in cats)
    if peak is None:
        return Roofline(None, tuple(cats), flops, nbytes, None, None)
    bound = max(flops / peak.tflops / 1e9, nbytes / peak.gbps / 1e6)
    return Roofline(peak, tuple(cats), flops, nbytes, math.fsum(c.floor_ms for c in cats), bound)


def achieved(
    flops: float, nbytes: float, floor: float | None, ms: float | None, peak: Peak | None
) -> dict[str, Any]:
    """What work of ``flops`` and ``nbytes`` reached in a measured ``ms``: ``achieved_tflops``,
    ``achieved_gbps``, ``x_floor`` (ms / floor; None without a floor, a time or any work), and
    ``bound``: "compute" when its FLOPs at peak take longer than its bytes at full bandwidth,
    else "memory" (None without peaks or work)."""
    out: dict[str, Any] = {"achieved_tflops": None, "achieved_gbps": None, "x_floor": None}
    if ms and (flops or nbytes):
        out["achieved_tflops"] = flops / ms / 1e9
        out["achieved_gbps"] = nbytes / ms / 1e6
        out["x_floor"] = ms / floor if floor else None
    compute = peak is not None and flops / peak.tflops / 1e3 > nbytes / peak.gbps
    out["bound"] = (
        None if peak is None or not (flops or nbytes) else ("compute" if compute else "memory")
    )
    return out


def attach(profile: Mapping[str, Any], roof: Roofline) -> dict[str, Any]:
    """``profile`` (``Breakdown.to_dict``) with each category's flops, bytes, floor_ms and
    :func:`achieved` figures added, and ``profile["roofline"]``: the peaks and the totals."""
    by_cat = {c.category: c for c in roof.categories}
    cats = []
    for c in profile.get("categories", []):
        r = by_cat[c["category"]]
        extra = achieved(r.flops, r.bytes, r.floor_ms, c.get("ms_per_frame"), roof.peak)
        cats.append({**c, "flops": r.flops, "bytes": r.bytes, "floor_ms": r.floor_ms, **extra})
    ms = profile.get("device_ms_per_frame")
    total = achieved(roof.flops, roof.bytes, roof.floor_ms, ms, roof.peak)
    summary = {
        "peak": None if roof.peak is None else roof.peak._asdict(),
        "flops": roof.flops,
        "bytes": roof.bytes,
        "floor_ms": roof.floor_ms,
        "frame_bound_ms": roof.frame_bound_ms,
        **total,
    }
    return {**profile, "categories": cats, "roofline": summary}
