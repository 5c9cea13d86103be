"""The MoE implementations (``MOE_IMPLS``), one small object each: its facts and three steps.

* ``route(scores_TE, top_k, options)`` -> plan: each token's k experts and weights, the (token,
  expert) pairs sorted by (expert, token) (a ``moe_kernels.RoutingPlan``); ``options``: route's
  keyword arguments (``MoELayer.route_options()``).
* ``experts(rows, in_proj, out_proj, gated, record)`` -> (R, D): the experts on rows grouped by
  expert (``ExpertRows``), the outputs in the same order.
* ``combine(ys_PD, plan, x_TD, weighted=True)`` -> y_TD in x's dtype: each token's k outputs (in
  the plan's pair order; choices with inverse -1 left out) weighted (or not) and summed in choice
  order.

Layers with expert features (biases, another gated activation, the weight on the input:
``moe_model.expert_features``) run their experts as composed steps from two more:
``gather(rows)`` -> (R, D) and ``expert_mm(a_RK, w_ENK, offsets, expert_R)`` -> (R, N), the
grouped GEMM the implementation's experts use.

``MoELayer`` runs route -> experts -> combine with a local exchange between them (the experts
read the tokens through the plan); ``ExpertParallelMoE`` runs the same objects with its all-to-all
exchange between them. A change to an implementation is made here, once.
"""

from __future__ import annotations

import importlib.util

import torch

import moe_kernels as mk
from moe_kernels import RoutingPlan
from moe_model._moe_options import FLOAT_DTYPES
from moe_model.expert_ops import (
    ExpertRows,
    activation,
    gather_rows,
    grouped_mlp,
    grouped_mm,
    move_rows,
)

KERNEL_DTYPES = FLOAT_DTYPES[:3]  # float16, bfloat16, float32: what the moe_kernels ops read


class MoEImpl:
    """An implementation: its facts (class attributes) and its three steps.

    x_dtypes: the activation dtypes it takes. k_multiple: d_model and hidden (the K dims of its
    two grouped GEMMs) must be multiples of it. kernel_router: it scores with
    ``moe_kernels.router_scores`` (which picks its variant by E and x's dtype). refuses_options /
    refuses_autograd / refuses_expert_parallel: None, or why it cannot route with a bias, groups,
    a scale or renormalisation / backpropagate / run under ``ExpertParallelMoE`` / run experts
    with features (``moe_model.expert_features``). shared_dtype:
    the shared experts' GEMM dtype (None: their weights'). needs_module: a package it imports
    (``available``: whether that is installed). fp8_experts: without autograd its experts step
    reads the layer's quantised experts (``MoELayer.fp8_experts()``, two
    ``moe_kernels.Fp8Weights``) in place of ``in_proj`` / ``out_proj``.
    """

    name: str
    x_dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES
    k_multiple = 1
    kernel_router = False
    refuses_options: str | None = None
    refuses_autograd: str | None = None
    refuses_expert_parallel: str | None = None
    refuses_features: str | None = None
    shared_dtype: torch.dtype | None = None
    needs_module: str | None = None
    fp8_experts = False

    @property
    def available(self) -> bool:
        return self.needs_module is None or importlib.util.find_spec(self.needs_module) is not None

    def check_dims(self, d_model: int, hidden: int, names=("impl", "d_model", "hidden")) -> None:
        """ValueError unless d_model and hidden are multiples of ``k_multiple``; ``names``: the
        caller's names of (impl, d_model, hidden), for the message."""
        m = self.k_multiple
        if d_model % m or hidden % m:
            raise ValueError(
                f"{names[0]}={self.name!r} needs {names[1]} and {names[2]} multiples of {m} (the "
                f"K dims of its two grouped GEMMs), got {names[1]}={d_model}, {names[2]}={hidden}"
            )

    def check(self, options: dict, record: bool = False) -> None:
        """ValueError if it refuses the routing ``options`` (route's keyword arguments) or, with
        ``record``, autograd."""
        if self.refuses_options:
            bad = []
            if options["bias"] is not None:
                bad.append("expert_bias=True")
            if options["topk_groups"] is not None:
                bad.append(
                    f"topk_groups={options['topk_groups']} of n_groups={options['n_groups']}"
                )
            if options["scale"] != 1.0:
                bad.append(f"routed_scaling_factor={options['scale']}")
            if options["renormalize"]:
                bad.append("renormalize=True")
            if bad:
                raise ValueError(
                    f"impl {self.name!r} cannot route with {', '.join(bad)} "
                    f"({self.refuses_options}); use another impl"
                )
        if record and self.refuses_autograd:
            raise ValueError(
                f"impl {self.name!r} is inference-only ({self.refuses_autograd}): call the layer "
                "under torch.no_grad(), or train with another impl"
            )

    def rows_dtype(self, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
        """The dtype the tokens travel to the experts in: the expert weights'."""
        return w_dtype

    def route(self, scores_TE: torch.Tensor, top_k: int, options: dict) -> RoutingPlan:
        raise NotImplementedError

    def experts(
        self,
        rows: ExpertRows,
        in_proj: torch.Tensor,
        out_proj: torch.Tensor,
        gated: bool,
        record: bool,
    ) -> torch.Tensor:
        raise NotImplementedError

    def combine(
        self, ys_PD: torch.Tensor, plan: RoutingPlan, x_TD: torch.Tensor, weighted: bool = True
    ) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, rows: ExpertRows) -> torch.Tensor:
        """The experts' input rows (R, D), differentiable in ``rows.source``."""
        raise NotImplementedError

    def expert_mm(
        self, a_RK: torch.Tensor, w_ENK: torch.Tensor, offsets: torch.Tensor, expert_R: torch.Tensor
    ) -> torch.Tensor:
        """(R, N): each row of ``a_RK`` (grouped by expert) times its expert's ``w_ENK[e].T``."""
        raise NotImplementedError

    def experts_combine(
        self,
        rows: ExpertRows,
        plan: RoutingPlan,
        in_proj: torch.Tensor,
        out_proj: torch.Tensor,
        gated: bool,
        x_TD: torch.Tensor,
        record: bool,
    ) -> torch.Tensor:
        """``combine(experts(rows, ...), plan, x_TD)`` where nothing travels between them (the
        local exchange); an implementation may fuse the two."""
        return self.combine(self.experts(rows, in_proj, out_proj, gated, record), plan, x_TD)

    def __repr__(self) -> str:
        return f"<MoE impl {self.name!r}>"


class TorchImpl(MoEImpl):
    """Torch routing (``moe_kernels.topk_choices``, sorted into the plan by
    ``moe_kernels.plan_from_choices``), a gather,
    grouped GEMMs (``torch._grouped_mm`` where it runs, else a static loop), the fp32 weighted
    sum over the k choices. Sync-free, deterministic, differentiable."""

    name = "torch"
    x_dtypes = FLOAT_DTYPES

    def route(self, scores_TE: torch.Tensor, top_k: int, options: dict) -> RoutingPlan:
        w_Tk, e_Tk = mk.topk_choices(scores_TE, top_k, **options)
        return mk.plan_from_choices(e_Tk, w_Tk, scores_TE.shape[1])

    def experts(self, rows, in_proj, out_proj, gated, record):
        xs_RD = gather_rows(rows.source, rows.source_indices, rows.inverse)
        return grouped_mlp(xs_RD, in_proj, out_proj, gated, rows.offsets, rows.expert_indices)

    def gather(self, rows):
        return gather_rows(rows.source, rows.source_indices, rows.inverse)

    def expert_mm(self, a_RK, w_ENK, offsets, expert_R):
        return grouped_mm(a_RK, w_ENK.mT, offsets, expert_R)

    def combine(self, ys_PD, plan, x_TD, weighted=True):
        T, k = plan.inverse.shape
        inv_P = plan.inverse.reshape(-1)
        ok_P = inv_P >= 0
        safe_P = torch.where(ok_P, inv_P, 0)
        y_TkD = torch.where(ok_P[:, None], ys_PD[safe_P], 0).view(T, k, ys_PD.shape[1]).float()
        if not weighted:
            return y_TkD.sum(dim=1).to(x_TD.dtype)
        w_Tk = torch.where(ok_P, plan.weights[safe_P], 0).view(T, k)
        return (y_TkD * w_Tk.unsqueeze(-1)).sum(dim=1).to(x_TD.dtype)


class BaselineImpl(TorchImpl):
    """The reference: the torch routing and combine; the experts as fp32 GEMMs over each
    expert's block of rows, whose bounds are read on the host (a sync), fp32 outputs. Slow, and
    not compileable (its loop branches on the bounds)."""

    name = "baseline"
    shared_dtype = torch.float32

    def rows_dtype(self, x_dtype, w_dtype):
        return x_dtype  # (the experts compute in fp32)

    def experts(self, rows, in_proj, out_proj, gated, record):
        xs_RD = gather_rows(rows.source, rows.source_indices, rows.inverse).float()
        bounds = rows.host_offsets
        if bounds is None:
            bounds = rows.offsets.tolist()  # the host sync
        out = []
        for e in range(in_proj.shape[0]):
            if bounds[e] == bounds[e + 1]:  # no rows
                continue
            h = xs_RD[bounds[e] : bounds[e + 1]] @ in_proj[e].float().t()
            out.append(activation(h, gated) @ out_proj[e].float().t())
        out.append(xs_RD.new_zeros(xs_RD.shape[0] - bounds[-1], out_proj.shape[1]))  # no expert
        return torch.cat(out)

    def expert_mm(self, a_RK, w_ENK, offsets, expert_R):
        bounds = offsets.tolist()  # the host sync
        out = [a_RK.float()[bounds[e] : bounds[e + 1]] @ w_ENK[e].float().t()
               for e in range(w_ENK.shape[0])]  # fmt: skip
        out.append(a_RK.new_zeros(a_RK.shape[0] - bounds[-1], w_ENK.shape[1], dtype=torch.float32))
        return torch.cat(out)


class TritonImpl(MoEImpl):
    """moe-kernels ``route``; the experts as ``moe_kernels.expert_mlp`` (with autograd one node:
    the row gather, grouped GEMMs on sorted rows (persistent Triton or CUTLASS), its own
    deterministic backward; without, up to 1024 first-GEMM columns the Triton GEMM that gathers
    in its loads with SiLU in its epilogue); ``combine`` accumulated in fp32, returned in
    ``out_dtype``, then cast to x's dtype."""

    kernel_router = True

    def __init__(self, name: str, out_dtype: torch.dtype) -> None:
        self.name, self.out_dtype = name, out_dtype

    def route(self, scores_TE, top_k, options):
        return mk.route(scores_TE, top_k, **options)

    def experts(self, rows, in_proj, out_proj, gated, record):
        dtype = rows.source.dtype
        return mk.expert_mlp(
            rows.source,
            in_proj.to(dtype),
            out_proj.to(dtype),
            rows.offsets,
            rows.source_indices,
            rows.inverse,
            gated=gated,
        )

    def experts_combine(self, rows, plan, in_proj, out_proj, gated, x_TD, record):
        """``moe_kernels.routed_experts``: the experts and the weighted combine as one autograd
        node whose backward keeps no expert outputs (the router weights' gradient from the
        activation's backward pass)."""
        dtype = rows.source.dtype
        y_TD = mk.routed_experts(rows.source, in_proj.to(dtype), out_proj.to(dtype), plan,
                                 gated=gated, out_dtype=self.out_dtype)  # fmt: skip
        return y_TD.to(x_TD.dtype)

    def unfused(self, rows, in_proj, out_proj, gated):
        xs_RD = self.gather(rows)
        h_RH = self.expert_mm(xs_RD, in_proj, rows.offsets)
        return self.expert_mm(mk.expert_activation(h_RH, gated), out_proj, rows.offsets)

    def gather(self, rows):
        return move_rows(rows.source, rows.source_indices, rows.inverse)

    def expert_mm(self, a_RK, w_ENK, offsets, expert_R=None):
        """``moe_kernels.gather_grouped_mm`` (its sorted-row kernels: persistent Triton or CUTLASS):
        differentiable, weight gradients in the parameters' own layout."""
        return mk.gather_grouped_mm(a_RK, w_ENK.to(a_RK.dtype), offsets)

    def combine(self, ys_PD, plan, x_TD, weighted=True):
        y_TD = mk.combine(ys_PD, plan, weighted=weighted, out_dtype=self.out_dtype)
        return y_TD.to(x_TD.dtype)


class Mxfp8Impl(TritonImpl):
    """The kernel chain with ``mxfp8_grouped_mm`` GEMMs (unfused, with or without autograd);
    ``combine`` in fp32."""

    experts_combine = MoEImpl.experts_combine

    k_multiple = 32  # MXFP8 scales blocks of 32 along K

    def __init__(self) -> None:
        super().__init__("mxfp8", torch.float32)

    def experts(self, rows, in_proj, out_proj, gated, record):
        return self.unfused(rows, in_proj, out_proj, gated)

    def expert_mm(self, a_RK, w_ENK, offsets, expert_R=None):
        out = mk.mxfp8_grouped_mm(
            a_RK.to(torch.bfloat16),
            w_ENK.mT.to(torch.bfloat16),
            offsets[1:].to(torch.int32),
            out_dtype=torch.bfloat16,
        )
        return out.to(a_RK.dtype)


class Fp8Impl(TritonImpl):
    """FP8 (e4m3) experts, FBGEMM's chain. Inference (no autograd): moe-kernels ``route``; the
    routed rows gathered and quantised per row in one pass (``gather_scale_quant_dense_tokens``,
    unit scores); ``fp8_grouped_mm`` against the layer's quantised ``in_proj`` (bf16 out); SiLU
    (times up when gated) quantised per row in one pass (``silu_mul_quant``); ``fp8_grouped_mm``
    against the quantised ``out_proj`` (bf16 out); the weighted ``combine`` in fp32. Training
    (autograd): ``moe_kernels.routed_experts(fp8=True)``, the same chain with the weights (the
    bf16 or fp32 masters) quantised on the fly and FP8 data-gradient GEMMs, one autograd node."""

    refuses_expert_parallel = "its quantised experts stay with the layer"
    refuses_features = "it runs plain SiLU(-gated) experts only"
    fp8_experts = True

    def __init__(self) -> None:
        super().__init__("fp8", torch.float32)

    def rows_dtype(self, x_dtype, w_dtype):
        return x_dtype  # (the gather quantises the tokens as they are)

    def experts(self, rows, in_proj, out_proj, gated, record):
        x_TD, E = rows.source, in_proj.weight.shape[0]
        ones_TE = x_TD.new_ones((1, 1), dtype=torch.float32).expand(x_TD.shape[0], E)
        x8 = mk.gather_scale_quant_dense_tokens(
            x_TD, rows.source_indices, rows.expert_indices, ones_TE
        )  # (rows of no expert, -1: data and scale 0)
        bf16 = torch.bfloat16
        h_PH = mk.fp8_grouped_mm(x8.data, x8.scale, *in_proj, rows.offsets, out_dtype=bf16)
        H = out_proj.weight.shape[2]
        up_PH = h_PH[:, H:] if gated else h_PH.new_ones((1, 1)).expand(h_PH.shape[0], H)
        a8 = mk.silu_mul_quant(h_PH[:, :H], up_PH)
        return mk.fp8_grouped_mm(a8.data, a8.scale, *out_proj, rows.offsets, out_dtype=bf16)

    def experts_combine(self, rows, plan, in_proj, out_proj, gated, x_TD, record):
        if not record:  # the quantised copies (Fp8Weights)
            return MoEImpl.experts_combine(self, rows, plan, in_proj, out_proj, gated, x_TD, record)
        dtype = rows.source.dtype
        y_TD = mk.routed_experts(rows.source, in_proj.to(dtype), out_proj.to(dtype), plan,
                                 gated=gated, out_dtype=self.out_dtype, fp8=True)  # fmt: skip
        return y_TD.to(x_TD.dtype)


class FbgemmImpl(MoEImpl):
    """fbgemm_gpu's ``index_shuffling`` / ``gather_scale_dense_tokens`` /
    ``scatter_add_dense_tokens`` around torch grouped GEMMs. fbgemm scales tokens on the gather
    side; to keep this layer's semantics (weights applied to the expert outputs) the gather uses
    unit scores and the weights scale the outputs before the scatter-add. Not exercised in CI
    (fbgemm_gpu is not installed there)."""

    name = "fbgemm"
    needs_module = "fbgemm_gpu"
    refuses_options = "fbgemm's index_shuffling does plain top-k only"
    refuses_autograd = "fbgemm's ops have no backward"
    refuses_expert_parallel = (
        "its plan has no per-choice inverse for the exchange, and it is inference-only"
    )
    refuses_features = "it runs plain SiLU(-gated) experts only"

    def route(self, scores_TE, top_k, options):
        from fbgemm_gpu.experimental.gen_ai.moe import index_shuffling

        E = scores_TE.shape[1]
        counts, e_P, t_P = index_shuffling(scores_TE.to(torch.bfloat16), top_k=top_k)[:3]
        counts_E = counts[:E].to(torch.int32)
        offsets = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0, dtype=torch.int32)])
        w_P = scores_TE.float()[t_P.long(), e_P.long()]
        return RoutingPlan(counts_E, offsets, e_P, t_P, w_P, inverse=None)

    def experts(self, rows, in_proj, out_proj, gated, record):
        from fbgemm_gpu.experimental.gen_ai.moe import gather_scale_dense_tokens

        x_ND = rows.source
        unit_NE = torch.ones(x_ND.shape[0], in_proj.shape[0], dtype=x_ND.dtype, device=x_ND.device)
        xs_RD = gather_scale_dense_tokens(
            x_ND.contiguous(), rows.source_indices, rows.expert_indices, unit_NE
        )
        return grouped_mlp(xs_RD, in_proj, out_proj, gated, rows.offsets, rows.expert_indices)

    def combine(self, ys_PD, plan, x_TD, weighted=True):
        from fbgemm_gpu.experimental.gen_ai.moe import scatter_add_dense_tokens

        out_TD = ys_PD.new_zeros(x_TD.shape[0], ys_PD.shape[1])
        scaled_PD = (ys_PD.float() * plan.weights[:, None]).to(ys_PD.dtype)
        scatter_add_dense_tokens(out_TD, scaled_PD, plan.token_indices)
        return out_TD.to(x_TD.dtype)


IMPLS: dict[str, MoEImpl] = {
    impl.name: impl
    for impl in (
        BaselineImpl(),
        TorchImpl(),
        TritonImpl("triton_bf16", torch.bfloat16),
        TritonImpl("triton_fp32", torch.float32),
        FbgemmImpl(),
        Mxfp8Impl(),
        Fp8Impl(),
    )
}
MOE_IMPLS: tuple[str, ...] = tuple(IMPLS)

# Former names, still accepted: "triton_fused" was triton_bf16 with the dispatch fused into the
# first grouped GEMM, which triton_bf16 itself now does.
IMPL_ALIASES: dict[str, str] = {"triton_fused": "triton_bf16"}


def check_impl(impl: object) -> str:
    """Validate an implementation name and return it, an alias (``IMPL_ALIASES``) replaced by its
    implementation (ValueError if unknown, RuntimeError if unavailable)."""
    impl = IMPL_ALIASES.get(impl, impl) if isinstance(impl, str) else impl
    if impl not in MOE_IMPLS:
        raise ValueError(f"impl must be one of {MOE_IMPLS}, got {impl!r}")
    if not IMPLS[impl].available:
        raise RuntimeError(
            f"MoE impl {impl!r} unavailable: {IMPLS[impl].needs_module} not installed"
        )
    return impl


def check_impl_dims(
    impl: str,
    d_model: int,
    hidden: int,
    *,
    names: tuple[str, str, str] = ("impl", "d_model", "hidden"),
) -> None:
    """ValueError if implementation ``impl`` (a name or alias in ``MOE_IMPLS``) cannot run a
    layer of these sizes (``MoEImpl.check_dims``)."""
    IMPLS[IMPL_ALIASES.get(impl, impl)].check_dims(d_model, hidden, names)


def check_dtype(dtype: object, impl: str | None, *, name: str = "x.dtype") -> None:
    """TypeError unless ``dtype`` is an activation dtype ``impl`` takes (its ``x_dtypes``; every
    float dtype for ``impl=None``, no MoE layer)."""
    ok = FLOAT_DTYPES if impl is None else IMPLS[impl].x_dtypes
    if dtype not in ok:
        for_impl = f" for impl {impl!r}" if impl else ""
        raise TypeError(f"{name} must be one of {ok}{for_impl}, got {dtype!r}")
