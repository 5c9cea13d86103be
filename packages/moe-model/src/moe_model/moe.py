"""``MoELayer``: a router and E SiLU (or SwiGLU) experts, with one small strategy per ``impl``.

Every implementation reads the same parameters, so ``layer.impl = "torch"`` switches an existing
layer. The data path of the sync-free implementations:
``scores = router(x)`` -> ``plan = route(scores, k)`` -> ``xs = dispatch(x, plan)`` ->
``h = grouped_mm(xs, in_proj^T)`` -> activation -> ``ys = grouped_mm(h, out_proj^T)`` ->
``y = combine(ys, plan)``; the ``triton_*`` implementations fuse the dispatch into the first
grouped GEMM (the rows are gathered inside it, which also applies the SiLU) when no gradient is
recorded. Training (autograd recording) runs the unfused chain, every step differentiable through
the ops' own backward (deterministic, no float atomics): the dispatched rows are what the weight
gradient of the first GEMM reads, and the activation's input is saved rather than recomputed.

Routing options (expert bias, expert groups, weight scale, renormalisation) reach every
implementation: ``baseline`` and ``torch`` through this package's own torch formula
(``_routing_torch.topk_choices``), the kernel implementations through ``moe_kernels.route``
(``MoELayer.route_options``). Every implementation records its per-expert counts in
``layer.last_counts``; the shared experts and the auxiliary loss are added by ``forward``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_model._moe_options import (
    FLOAT_DTYPES,
    check_bool,
    check_dtype,
    check_fbgemm_options,
    check_rate,
    check_routing_args,
    check_size,
    expert_bias_step,
    expert_counts,
    switch_aux_loss,
)
from moe_model._routing_torch import topk_choices, torch_plan
from moe_model.presets import preset_kwargs
from moe_model.shared_experts import SharedExperts

MOE_IMPLS: tuple[str, ...] = (
    "baseline",
    "torch",
    "triton_bf16",
    "triton_fp32",
    "fbgemm",
    "mxfp8",
)
SCORE_FNS = ("softmax", "sigmoid")


# ---------------------------------------------------------------------------------------------
# Grouped GEMM: torch._grouped_mm where it runs (CUDA sm90+, bf16, dims % 16), else a static loop.


def _grouped_mm_supported(a_MK: torch.Tensor, b_EKN: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or a_MK.device.type != "cuda":
        return False
    if a_MK.dtype != torch.bfloat16 or b_EKN.dtype != torch.bfloat16:
        return False
    # get_device_properties (not get_device_capability) is constant-folded by dynamo.
    if torch.cuda.get_device_properties(a_MK.device).major < 9:
        return False
    return a_MK.shape[1] % 16 == 0 and b_EKN.shape[2] % 16 == 0


def grouped_mm(
    a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets: torch.Tensor, expert_M: torch.Tensor
) -> torch.Tensor:
    """Rows of ``a_MK`` grouped by expert times that expert's ``b_EKN[e]`` -> (M, N), a's dtype.

    offsets: (E+1,) int32 exclusive prefix sum of group sizes; expert_M: (M,) expert of each row
    (-1 or any id outside [0, E) for rows in no group: their output rows are zero).
    """
    b_EKN = b_EKN.to(a_MK.dtype)
    if _grouped_mm_supported(a_MK, b_EKN):
        return torch._grouped_mm(a_MK, b_EKN, offs=offsets[1:].to(torch.int32))
    # Static-shape fallback (CPU, older GPUs, fp32): every expert's GEMM over all rows, keep the
    # rows of that expert. E times the FLOPs, but no data-dependent shape and no host sync.
    out_MN = a_MK.new_zeros(a_MK.shape[0], b_EKN.shape[2])
    for e in range(b_EKN.shape[0]):
        rows_M1 = (expert_M == e).unsqueeze(1)
        out_MN = torch.where(rows_M1, a_MK @ b_EKN[e], out_MN)
    return out_MN


def _activation(h_MH: torch.Tensor, gated: bool) -> torch.Tensor:
    """SiLU, or SwiGLU ``silu(gate) * up`` with gate = first half of the columns; fp32 math
    (torch's silu computes bf16 inputs in fp32 and rounds once)."""
    if not gated:
        return F.silu(h_MH)
    gate_MH, up_MH = h_MH.float().chunk(2, dim=-1)
    return (F.silu(gate_MH) * up_MH).to(h_MH.dtype)


# ---------------------------------------------------------------------------------------------
# Implementations: f(layer, x_TD, scores_TE) -> y_TD (x's dtype), the routed experts' output;
# each writes its per-expert pair counts into layer.last_counts.


def _torch_choices(layer: MoELayer, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_Tk fp32, experts_Tk int64) of the layer's routing, by the torch formula."""
    return topk_choices(
        scores_TE,
        layer.top_k,
        layer.renormalize,
        bias=layer.expert_bias,
        n_groups=layer.n_groups,
        topk_groups=layer.topk_groups,
        scale=layer.routed_scaling_factor,
    )


def _record_counts(layer: MoELayer, counts_E: torch.Tensor) -> None:
    """Copy the forward's per-expert pair counts into ``layer.last_counts`` (in place: the
    buffer keeps its address for CUDA graphs and is a mutation torch.compile traces)."""
    layer.last_counts.copy_(counts_E)


def _forward_baseline(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """Reference: per-expert fp32 loop with host syncs (nonzero). Slow, not compileable."""
    T, D = x_TD.shape
    w_Tk, e_Tk = _torch_choices(layer, scores_TE)
    _record_counts(layer, expert_counts(e_Tk, layer.n_experts))
    x32_TD = x_TD.float()
    y_TkD = x32_TD.new_zeros(T, layer.top_k, D)
    for e in range(layer.n_experts):
        tok, j = (e_Tk == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x32_TD[tok] @ layer.in_proj[e].float().t()
        h = F.silu(h) if not layer.gated else F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
        y_TkD = y_TkD.index_put((tok, j), h @ layer.out_proj[e].float().t())
    # Weighted sum over the k choices in choice order (deterministic).
    return (y_TkD * w_Tk.unsqueeze(-1)).sum(dim=1).to(x_TD.dtype)


def _forward_torch(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """Torch routing (stable sort, compare-and-sum counts, cumsum), gather, grouped GEMMs, fp32
    weighted sum over the k choices. Sync-free, deterministic, differentiable."""
    T, D = x_TD.shape
    w_Tk, e_Tk = _torch_choices(layer, scores_TE)
    plan = torch_plan(w_Tk, e_Tk, layer.n_experts)
    _record_counts(layer, plan.offsets[1:] - plan.offsets[:-1])
    w_dtype = layer.in_proj.dtype
    xs_PD = x_TD.to(w_dtype)[plan.token_indices]
    h_PH = grouped_mm(xs_PD, layer.in_proj.mT, plan.offsets, plan.expert_indices)
    ys_PD = grouped_mm(
        _activation(h_PH, layer.gated), layer.out_proj.mT, plan.offsets, plan.expert_indices
    )
    y_TkD = ys_PD[plan.inverse.reshape(-1)].view(T, layer.top_k, D).float()
    return (y_TkD * w_Tk.unsqueeze(-1)).sum(dim=1).to(x_TD.dtype)


def _kernels_experts(
    layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor, mm: Callable
) -> tuple[torch.Tensor, object]:
    from moe_kernels.activation import expert_activation
    from moe_kernels.routing import route
    from moe_kernels.tokens import dispatch

    plan = route(scores_TE, layer.top_k, **layer.route_options())
    _record_counts(layer, plan.counts)
    w_dtype = layer.in_proj.dtype
    xs_PD = dispatch(x_TD.to(w_dtype), plan)
    h_PH = mm(xs_PD, layer.in_proj.mT, plan)
    ys_PD = mm(expert_activation(h_PH, layer.gated), layer.out_proj.mT, plan)
    return ys_PD, plan


def _fused_experts(
    layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor
) -> tuple[torch.Tensor, object]:
    """``route``; the dispatch (gather of the routed rows), first GEMM and SiLU in one Triton
    grouped GEMM; the second GEMM (``torch._grouped_mm`` where it runs, else the Triton grouped
    GEMM). SwiGLU layers apply the gate between the GEMMs (outside the kernel). Returns the
    expert outputs (T * k, D) in the plan's sorted order, and the plan."""
    from moe_kernels import expert_activation, gather_grouped_mm, route

    plan = route(scores_TE, layer.top_k, **layer.route_options())
    _record_counts(layer, plan.counts)
    w_dtype = layer.in_proj.dtype
    x_TD = x_TD.to(w_dtype)
    act = None if layer.gated else "silu"
    h_PH = gather_grouped_mm(x_TD, layer.in_proj, plan.offsets, plan.token_indices, activation=act)
    if layer.gated:
        h_PH = expert_activation(h_PH, gated=True)
    if _grouped_mm_supported(h_PH, layer.out_proj.mT):
        ys_PD = grouped_mm(h_PH, layer.out_proj.mT, plan.offsets, plan.expert_indices)
    else:  # the Triton grouped GEMM, not grouped_mm's E-times-the-FLOPs fallback
        ys_PD = gather_grouped_mm(h_PH, layer.out_proj, plan.offsets)
    return ys_PD, plan


def _mm_kernels(a_MK: torch.Tensor, b_EKN: torch.Tensor, plan) -> torch.Tensor:
    """``moe_kernels.gather_grouped_mm`` (CUTLASS where it runs, else Triton): differentiable,
    weight gradients in the parameters' own layout."""
    from moe_kernels import gather_grouped_mm

    return gather_grouped_mm(a_MK, b_EKN.to(a_MK.dtype).mT, plan.offsets)


def _records_grad(layer: MoELayer, x_TD: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (
        x_TD.requires_grad or any(p.requires_grad for p in layer.parameters())
    )


def _make_triton(out_dtype: torch.dtype) -> Callable:
    def _forward(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
        from moe_kernels import combine

        if _records_grad(layer, x_TD):
            ys_PD, plan = _kernels_experts(layer, x_TD, scores_TE, _mm_kernels)
        else:
            ys_PD, plan = _fused_experts(layer, x_TD, scores_TE)
        return combine(ys_PD, plan, weighted=True, out_dtype=out_dtype).to(x_TD.dtype)

    _forward.__doc__ = (
        "moe-kernels route, gather + first grouped GEMM + SiLU fused, second grouped GEMM, "
        f"combine accumulated in fp32 and returned in {out_dtype} before the cast to x's dtype "
        "(training: route, dispatch, the two grouped GEMMs and the activation unfused)."
    )
    return _forward


def _mm_mxfp8(a_MK: torch.Tensor, b_EKN: torch.Tensor, plan) -> torch.Tensor:
    from moe_kernels.mxfp8 import mxfp8_grouped_mm

    out = mxfp8_grouped_mm(
        a_MK.to(torch.bfloat16),
        b_EKN.to(torch.bfloat16),
        plan.offsets[1:].to(torch.int32),
        out_dtype=torch.bfloat16,
    )
    return out.to(a_MK.dtype)


def _forward_mxfp8(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """moe-kernels route/dispatch/combine, experts through ``mxfp8_grouped_mm``."""
    from moe_kernels.tokens import combine

    ys_PD, plan = _kernels_experts(layer, x_TD, scores_TE, _mm_mxfp8)
    return combine(ys_PD, plan, weighted=True, out_dtype=torch.float32).to(x_TD.dtype)


def _fbgemm_available() -> bool:
    return importlib.util.find_spec("fbgemm_gpu") is not None


def _forward_fbgemm(layer: MoELayer, x_TD: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """fbgemm_gpu's index_shuffling / gather_scale_dense_tokens / scatter_add_dense_tokens.

    fbgemm scales tokens on the gather side; to keep this layer's semantics (weights applied to the
    expert outputs) the gather uses unit scores and the weights scale the outputs before the
    scatter-add. Not exercised in CI (fbgemm_gpu is not installed there).
    """
    check_fbgemm_options(layer)
    if _records_grad(layer, x_TD):
        raise ValueError(
            "impl 'fbgemm' is inference-only (fbgemm's ops have no backward): call the layer "
            "under torch.no_grad(), or train with another impl"
        )
    from fbgemm_gpu.experimental.gen_ai.moe import (
        gather_scale_dense_tokens,
        index_shuffling,
        scatter_add_dense_tokens,
    )

    T, D = x_TD.shape
    counts, e_P, t_P = index_shuffling(scores_TE.to(torch.bfloat16), top_k=layer.top_k)[:3]
    counts_E = counts[: layer.n_experts].to(torch.int32)
    _record_counts(layer, counts_E)
    offsets = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0, dtype=torch.int32)])
    w_dtype = layer.in_proj.dtype
    xs_PD = gather_scale_dense_tokens(
        x_TD.to(w_dtype).contiguous(), t_P, e_P, torch.ones_like(scores_TE, dtype=w_dtype)
    )
    h_PH = grouped_mm(xs_PD, layer.in_proj.mT, offsets, e_P)
    ys_PD = grouped_mm(_activation(h_PH, layer.gated), layer.out_proj.mT, offsets, e_P)
    w_P = scores_TE.float()[t_P.long(), e_P.long()]
    out_TD = torch.zeros(T, D, dtype=w_dtype, device=x_TD.device)
    scatter_add_dense_tokens(out_TD, (ys_PD.float() * w_P[:, None]).to(w_dtype), t_P)
    return out_TD.to(x_TD.dtype)


_IMPLS: dict[str, Callable] = {
    "baseline": _forward_baseline,
    "torch": _forward_torch,
    "triton_bf16": _make_triton(torch.bfloat16),
    "triton_fp32": _make_triton(torch.float32),
    "fbgemm": _forward_fbgemm,
    "mxfp8": _forward_mxfp8,
}


# Where ``moe_kernels.router_scores`` replaces the torch formula (x cast to fp32, fp32 GEMM,
# softmax). H200, D=2048, E=16: 11.2 vs 24.1 us alone at 2048 tokens, 7.0 vs 14.4 us at 512
# (with prefetched D chunks; benchmarks/gpu/router_sweep.py); for E=128 cuBLAS stays faster
# (58 vs 44 us).
KERNEL_ROUTER_IMPLS: tuple[str, ...] = ("triton_bf16", "triton_fp32", "mxfp8")
KERNEL_ROUTER_MAX_E = 32

# Former names, still accepted: "triton_fused" was triton_bf16 with the dispatch fused into the
# first grouped GEMM, which triton_bf16 itself now does.
IMPL_ALIASES: dict[str, str] = {"triton_fused": "triton_bf16"}


def check_impl(impl: str) -> str:
    """Validate an implementation name and return it, an alias (``IMPL_ALIASES``) replaced by its
    implementation (ValueError if unknown, RuntimeError if unavailable)."""
    impl = IMPL_ALIASES.get(impl, impl) if isinstance(impl, str) else impl
    if impl not in MOE_IMPLS:
        raise ValueError(f"impl must be one of {MOE_IMPLS}, got {impl!r}")
    if impl == "fbgemm" and not _fbgemm_available():
        raise RuntimeError("MoE impl 'fbgemm' unavailable: fbgemm_gpu not installed")
    return impl


def check_impl_dims(
    impl: str,
    d_model: int,
    hidden: int,
    *,
    names: tuple[str, str, str] = ("impl", "d_model", "hidden"),
) -> None:
    """ValueError if implementation ``impl`` cannot run a layer of these sizes: ``"mxfp8"`` scales
    blocks of 32 along K, so both GEMMs' K dims (d_model, then hidden) must be multiples of 32.
    ``names``: the caller's names of (impl, d_model, hidden), for the message."""
    if IMPL_ALIASES.get(impl, impl) == "mxfp8" and (d_model % 32 or hidden % 32):
        raise ValueError(
            f"{names[0]}='mxfp8' needs {names[1]} and {names[2]} multiples of 32 (the K dims of "
            f"its two grouped GEMMs), got {names[1]}={d_model}, {names[2]}={hidden}"
        )


class MoELayer(nn.Module):
    """Top-k Mixture-of-Experts MLP: ``x (..., d_model) -> (..., d_model)`` in x's dtype.

    Args:
        d_model, n_experts (E), top_k (k), hidden: model width, routed experts, experts per
            token, expert hidden size.
        gated: SwiGLU experts (``silu(gate) * up``, gate = the first ``hidden`` rows of
            ``in_proj``) instead of SiLU.
        score_fn: ``"softmax"`` over the E router logits, or ``"sigmoid"`` of each.
        renormalize: divide the k weights of a token by their sum.
        expert_bias: a per-expert selection bias, the persistent fp32 buffer ``expert_bias``
            (E,) (zeros; DeepSeek-V3's auxiliary-loss-free balancing, see
            ``update_expert_bias``). It changes which experts are chosen, never the weights.
        n_groups, topk_groups: the E experts form ``n_groups`` contiguous equal groups; each
            token chooses among the experts of its ``topk_groups`` best groups only (a group's
            score: the sum of its two largest biased scores). Default: all groups.
        routed_scaling_factor: multiplies the routed weights (after renormalisation).
        n_shared_experts: an always-on MLP ``shared_experts`` of hidden size ``hidden *
            n_shared_experts`` (SwiGLU when gated) added to every token's output (None when 0).
        aux_loss_coef: > 0 sets ``aux_loss`` after every forward with grad enabled, the Switch
            load-balancing loss (add it to the training loss); otherwise ``aux_loss`` is None.
        impl: the implementation (``MOE_IMPLS``); can be changed on an existing layer.
        device, dtype: factory kwargs of the expert weights (routed and shared); the router
            weight and ``expert_bias`` stay fp32 on ``device``. A DeepSeek-V3-sized layer
            (``from_preset("deepseek-v3")``) is 22 GB in bf16: build it with ``device="cuda",
            dtype=torch.bfloat16``.

    Parameters (no biases): ``router.weight (E, d_model)`` fp32, ``in_proj (E, hidden * (2 if
    gated else 1), d_model)``, ``out_proj (E, d_model, hidden)``, and the shared experts'
    ``shared_experts.in_proj``, ``shared_experts.out_proj``.

    Routing of a token with scores ``s = score_fn(router(x))`` (E,) fp32: its k experts are the
    largest ``s + expert_bias`` (NaN as -inf, ties to the lower expert) within its allowed
    groups, in descending order; the weight of choice j is ``s[e_j]`` (unbiased), divided by the
    sum of the k when ``renormalize``, times ``routed_scaling_factor``. Output:
    ``y = sum_j w_j expert_{e_j}(x) + shared_experts(x)``.

    State after each forward: ``last_counts`` (E,) int32, the pairs routed to each expert (a
    non-persistent buffer updated in place: torch.compile and CUDA graphs keep it current);
    ``aux_loss`` (0-d tensor or None).

    Every impl but ``"fbgemm"`` (inference only: ValueError when autograd records; plain top-k
    only: ValueError for a bias, groups, a scale or renormalisation) backpropagates to x, the
    router and the experts. All but ``"baseline"`` are free of host syncs (torch.compile
    fullgraph, CUDA graphs) and bitwise deterministic, gradients included.
    """

    expert_bias: torch.Tensor | None
    last_counts: torch.Tensor
    aux_loss: torch.Tensor | None

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        *,
        gated: bool = False,
        score_fn: str = "softmax",
        renormalize: bool = False,
        expert_bias: bool = False,
        n_groups: int = 1,
        topk_groups: int | None = None,
        routed_scaling_factor: float = 1.0,
        n_shared_experts: int = 0,
        aux_loss_coef: float = 0.0,
        impl: str = "triton_bf16",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("d_model", d_model), ("n_experts", n_experts), ("hidden", hidden)):
            check_size(name, v)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k!r}")
        if score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
        check_bool("gated", gated)
        check_bool("renormalize", renormalize)
        check_bool("expert_bias", expert_bias)
        opts = check_routing_args(
            n_experts,
            top_k,
            n_groups=n_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
            n_shared_experts=n_shared_experts,
            aux_loss_coef=aux_loss_coef,
        )
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be None or one of {FLOAT_DTYPES}, got {dtype!r}")
        self.d_model, self.n_experts, self.top_k, self.hidden = d_model, n_experts, top_k, hidden
        self.gated, self.score_fn, self.renormalize = gated, score_fn, renormalize
        self.n_groups, self.topk_groups = opts.n_groups, opts.topk_groups
        self.routed_scaling_factor = opts.routed_scaling_factor
        self.n_shared_experts, self.aux_loss_coef = opts.n_shared_experts, opts.aux_loss_coef
        self.aux_loss = None
        f32 = dict(device=device, dtype=torch.float32)
        bias = torch.zeros(n_experts, **f32) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        counts = torch.zeros(n_experts, device=device, dtype=torch.int32)
        self.register_buffer("last_counts", counts, persistent=False)
        self.impl = impl  # checked against the sizes and options before the weights exist
        self.router = nn.Linear(d_model, n_experts, bias=False, **f32)
        h_in = hidden * (2 if gated else 1)
        w = dict(device=device, dtype=dtype)
        self.in_proj = nn.Parameter(torch.empty(n_experts, h_in, d_model, **w))
        self.out_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden, **w))
        self.shared_experts = (
            SharedExperts(d_model, hidden * self.n_shared_experts, gated, **w)
            if self.n_shared_experts
            else None
        )
        self.reset_parameters()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> MoELayer:
        """The layer of ``MOE_PRESETS[name]`` (ValueError listing the names if unknown), any
        keyword argument replaced by ``overrides`` (e.g. ``d_model=64`` for a test, ``impl``,
        ``device``, ``dtype``)."""
        return cls(**preset_kwargs(name, **overrides))

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        impl = check_impl(name)
        check_impl_dims(impl, self.d_model, self.hidden)
        if impl == "fbgemm":
            check_fbgemm_options(self)
        self._impl = impl

    def reset_parameters(self) -> None:
        """Random router and expert weights (normal, std 1/sqrt(fan-in)); the expert bias and
        ``last_counts`` back to zeros."""
        nn.init.normal_(self.router.weight, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.in_proj, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.out_proj, std=1.0 / math.sqrt(self.hidden))
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.last_counts.zero_()

    def route_options(self) -> dict[str, Any]:
        """The layer's selection and weight options as ``moe_kernels.route`` keyword arguments:
        ``bias`` (the ``expert_bias`` buffer or None), ``n_groups``, ``topk_groups``, ``scale``
        (``routed_scaling_factor``), ``renormalize``. Groups that admit every expert are passed
        as none (the same routing; a plain call keeps route's fast lane)."""
        grouped = self.topk_groups < self.n_groups
        return {
            "bias": self.expert_bias,
            "n_groups": self.n_groups if grouped else 1,
            "topk_groups": self.topk_groups if grouped else None,
            "scale": self.routed_scaling_factor,
            "renormalize": self.renormalize,
        }

    def shared_output(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output (T, d_model) in x's dtype for x_TD (T, d_model); None
        without shared experts. Its GEMMs run in the shared weights' dtype (fp32 for the
        ``"baseline"`` impl), the activation in fp32."""
        if self.shared_experts is None:
            return None
        compute = torch.float32 if self._impl == "baseline" else None
        return self.shared_experts(x_TD, compute)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias update from the last forward's ``last_counts``, in place:
        ``expert_bias[e] += rate * sign(mean(last_counts) - last_counts[e])`` (no host sync, no
        gradient). Call it after each training step. ValueError without ``expert_bias``."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs a layer built with expert_bias=True")
        expert_bias_step(self.expert_bias, self.last_counts, check_rate(rate))

    def _check_x(self, x: object) -> None:
        """x (..., d_model): a tensor on the layer's device, in a dtype the implementation takes."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (..., d_model={self.d_model}), got {tuple(x.shape)}"
            )
        check_dtype(x.dtype, self._impl)
        if x.device != self.router.weight.device:
            raise ValueError(f"x is on {x.device}, the layer on {self.router.weight.device}")

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Router scores (..., E) fp32 of x (..., d_model): softmax over all E logits, or sigmoid
        (without the expert bias). The kernel implementations in ``KERNEL_ROUTER_IMPLS`` with
        E <= ``KERNEL_ROUTER_MAX_E`` use ``moe_kernels.router_scores`` (one kernel, the same fp32
        math summed in another order); the others, the torch formula."""
        self._check_x(x)
        scores_TE = self._scores(x.reshape(-1, self.d_model))
        return scores_TE.view(*x.shape[:-1], self.n_experts)

    def _scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self._impl in KERNEL_ROUTER_IMPLS and self.n_experts <= KERNEL_ROUTER_MAX_E:
            from moe_kernels import router_scores

            return router_scores(x_TD, self.router.weight, score_fn=self.score_fn)
        logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        if self.score_fn == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., d_model) in x's dtype: the routed experts plus the shared experts. Updates
        ``last_counts``, and ``aux_loss`` (None without ``aux_loss_coef`` or grad)."""
        self._check_x(x)
        x_TD = x.reshape(-1, self.d_model)
        scores_TE = self._scores(x_TD)
        y_TD = _IMPLS[self._impl](self, x_TD, scores_TE)
        shared_TD = self.shared_output(x_TD)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        if self.aux_loss_coef > 0:  # (no attribute write otherwise: nothing for dynamo to replay)
            self.aux_loss = None
            if torch.is_grad_enabled():
                self.aux_loss = switch_aux_loss(
                    scores_TE, self.last_counts, self.top_k, self.aux_loss_coef
                )
        return y_TD.view(x.shape)

    def extra_repr(self) -> str:
        text = (
            f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, "
            f"hidden={self.hidden}, gated={self.gated}, score_fn={self.score_fn!r}, "
            f"renormalize={self.renormalize}"
        )
        if self.expert_bias is not None:
            text += ", expert_bias=True"
        if self.topk_groups < self.n_groups:
            text += f", n_groups={self.n_groups}, topk_groups={self.topk_groups}"
        for name, default in (
            ("routed_scaling_factor", 1.0),
            ("n_shared_experts", 0),
            ("aux_loss_coef", 0.0),
        ):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)}"
        return text + f", impl={self._impl!r}"
