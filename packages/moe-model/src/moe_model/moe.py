"""``MoELayer``: a router and E SiLU (or SwiGLU) experts; the implementation (``impl``) is one
of the objects of ``moe_model.impls``.

One forward (``MoELayer.run``), the same for every implementation:
``scores = router(x)`` -> ``plan = impl.route(scores)`` -> ``exchange.to_experts`` (here the
local exchange: the experts read the tokens through the plan) -> ``impl.experts(rows)`` ->
``exchange.from_experts`` -> ``y = impl.combine(outputs, plan)``, plus the shared experts. With
the local exchange nothing travels between the experts and the combine, so the two run as
``impl.experts_combine`` (one autograd node for the kernel implementations).
``ExpertParallelMoE`` runs the same walk with its all-to-all exchange and this rank's experts.

Routing options (expert bias, expert groups, weight scale, renormalisation) reach every
implementation as ``MoELayer.route_options()`` (``moe_kernels.route``'s keyword arguments; the
torch implementations compute them by ``moe_kernels.topk_choices``, route's own formula); the
router's own options (``router_bias``, ``router_dtype``) are in the scores, computed by the layer
before any implementation runs. Every implementation records its per-expert counts in
``layer.last_counts``; the shared experts (and their gate) and the auxiliary loss are added by
the walk.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_kernels import Fp8Weights, RoutingPlan
from moe_model._checks import check_device
from moe_model._moe_options import (
    FLOAT_DTYPES,
    check_bool,
    check_rate,
    check_routing_args,
    check_size,
    expert_bias_step,
    switch_aux_loss,
)
from moe_model.expert_features import (
    ExpertFeatures,
    SwiGLU,
    check_swiglu,
    composed_experts_combine,
)
from moe_model.expert_ops import ExpertRows
from moe_model.fp8_experts import QuantisedExperts, requantise_after_load
from moe_model.impls import (
    IMPLS,
    check_dtype,
    check_impl,
    check_impl_dims,
)
from moe_model.presets import preset_kwargs
from moe_model.shared_experts import SharedExperts

SCORE_FNS = ("softmax", "sigmoid")
ROUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_DTYPE = "dtype (None: torch's default)"


class LocalSent(NamedTuple):
    """What the local exchange hands the experts (``rows``), the counts the layer records
    (``counts``, (E,) int32) and what it needs to bring the outputs back (``plan``)."""

    rows: ExpertRows
    counts: torch.Tensor
    plan: RoutingPlan


class LocalExchange:
    """MoELayer's exchange: every expert is local, so the experts read the tokens through the
    plan (the gather runs inside the experts step, fused into the first GEMM where the impl
    can) and their outputs come out in the plan's pair order; being ``local``, the layer lets
    the implementation run the experts and the combine as one step (``experts_combine``)."""

    local = True

    def to_experts(self, x_TD: torch.Tensor, plan: RoutingPlan, record: bool) -> LocalSent:
        rows = ExpertRows(
            x_TD, plan.token_indices, plan.inverse, plan.offsets, plan.expert_indices, None
        )
        return LocalSent(rows, plan.counts, plan)

    def from_experts(
        self, ys_PD: torch.Tensor, sent: LocalSent, record: bool
    ) -> tuple[torch.Tensor, RoutingPlan]:
        return ys_PD, sent.plan


LOCAL_EXCHANGE = LocalExchange()


class MoELayer(nn.Module):
    """Top-k Mixture-of-Experts MLP: ``x (..., d_model) -> (..., d_model)`` in x's dtype, with
    the implementation's precision: the default ``"triton_bf16"`` rounds the fp32 combine to bf16
    before that cast (fp32 x gets bf16-precision values; ``"triton_fp32"``, ``"torch"`` keep fp32;
    docs/moe_layer.md).

    Args:
        d_model, n_experts (E), top_k (k), hidden: model width, routed experts, experts per
            token, expert hidden size.
        gated: SwiGLU experts (``silu(gate) * up``, gate = the first ``hidden`` rows of
            ``in_proj``) instead of SiLU.
        swiglu: None, or a ``moe_model.SwiGLU`` for another gated activation (GPT-OSS's
            ``alpha``, ``limit``, ``up + 1`` on interleaved gate/up rows); needs ``gated``.
        expert_biases: learned per-expert biases ``in_bias (E, hidden * (2 if gated else 1))``
            added to the first GEMM's output and ``out_bias (E, d_model)`` to the expert's
            output (zeros when built; GPT-OSS).
        weight_on_input: the routing weight scales the expert's input, ``sum_j
            expert_{e_j}(w_j x)`` (Llama4), instead of its output.
        score_fn: ``"softmax"`` over the E router logits, or ``"sigmoid"`` of each.
        router_bias: a learned fp32 bias ``router.bias`` (E,) added to the router logits
            (zeros when built; GPT-OSS's router). Unlike ``expert_bias`` it changes the scores,
            so both the choices and the weights.
        router_dtype: None: fp32 logits of x and the fp32 router weight. Else the dtype the
            router GEMM runs in (float32, bfloat16 or float16; TypeError otherwise): ``logits =
            F.linear(x.to(router_dtype), weight.to(router_dtype), bias.to(router_dtype))``, the
            score function then in fp32 of those logits (Hugging Face's ``softmax(logits,
            dtype=float)`` on a router of the model's dtype: pass the model's dtype to route
            exactly as it does). float32 is None's math by the torch formula in every impl
            (None lets the kernel impls use ``moe_kernels.router_scores``).
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
        shared_hidden: None, or the shared MLP's hidden size itself (Qwen2-MoE's
            ``shared_expert_intermediate_size``): one shared MLP of that size, whatever
            ``hidden``. ``n_shared_experts`` must then be 0 or 1 (ValueError for more: whether
            the size would be per expert or in all is ambiguous).
        shared_gate: scale the shared MLP's output by ``sigmoid(x @ shared_expert_gate.weight.T)``
            (one scalar per token; Qwen2-MoE, Qwen3-Next). ValueError without a shared MLP.
        aux_loss_coef: > 0 sets ``aux_loss`` after every forward with grad enabled, the Switch
            load-balancing loss (add it to the training loss); otherwise ``aux_loss`` is None.
        impl: the implementation (``MOE_IMPLS``); can be changed on an existing layer (TypeError
            if it does not take the expert weights' dtype). ``"fp8"`` runs FP8 copies of the
            experts without autograd, made when the layer is built or switched to it
            (``quantize_experts``), or loaded (``load_fp8_experts``); with autograd it trains
            the weights as they are (quantised on the fly; FP8 forward and data-gradient GEMMs,
            ``moe_kernels.routed_experts(fp8=True)``).
        device, dtype: factory kwargs of the expert weights (routed and shared, the shared
            gate included); the router (weight and bias) and ``expert_bias`` stay fp32 on
            ``device``. Checked when built, naming the argument: ``device`` None (torch's
            default) or one torch parses and this process can allocate on, ``meta`` included
            (ValueError otherwise: no CUDA, an index past the last GPU, an unknown type);
            ``dtype`` (None: torch's default dtype) one of the impl's ``x_dtypes`` (TypeError
            otherwise): float16, bfloat16, float32 for the kernel impls (``triton_bf16``,
            ``triton_fp32``, ``mxfp8``, ``fbgemm``), float64 too for ``torch`` and
            ``baseline``. A DeepSeek-V3-sized layer
            (``from_preset("deepseek-v3")``) is 22 GB in bf16: build it with ``device="cuda",
            dtype=torch.bfloat16``.

    Parameters: ``router.weight (E, d_model)`` fp32 (and ``router.bias (E,)`` fp32 with
    ``router_bias``), ``in_proj (E, hidden * (2 if gated else 1), d_model)``, ``out_proj (E,
    d_model, hidden)``, the shared experts' ``shared_experts.in_proj``,
    ``shared_experts.out_proj``, with ``shared_gate`` ``shared_expert_gate.weight (1,
    d_model)``, with ``expert_biases`` ``in_bias`` and ``out_bias``. No other biases.

    Routing of a token with scores ``s = score_fn(router(x))`` (E,) fp32: its k experts are the
    largest ``s + expert_bias`` (NaN as -inf, ties to the lower expert) within its allowed
    groups, in descending order; the weight of choice j is ``s[e_j]`` (unbiased), divided by the
    sum of the k when ``renormalize``, times ``routed_scaling_factor``. Output:
    ``y = sum_j w_j expert_{e_j}(x) + g(x) * shared_experts(x)`` (``sum_j expert_{e_j}(w_j x)``
    with ``weight_on_input``), ``g(x) = sigmoid(x @ shared_expert_gate.weight.T)`` with
    ``shared_gate``, else 1. Layers with ``swiglu``, ``expert_biases`` or ``weight_on_input``
    run their experts as composed steps (``moe_model.expert_features``) on the impl's gather
    and grouped GEMM, not its fused node.

    State after each forward: ``last_counts`` (E,) int32, the pairs routed to each expert (a
    non-persistent buffer updated in place: torch.compile and CUDA graphs keep it current);
    ``aux_loss`` (0-d tensor or None).

    Every impl but ``"fbgemm"`` (inference only: ValueError when autograd records; plain top-k
    only: ValueError for a bias, groups, a scale or renormalisation) backpropagates to x, the
    router and the experts. All but ``"baseline"`` are free of host syncs (torch.compile
    fullgraph, CUDA graphs) and bitwise deterministic, gradients included.

    FP8 experts (``fp8``, a ``moe_model.fp8_experts.QuantisedExperts`` or None): derived from
    ``in_proj`` / ``out_proj``, not in the state dict, re-made after ``load_state_dict``; a
    forward of the ``"fp8"`` impl without autograd after the weights changed otherwise (an
    optimizer step) raises RuntimeError until ``quantize_experts()`` runs again.

    Ownership: an ``ExpertParallelMoE`` built on this layer takes its experts
    (``experts_owner`` then names it): the layer keeps the router, bias and shared experts for
    its owner, and calling it alone raises RuntimeError.
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
        swiglu: SwiGLU | None = None,
        expert_biases: bool = False,
        weight_on_input: bool = False,
        score_fn: str = "softmax",
        router_bias: bool = False,
        router_dtype: torch.dtype | None = None,
        renormalize: bool = False,
        expert_bias: bool = False,
        n_groups: int = 1,
        topk_groups: int | None = None,
        routed_scaling_factor: float = 1.0,
        n_shared_experts: int = 0,
        shared_hidden: int | None = None,
        shared_gate: bool = False,
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
        check_bool("expert_biases", expert_biases)
        check_bool("weight_on_input", weight_on_input)
        swiglu = check_swiglu(swiglu, gated)
        check_bool("renormalize", renormalize)
        check_bool("expert_bias", expert_bias)
        check_bool("router_bias", router_bias)
        if router_dtype is not None and router_dtype not in ROUTER_DTYPES:
            raise TypeError(
                f"router_dtype must be None or one of {ROUTER_DTYPES}, got {router_dtype!r}"
            )
        check_bool("shared_gate", shared_gate)
        opts = check_routing_args(
            n_experts,
            top_k,
            n_groups=n_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
            n_shared_experts=n_shared_experts,
            aux_loss_coef=aux_loss_coef,
        )
        if shared_hidden is not None:
            check_size("shared_hidden", shared_hidden)
            if opts.n_shared_experts > 1:
                raise ValueError(
                    f"shared_hidden={shared_hidden} is the one shared MLP's hidden size: "
                    f"n_shared_experts must be 0 or 1 with it, got {opts.n_shared_experts} "
                    "(for n shared experts of the routed hidden size leave shared_hidden None)"
                )
        shared_size = shared_hidden if shared_hidden is not None else hidden * opts.n_shared_experts
        if shared_gate and not shared_size:
            raise ValueError(
                "shared_gate=True needs a shared MLP to gate (n_shared_experts > 0 or "
                "shared_hidden)"
            )
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be None or one of {FLOAT_DTYPES}, got {dtype!r}")
        device = check_device(device)
        self.d_model, self.n_experts, self.top_k, self.hidden = d_model, n_experts, top_k, hidden
        self.gated, self.score_fn, self.renormalize = gated, score_fn, renormalize
        self.swiglu, self.expert_biases = swiglu, expert_biases
        self.weight_on_input = weight_on_input
        self.router_dtype = router_dtype
        self.shared_hidden, self.shared_gate = shared_hidden, shared_gate
        self.n_groups, self.topk_groups = opts.n_groups, opts.topk_groups
        self.routed_scaling_factor = opts.routed_scaling_factor
        self.n_shared_experts, self.aux_loss_coef = opts.n_shared_experts, opts.aux_loss_coef
        self.aux_loss = None
        self.experts_owner: str | None = None
        self.fp8: QuantisedExperts | None = None
        f32 = dict(device=device, dtype=torch.float32)
        bias = torch.zeros(n_experts, **f32) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        counts = torch.zeros(n_experts, device=device, dtype=torch.int32)
        self.register_buffer("last_counts", counts, persistent=False)
        self.impl = impl  # checked against the sizes and options before the weights exist
        w_dtype = torch.get_default_dtype() if dtype is None else dtype
        check_dtype(w_dtype, self._impl, name="dtype" if dtype is not None else _DEFAULT_DTYPE)
        self.router = nn.Linear(d_model, n_experts, bias=router_bias, **f32)
        h_in = hidden * (2 if gated else 1)
        w = dict(device=device, dtype=dtype)
        self.in_proj = nn.Parameter(torch.empty(n_experts, h_in, d_model, **w))
        self.out_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden, **w))
        biases = ((n_experts, h_in), (n_experts, d_model)) if expert_biases else (None, None)
        self.in_bias, self.out_bias = (
            None if shape is None else nn.Parameter(torch.empty(shape, **w)) for shape in biases
        )
        self.shared_experts = (
            SharedExperts(d_model, shared_size, gated, **w) if shared_size else None
        )
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False, **w) if shared_gate else None
        self.reset_parameters()
        if IMPLS[self._impl].fp8_experts and self.in_proj.device.type != "meta":
            self.quantize_experts()
        self.register_load_state_dict_post_hook(requantise_after_load)

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
        IMPLS[impl].check(self.route_options())
        if self.has_features and IMPLS[impl].refuses_features:
            raise ValueError(
                f"impl {impl!r} cannot run experts with biases, another activation or the "
                f"weight on the input ({IMPLS[impl].refuses_features}); use another impl"
            )
        w = self._parameters.get("in_proj")  # (none while building, or once given away)
        if w is not None:
            check_dtype(w.dtype, impl, name="the expert weights' dtype")
        self._impl = impl
        fp8 = getattr(self, "fp8", None)  # (made again unless current: loaded ones are kept)
        stale = fp8 is None or (w is not None and not fp8.current(w, self.out_proj))
        if IMPLS[impl].fp8_experts and w is not None and stale:
            self.quantize_experts()

    def reset_parameters(self) -> None:
        """Random router, expert and shared-gate weights (normal, std 1/sqrt(fan-in)); the
        router bias, the expert biases, the expert bias and ``last_counts`` back to zeros. The
        experts only while this layer holds them."""
        nn.init.normal_(self.router.weight, std=1.0 / math.sqrt(self.d_model))
        if self.router.bias is not None:
            nn.init.zeros_(self.router.bias)
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=1.0 / math.sqrt(self.d_model))
        if self.experts_owner is None:
            nn.init.normal_(self.in_proj, std=1.0 / math.sqrt(self.d_model))
            nn.init.normal_(self.out_proj, std=1.0 / math.sqrt(self.hidden))
            for b in (self.in_bias, self.out_bias):
                if b is not None:
                    nn.init.zeros_(b)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.last_counts.zero_()

    def give_experts(self, owner: str) -> tuple[nn.Parameter, nn.Parameter]:
        """Hand ``in_proj`` and ``out_proj`` to ``owner`` (the name of the module that holds them
        from now on): returns them and drops them here, so the layer keeps only the router, the
        bias and the shared experts (their gate too), for its owner's walk (``run``).
        Afterwards calling the layer raises RuntimeError and giving its experts again
        ValueError."""
        if self.experts_owner is not None:
            raise ValueError(
                f"this MoELayer's experts already belong to an {self.experts_owner} (a layer "
                "is wrapped once)"
            )
        experts = self.in_proj, self.out_proj
        del self.in_proj, self.out_proj
        self.experts_owner = owner
        return experts

    def quantize_experts(self, *, block: bool | None = None) -> None:
        """Make the FP8 experts ``fp8`` from ``in_proj`` / ``out_proj`` as they are now
        (``moe_kernels.quantize_fp8_weights``: scales per output channel, or with ``block`` per
        128 x 128 block; None: as the previous copies, else per channel). Call it after changing
        the weights in place; the ``"fp8"`` impl reads these copies."""
        block = (self.fp8 is not None and self.fp8.block) if block is None else block
        self.fp8 = QuantisedExperts.quantise(*self._own_experts("quantize_experts"), block)

    def load_fp8_experts(self, in_proj: Fp8Weights, out_proj: Fp8Weights) -> None:
        """Take a checkpoint's FP8 experts (``moe_kernels.Fp8Weights``: float8_e4m3fn weights
        ``(E, hidden * (2 if gated else 1), d_model)`` and ``(E, d_model, hidden)`` in
        ``nn.Linear``'s layout, fp32 scales per output channel or per 128 x 128 block, as
        DeepSeek-V3 ships them) as ``fp8``, and set ``in_proj`` / ``out_proj`` to their
        dequantised values (so every impl computes the same experts). TypeError / ValueError
        naming the argument (shapes, dtypes, a scale that is not finite and positive)."""
        weights = self._own_experts("load_fp8_experts")
        self.fp8 = QuantisedExperts.load(*weights, in_proj, out_proj)

    def fp8_experts(self) -> tuple[Fp8Weights, Fp8Weights]:
        """The FP8 experts (in_proj, out_proj) the ``"fp8"`` impl runs: RuntimeError if there
        are none or the weights changed since they were made."""
        if self.fp8 is None:
            raise RuntimeError("this layer has no FP8 experts: call quantize_experts() first")
        if not torch.compiler.is_compiling():  # (host-side facts; a compiled frame skips them)
            self.fp8.check_current(self.in_proj, self.out_proj)
        return self.fp8.get()

    def _own_experts(self, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.experts_owner is not None:
            raise RuntimeError(f"this MoELayer's experts belong to an {self.experts_owner}: {what} "
                               "needs the layer that holds them")  # fmt: skip
        return self.in_proj, self.out_proj

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``to``, ``cuda``, ``half``): FP8 experts that were current stay
        current (the weights moved or were cast with them)."""
        fp8 = self.fp8 if self.experts_owner is None else None
        current = fp8 is not None and fp8.current(self.in_proj, self.out_proj)
        out = super()._apply(fn, recurse)
        if current:
            fp8.remember(self.in_proj, self.out_proj)
        return out

    @property
    def has_features(self) -> bool:
        """Whether the experts have biases, another activation or the weight on the input
        (then they run as composed steps)."""
        return self.swiglu is not None or self.expert_biases or self.weight_on_input

    def features(self) -> ExpertFeatures:
        """The experts' features (``moe_model.expert_features.ExpertFeatures``): the biases,
        the activation, whether the weight scales the input."""
        return ExpertFeatures(self.in_bias, self.out_bias, self.swiglu, self.weight_on_input)

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
        without shared experts. Its GEMMs run in the implementation's ``shared_dtype`` (fp32 for
        ``"baseline"``), else the shared weights' dtype; the activation in fp32. With
        ``shared_gate`` the gate's logit (T, 1) is a GEMM of the same dtype, its sigmoid and the
        product with the MLP's output (taken in fp32) in fp32, rounded once to x's dtype."""
        if self.shared_experts is None:
            return None
        compute_dtype = IMPLS[self._impl].shared_dtype
        gate = self.shared_expert_gate
        if gate is None:
            return self.shared_experts(x_TD, compute_dtype)
        out_TD = self.shared_experts(x_TD, compute_dtype, out_dtype=torch.float32)
        dtype = compute_dtype or gate.weight.dtype
        g_T1 = torch.sigmoid(F.linear(x_TD.to(dtype), gate.weight.to(dtype)).float())
        return (g_T1 * out_TD).to(x_TD.dtype)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias update from the last forward's ``last_counts``, in place:
        ``expert_bias[e] += rate * sign(mean(last_counts) - last_counts[e])`` (no host sync, no
        gradient). Call it after each training step. ValueError without ``expert_bias``."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs a layer built with expert_bias=True")
        expert_bias_step(self.expert_bias, self.last_counts, check_rate(rate))

    def check_x(self, x: object) -> torch.Tensor:
        """x (..., d_model): a tensor on the layer's device, in a dtype the implementation
        takes (TypeError / ValueError otherwise) -> x_TD (T, d_model)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (..., d_model={self.d_model}), got {tuple(x.shape)}"
            )
        check_dtype(x.dtype, self._impl)
        if x.device != self.router.weight.device:
            raise ValueError(f"x is on {x.device}, the layer on {self.router.weight.device}")
        return x.reshape(-1, self.d_model)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Router scores (..., E) fp32 of x (..., d_model): softmax over all E logits, or sigmoid
        (without the expert bias; the router bias, if any, is in the logits). With the default
        ``router_bias=False, router_dtype=None``, implementations with ``kernel_router`` use
        ``moe_kernels.router_scores`` (the same fp32 math summed in other orders: one Triton
        kernel for up to 32 experts, bf16 tensor-core GEMMs on the weight's exact bf16 pieces
        for more with bf16 x); otherwise every implementation runs the torch formula: the
        logits ``F.linear`` in ``router_dtype`` (None: fp32), the score function in fp32."""
        scores_TE = self._scores(self.check_x(x))
        return scores_TE.view(*x.shape[:-1], self.n_experts)

    def _scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        bias = self.router.bias
        if IMPLS[self._impl].kernel_router and bias is None and self.router_dtype is None:
            from moe_kernels import router_scores

            return router_scores(x_TD, self.router.weight, score_fn=self.score_fn)
        dtype = self.router_dtype or torch.float32
        weight = self.router.weight.to(dtype)
        logits_TE = F.linear(x_TD.to(dtype), weight, None if bias is None else bias.to(dtype))
        logits_TE = logits_TE.float()
        if self.score_fn == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., d_model) in x's dtype: the routed experts plus the shared experts. Updates
        ``last_counts``, and ``aux_loss`` (None without ``aux_loss_coef`` or grad)."""
        if self.experts_owner is not None:
            raise RuntimeError(
                f"this MoELayer's experts belong to an {self.experts_owner}: call that module "
                "(the layer alone has only its router, bias and shared experts)"
            )
        x_TD = self.check_x(x)
        return self.run(x_TD, LOCAL_EXCHANGE, self.in_proj, self.out_proj).view(x.shape)

    def run(
        self,
        x_TD: torch.Tensor,
        exchange: Any,
        in_proj: torch.Tensor,
        out_proj: torch.Tensor,
        scores_TE: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The walk of tokens x_TD (T, d_model), checked, through ``exchange`` to the experts
        ``in_proj`` / ``out_proj`` -> y_TD (T, d_model) in x's dtype. ``scores_TE``: the router
        scores (T, E) fp32 when the caller computed them (a wrapper that also hands the logits
        elsewhere, ``moe_model.hf.MoEBlock``); None: ``scores(x)``.

        ``exchange``: ``to_experts(x_TD, plan, record)`` returns what it hands the experts
        (``.rows``, ``ExpertRows``) and the (E,) counts this layer records (``.counts``);
        ``from_experts(outputs, sent, record)`` returns the outputs in the plan's pair order and
        the plan to combine them by. ``LOCAL_EXCHANGE`` here; ``ExpertParallelMoE`` is one too.
        """
        impl = IMPLS[self._impl]
        # Host-side facts (no sync): weights cast after the layer was built, or moved alone.
        check_dtype(in_proj.dtype, self._impl, name="the expert weights' dtype")
        if in_proj.device != x_TD.device:
            raise ValueError(f"x is on {x_TD.device}, the expert weights on {in_proj.device}")
        options = self.route_options()
        weights = (*self.parameters(), in_proj, out_proj)
        record = torch.is_grad_enabled() and (
            x_TD.requires_grad or any(p.requires_grad for p in weights)
        )
        impl.check(options, record)
        if scores_TE is None:
            scores_TE = self._scores(x_TD)
        elif scores_TE.shape != (x_TD.shape[0], self.n_experts) or scores_TE.dtype != torch.float32:
            raise ValueError(
                f"scores_TE must be ({x_TD.shape[0]}, {self.n_experts}) float32, got "
                f"{tuple(scores_TE.shape)} {scores_TE.dtype}"
            )
        plan = impl.route(scores_TE, self.top_k, options)
        rows_TD = x_TD.to(impl.rows_dtype(x_TD.dtype, in_proj.dtype))
        sent = exchange.to_experts(rows_TD, plan, record)
        self.last_counts.copy_(sent.counts)  # in place: a mutation torch.compile traces
        if impl.fp8_experts and not record:  # its quantised copies (an ExpertParallelMoE refuses
            # the impl); training quantises the master weights on the fly
            in_proj, out_proj = self.fp8_experts()
        if self.has_features:  # composed steps (an ExpertParallelMoE refuses such layers)
            y_TD = composed_experts_combine(
                impl, sent.rows, sent.plan, in_proj, out_proj, self.gated, self.features(), x_TD
            )
        elif getattr(exchange, "local", False):  # nothing travels: the impl may fuse the two
            y_TD = impl.experts_combine(
                sent.rows, sent.plan, in_proj, out_proj, self.gated, x_TD, record
            )
        else:
            ys = impl.experts(sent.rows, in_proj, out_proj, self.gated, record)
            ys_PD, kept = exchange.from_experts(ys, sent, record)
            y_TD = impl.combine(ys_PD, kept, x_TD)
        shared_TD = self.shared_output(x_TD)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        if self.aux_loss_coef > 0:  # (no attribute write otherwise: nothing for dynamo to replay)
            self.aux_loss = None
            if torch.is_grad_enabled():
                self.aux_loss = switch_aux_loss(
                    scores_TE, plan.counts, self.top_k, self.aux_loss_coef
                )
        return y_TD

    def extra_repr(self) -> str:
        text = (
            f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, "
            f"hidden={self.hidden}, gated={self.gated}, score_fn={self.score_fn!r}, "
            f"renormalize={self.renormalize}"
        )
        if self.swiglu is not None:
            text += f", swiglu={self.swiglu}"
        if self.expert_biases:
            text += ", expert_biases=True"
        if self.weight_on_input:
            text += ", weight_on_input=True"
        if self.router.bias is not None:
            text += ", router_bias=True"
        if self.router_dtype is not None:
            text += f", router_dtype={self.router_dtype}"
        if self.expert_bias is not None:
            text += ", expert_bias=True"
        if self.topk_groups < self.n_groups:
            text += f", n_groups={self.n_groups}, topk_groups={self.topk_groups}"
        for name, default in (
            ("routed_scaling_factor", 1.0),
            ("n_shared_experts", 0),
            ("shared_hidden", None),
            ("shared_gate", False),
            ("aux_loss_coef", 0.0),
        ):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)}"
        return text + f", impl={self._impl!r}"
