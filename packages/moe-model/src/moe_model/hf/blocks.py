"""Block replacement: a loaded transformers model's sparse MoE blocks swapped for ``MoELayer``
(``replace_moe_blocks``) and back (``restore_moe_blocks``).

Unlike the experts backend, which keeps HF's router and rebuilds a plan from its top-k, a
replaced block runs the whole layer: the router's logits by HF's formula, then ``MoELayer``'s
routing (``moe_kernels.route``: the top-k, its weights and the plan in one fused step) and
experts. The routed weights are HF's own tensors (zero-copy: the same ``Parameter`` objects);
the shared experts stay HF's modules (torchtitan's rule: swap a part, never re-implement it).

What keeps working:

* ``state_dict()`` / ``load_state_dict()`` / ``save_pretrained`` use HF's names
  (``gate.weight``, ``gate.e_score_correction_bias``, ``experts.gate_up_proj``,
  ``experts.down_proj``), so a replaced model's checkpoint loads into an untouched one;
* ``output_router_logits=True`` and HF's auxiliary loss (its padding mask included): HF records
  router logits from modules of its router class (``OutputRecorder(<Router>, index=0)``); the
  block's ``gate`` is a parameterless subclass of that class whose call returns the block's
  logits, carrying the hooks the original router had;
* the optimizer's view: ``parameters()`` holds each tensor once (the layer's).

Families (by their router class): Mixtral, Qwen2-MoE (sigmoid-gated shared expert), Qwen3-MoE,
OLMoE, DeepSeek-V3 (sigmoid scores, correction bias, groups, scaling, shared experts), GPT-OSS
(router bias, expert biases, its clamped ``alpha`` SwiGLU on interleaved gate/up columns) and
Llama4 (sigmoid of the top-k logits, the weight on the expert's input, a shared expert). GPT-OSS's
and Llama4's experts are stored transposed ((E, D, 2H), (E, H, D)): the layer holds parameters
that view HF's storage transposed (zero-copy; ``restore_moe_blocks`` points HF's own parameter
objects at the current tensors), and their state-dict entries are transposed back to HF's layout.
Other routers, and experts of another activation, raise ValueError naming the class.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from moe_model.expert_features import SwiGLU
from moe_model.hf.backend import fused
from moe_model.impls import check_impl
from moe_model.moe import LOCAL_EXCHANGE, MoELayer


class Family(NamedTuple):
    """How a router class routes and its block is built: ``score_fn`` over the logits;
    ``fp32_logits``: the logits from fp32 x and weight (else in the router weight's dtype, the
    score function in fp32); ``renormalize``: always (True), never (False) or by the router's
    ``norm_topk_prob`` (None); ``router``: the block's attribute holding it; ``logits_index``:
    where the router's output tuple holds the logits (what HF records); ``returns_router``: the
    block returns ``(y, logits)``; ``transposed``: experts stored (E, D, H') and (E, H, D);
    ``gpt_oss``: router bias, expert biases, GPT-OSS's SwiGLU; ``weight_on_input``: Llama4's."""

    score_fn: str = "softmax"
    fp32_logits: bool = False
    renormalize: bool | None = None
    router: str = "gate"
    logits_index: int = 0
    returns_router: bool = False
    transposed: bool = False
    gpt_oss: bool = False
    weight_on_input: bool = False


FAMILIES: dict[str, Family] = {
    "MixtralTopKRouter": Family(renormalize=True),
    "Qwen2MoeTopKRouter": Family(),
    "Qwen3MoeTopKRouter": Family(),
    "OlmoeTopKRouter": Family(),
    "DeepseekV3TopkRouter": Family("sigmoid", fp32_logits=True),
    # softmax over the top-k logits = the softmax over all, renormalised over the k
    "GptOssTopKRouter": Family(renormalize=True, router="router", returns_router=True,
                               transposed=True, gpt_oss=True),
    # sigmoid of the top-k logits, no renormalisation, the weight scales the expert's input
    "Llama4Router": Family("sigmoid", renormalize=False, router="router", logits_index=1,
                           returns_router=True, transposed=True, weight_on_input=True),
}  # fmt: skip


@functools.cache
def _logits_class(router_cls: type) -> type:
    """A parameterless subclass of HF's router class: called with the logits (T, E) it returns
    ``(logits, None, None)``, the router's output layout, so HF's recorder stores them."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None, None, None]
        out[FAMILIES[router_cls.__name__].logits_index] = logits_TE
        return tuple(out)

    doc = f"{router_cls.__name__}'s logits, as transformers records them."
    attrs = {"__init__": __init__, "forward": forward, "__module__": __name__, "__doc__": doc}
    return type(f"{router_cls.__name__}Logits", (router_cls,), attrs)


def _router(block: nn.Module) -> nn.Module | None:
    """A block's router: ``gate`` (most families) or ``router`` (GPT-OSS, Llama4)."""
    router = getattr(block, "gate", None)
    router = getattr(block, "router", None) if router is None else router
    return router if isinstance(router, nn.Module) else None


def _is_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (
        isinstance(experts, nn.Module) and hasattr(experts, "down_proj")
        and _router(module) is not None and not isinstance(module, MoEBlock)
    )  # fmt: skip


def _experts_ok(experts: nn.Module, family: Family) -> bool:
    """Whether ``experts`` computes what ``family``'s layer will: GPT-OSS's biased, clamped
    experts; Llama4's SiLU-gated ones; else SiLU(-gated) experts without biases."""
    if family.gpt_oss:
        return all(getattr(experts, a, None) is not None for a in
                   ("alpha", "limit", "gate_up_proj_bias", "down_proj_bias"))  # fmt: skip
    if family.transposed:
        return isinstance(getattr(experts, "act_fn", None), (nn.SiLU, SiLUActivation))
    return fused(experts)


def check_block(block: nn.Module) -> Family:
    """The family of a sparse MoE block, or ValueError naming the router or experts class of
    one ``MoELayer`` cannot express."""
    name = type(_router(block)).__name__
    hint = (
        "MoELayer cannot express it; experts transformers runs through its ExpertsInterface "
        "can take experts_implementation='moe_kernels' instead"
    )
    if name not in FAMILIES:
        raise ValueError(
            f"replace_moe_blocks: router {name} is not one of {sorted(FAMILIES)}: {hint}"
        )
    if not _experts_ok(block.experts, FAMILIES[name]):
        raise ValueError(
            f"replace_moe_blocks: {type(block.experts).__name__} is not the experts {name}'s "
            f"family has (another activation?): {hint}"
        )
    return FAMILIES[name]


class MoEBlock(nn.Module):
    """A transformers sparse MoE block on ``MoELayer``: ``hidden_states (..., D) -> (..., D)``
    in their dtype, HF's block's function (module docstring).

    Children: ``moe`` (the ``MoELayer``, holding HF's router weight, correction bias and expert
    weights), ``gate`` (the logits recorder), and HF's shared-expert modules under their names
    (``shared_expert`` and ``shared_expert_gate``, or ``shared_experts``). Build it with
    ``replace_moe_blocks``; ``original()`` gives HF's block back with the current tensors.
    """

    def __init__(self, block: nn.Module, impl: str | None = None) -> None:
        super().__init__()
        family = check_block(block)
        gate, experts = _router(block), block.experts
        gated = getattr(experts, "has_gate", True)
        in_name = "gate_up_proj" if gated else "up_proj"
        w_in, w_out = getattr(experts, in_name), experts.down_proj
        if family.transposed:  # (E, D, H') and (E, H, D) in HF's storage
            w_in, w_out = w_in.mT, w_out.mT
        E, h_in, D = w_in.shape
        grouped = getattr(gate, "num_group", 1) or 1
        norm = family.renormalize
        swiglu = None
        if family.gpt_oss:
            swiglu = SwiGLU(float(experts.alpha), float(experts.limit), 1.0, interleaved=True)
        layer = MoELayer(
            D,
            E,
            gate.top_k,
            h_in // 2 if gated else h_in,
            gated=gated,
            swiglu=swiglu,
            expert_biases=family.gpt_oss,
            weight_on_input=family.weight_on_input,
            score_fn=family.score_fn,
            router_bias=getattr(gate, "bias", None) is not None,
            renormalize=bool(gate.norm_topk_prob) if norm is None else norm,
            expert_bias=hasattr(gate, "e_score_correction_bias"),
            n_groups=grouped,
            topk_groups=getattr(gate, "topk_group", None) if grouped > 1 else None,
            routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0),
            impl=impl or ("triton_fp32" if w_in.dtype == torch.float32 else "triton_bf16"),
            device="meta",
            dtype=w_in.dtype,
        )
        # HF's tensors into the layer (zero-copy), then out of the block it keeps for restoring
        r = family.router
        names = {"moe.router.weight": f"{r}.weight", "moe.router.bias": f"{r}.bias",
                 "moe.expert_bias": f"{r}.e_score_correction_bias",
                 "moe.in_proj": f"experts.{in_name}", "moe.in_bias": f"experts.{in_name}_bias",
                 "moe.out_proj": "experts.down_proj", "moe.out_bias": "experts.down_proj_bias",
                 }  # HF's order, which restore keeps  # fmt: skip
        self.moe = layer
        self._names = {k: v for k, v in names.items() if _get(self, k) is not None}
        self._transposed = set(_TRANSPOSED) if family.transposed else set()
        self._hf_tensors = {}  # HF's transposed parameter objects, for restore
        for ours, theirs in self._names.items():
            t = _get(block, theirs)
            if ours in self._transposed:
                self._hf_tensors[ours] = t
                t = nn.Parameter(t.mT, requires_grad=t.requires_grad)  # a view: no copy
            _set(self, ours, t)
            _set(block, theirs, None)
        layer.last_counts = torch.zeros(E, dtype=torch.int32, device=w_in.device)
        self._original = (block,)  # a tuple: not a child, no state
        self.family = family
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        recorder = _logits_class(type(gate))()
        setattr(self, r, recorder)
        for hook in gate._forward_hooks.values():  # HF's recorders, if already installed
            recorder.register_forward_hook(hook)
        self.shared = [n for n in ("shared_expert", "shared_expert_gate", "shared_experts")
                       if isinstance(getattr(block, n, None), nn.Module)]  # fmt: skip
        for name in self.shared:
            setattr(self, name, getattr(block, name))
        self.register_state_dict_post_hook(_to_hf_names)
        self.register_load_state_dict_pre_hook(_from_hf_names)

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """HF's router logits (T, E) of x_TD: fp32 for DeepSeek-V3, else in the router weight's
        dtype (the score function then runs in fp32 of them); GPT-OSS's with its bias."""
        w_ED, b_E = self.moe.router.weight, self.moe.router.bias
        dtype = torch.float32 if self.family.fp32_logits else w_ED.dtype
        return F.linear(x_TD.to(dtype), w_ED.to(dtype), None if b_E is None else b_E.to(dtype))

    def forward(
        self, hidden_states: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x_TD = self.moe.check_x(hidden_states)
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as HF draws it
            j = self.jitter_noise
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - j, 1.0 + j)
        logits_TE = self.router_logits(x_TD)
        getattr(self, self.family.router)(logits_TE)  # transformers' recorders see them here
        scores_TE = logits_TE.float()
        softmax = self.family.score_fn == "softmax"
        scores_TE = scores_TE.softmax(-1) if softmax else scores_TE.sigmoid()
        moe = self.moe
        y_TD = moe.run(x_TD, LOCAL_EXCHANGE, moe.in_proj, moe.out_proj, scores_TE)
        if "shared_expert" in self.shared:  # Qwen2-MoE's sigmoid-gated one; Llama4's plain one
            shared_TD = self.shared_expert(x_TD)
            if "shared_expert_gate" in self.shared:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        elif "shared_experts" in self.shared:  # DeepSeek-V3
            y_TD = y_TD + self.shared_experts(x_TD)
        y = y_TD.view(hidden_states.shape)
        return (y, logits_TE) if self.family.returns_router else y

    def original(self) -> nn.Module:
        """HF's block, its router and experts holding this block's current tensors again (the
        same objects, zero-copy; a transposed one HF's own parameter viewing the current
        tensor), its shared modules the ones here."""
        block = self._original[0]
        for ours, theirs in self._names.items():
            t = _get(self, ours)
            if ours in self._transposed:
                hf_t = self._hf_tensors[ours]
                hf_t.data = t.data.mT
                t = hf_t
            _set(block, theirs, t)
        for name in self.shared:
            setattr(block, name, getattr(self, name))
        return block


_TRANSPOSED = ("moe.in_proj", "moe.out_proj")


def _get(module: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` (dotted) of ``module``, or None."""
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner), attr, None)


def _set(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    """Make ``t`` the parameter (an ``nn.Parameter``) or buffer ``name`` of ``module``, or
    remove ``name`` for None."""
    owner, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner)
    if t is None:
        delattr(owner, attr)
    elif isinstance(t, nn.Parameter) or attr in owner._parameters:
        owner.register_parameter(attr, t)
    else:
        owner.register_buffer(attr, t)


def _to_hf_names(module: MoEBlock, state: dict[str, Any], prefix: str, local_metadata) -> None:
    for ours, theirs in module._names.items():
        if prefix + ours in state:
            t = state.pop(prefix + ours)
            state[prefix + theirs] = t.mT if ours in module._transposed else t


def _from_hf_names(module: MoEBlock, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for ours, theirs in module._names.items():
        if prefix + theirs in state:
            t = state.pop(prefix + theirs)
            state[prefix + ours] = t.mT if ours in module._transposed else t


def _swap(model: nn.Module, make, match) -> list[str]:
    """Replace every submodule ``match`` accepts by ``make(module)``, parents first; the names."""
    names = []
    for name, module in list(model.named_modules()):
        if name and match(module):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, make(module))
            names.append(name)
    return names


def replace_moe_blocks(model: nn.Module, impl: str | None = None) -> list[str]:
    """Swap every sparse MoE block of ``model`` (a transformers model or any module holding
    them) for a ``MoEBlock`` in place; returns the replaced blocks' names.

    ``impl``: the ``MoELayer`` implementation (None: ``"triton_fp32"`` for fp32 weights,
    ``"triton_bf16"`` otherwise). Every block is checked before any is swapped: ValueError
    naming the router or experts class of a family the layer cannot express (GPT-OSS, Llama4),
    or naming ``impl``; ValueError when ``model`` holds no MoE block."""
    blocks = [m for m in model.modules() if _is_block(m)]
    if not blocks:
        raise ValueError(f"replace_moe_blocks: {type(model).__name__} has no sparse MoE block")
    for block in blocks:  # fail before touching anything
        check_block(block)
    if impl is not None:
        check_impl(impl)  # ValueError naming impl, before a swap
    return _swap(model, lambda block: MoEBlock(block, impl), _is_block)


def restore_moe_blocks(model: nn.Module) -> list[str]:
    """Undo ``replace_moe_blocks``: every ``MoEBlock`` of ``model`` back to HF's block holding
    the current tensors (trained or loaded since); returns the restored blocks' names."""
    return _swap(model, MoEBlock.original, lambda m: isinstance(m, MoEBlock))
