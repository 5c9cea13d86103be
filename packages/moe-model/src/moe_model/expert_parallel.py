"""``ExpertParallelMoE``: one ``MoELayer`` sharded by experts over the W ranks of a process group.

Rank r keeps the router (and the expert bias and shared experts) replicated and only its
contiguous experts ``[r * E // W, (r + 1) * E // W)``. ``forward(x)`` of the rank's own tokens:

1. router scores and ``moe_kernels.route`` over all E experts (the layer's ``route_options``);
2. the (E,) counts of every rank gathered on the device (one small all-to-all);
3. each pair's token row sent to the rank owning its expert (``all_to_all_single``), in one of
   two modes (``_ep_exchange``): ``"dropless"`` (exact; split sizes read on the host: one host
   sync per forward) or ``"padded"`` (C rows per (source rank, expert), no host sync, CUDA-graph
   capturable; pairs past C are dropped and counted in ``dropped``);
4. the local experts on what arrived, grouped by local expert (the layer's impl decides how);
5. the outputs sent back (the reverse all-to-all) and combined in the plan's fixed choice order,
   plus the shared experts on the rank's own tokens.

What the local experts and the combine compute follows the layer's ``impl`` exactly as
``MoELayer`` does, so with nothing dropped the output equals the single-process layer's on the
same tokens: ``triton_*`` (kernel ops; the gather fused into the first grouped GEMM without
autograd, the unfused training chain with it), ``mxfp8`` (its grouped GEMM), ``torch``
(``moe_model.moe.grouped_mm`` and the torch weighted sum), ``baseline`` (fp32 per-expert GEMMs,
fp32 rows sent back). ``fbgemm`` runs the ``torch`` chain (fbgemm's own scatter-add order is not
reproducible). Backward runs through both exchanges (the reverse all-to-all) to x, the router
and the local experts; every rank must run it (a collective per exchange).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from moe_model import _ep_exchange as X
from moe_model._moe_options import switch_aux_loss
from moe_model.moe import MoELayer

EP_MODES: tuple[str, ...] = ("dropless", "padded")


class _Offsets(NamedTuple):
    """The one field of a routing plan that ``moe_model.moe``'s grouped-GEMM helpers read."""

    offsets: torch.Tensor


def _group_size(group: object) -> tuple[object, int, int]:
    """(group, W, rank in it); no process group at all (None, none initialised): one rank."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        return None, dist.get_world_size(), dist.get_rank()
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be None or a ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    return group, dist.get_world_size(group), rank


def _check_mode(mode: object, capacity_factor: object, tokens_per_rank: object) -> None:
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, got {type(mode).__name__}")
    if mode not in EP_MODES:
        raise ValueError(f"mode must be one of {EP_MODES}, got {mode!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor must be a float, got {type(capacity_factor).__name__}")
    if not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor must be a finite float > 0, got {capacity_factor}")
    if tokens_per_rank is not None:
        if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int):
            raise TypeError(
                f"tokens_per_rank must be None or an int, got {type(tokens_per_rank).__name__}"
            )
        if tokens_per_rank < 0:
            raise ValueError(f"tokens_per_rank must be >= 0, got {tokens_per_rank}")


def _check_split(n_experts: int, world: int) -> None:
    if n_experts % world:
        raise ValueError(
            f"n_experts={n_experts} must be divisible by the group's world size {world} "
            "(each rank holds E // W contiguous experts)"
        )


def expert_weights(
    seed: int, expert: int, h_in: int, d_model: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 CPU (in_proj (h_in, d_model), out_proj (d_model, hidden)) of global expert
    ``expert`` in ``from_config``: normal, std 1/sqrt(fan-in) (MoELayer's), drawn from a
    generator of its own, so a model is the same whatever the world size."""
    gen = torch.Generator().manual_seed(seed * (1 << 24) + expert)
    w_in = torch.randn(h_in, d_model, generator=gen) / math.sqrt(d_model)
    w_out = torch.randn(d_model, hidden, generator=gen) / math.sqrt(hidden)
    return w_in, w_out


class ExpertParallelMoE(nn.Module):
    """A ``MoELayer`` whose experts are split over the W ranks of ``group`` (default: the
    default group; none initialised: a single rank, no collectives).

    Args:
        layer: a full ``MoELayer`` (any options and impl), the same on every rank. It is
            consumed: its ``in_proj`` / ``out_proj`` move here as this rank's slices
            ``in_proj`` (L, H', D) / ``out_proj`` (L, D, H), L = E // W, the rest is freed; the
            layer keeps the router, expert bias and shared experts (``self.layer``) and can no
            longer run alone.
        mode: ``"dropless"`` or ``"padded"`` (see the module doc); can be changed later.
        capacity_factor: padded mode: C = min(ceil(capacity_factor * T * k / E), T) rows per
            (source rank, expert), T = ``tokens_per_rank`` or else the input's row count.
            ``capacity_factor >= E / k`` never drops.
        tokens_per_rank: padded mode: the static token count C is sized for; every rank's input
            may then hold any number of tokens up to it (uneven counts, zero). Without it C
            comes from each call's row count, which must then be the same on every rank.

    State after each forward: ``local_counts`` (E,) int32 (this rank's pairs per expert),
    ``last_counts`` (E,) int32 (the group's: also written to ``layer.last_counts``, so
    ``update_expert_bias`` moves the replicated bias identically on every rank), ``dropped``
    (0-d int64 device tensor: this rank's pairs dropped by the padded mode), ``aux_loss`` (the
    layer's Switch loss of this rank's tokens, or None), ``last_send_rows`` (host list: rows
    sent to each rank, the padding included).
    """

    local_counts: torch.Tensor
    last_counts: torch.Tensor
    dropped: torch.Tensor

    def __init__(
        self,
        layer: MoELayer,
        group: object = None,
        *,
        mode: str = "dropless",
        capacity_factor: float = 1.25,
        tokens_per_rank: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer must be a MoELayer, got {type(layer).__name__}")
        if not isinstance(layer.__dict__.get("_parameters", {}).get("in_proj"), torch.Tensor):
            raise ValueError("layer has no experts (already wrapped by an ExpertParallelMoE?)")
        _check_mode(mode, capacity_factor, tokens_per_rank)
        group, W, rank = _group_size(group)
        _check_split(layer.n_experts, W)
        L = layer.n_experts // W
        for name in ("in_proj", "out_proj"):  # this rank's slices; the full tensors are freed
            full = getattr(layer, name)
            local = full.detach()[rank * L : (rank + 1) * L].clone()
            delattr(layer, name)
            setattr(layer, name, nn.Parameter(local, requires_grad=full.requires_grad))
        self._setup(layer, group, W, rank, mode, capacity_factor, tokens_per_rank)

    def _setup(
        self,
        layer: MoELayer,
        group: object,
        world: int,
        rank: int,
        mode: str,
        capacity_factor: float,
        tokens_per_rank: int | None,
    ) -> None:
        """Take over ``layer`` whose ``in_proj`` / ``out_proj`` hold only this rank's experts."""
        self.group, self.world_size, self.rank = group, world, rank
        self.mode, self.capacity_factor = mode, capacity_factor
        self.tokens_per_rank = tokens_per_rank
        self.n_local = layer.n_experts // world
        self.expert_start, self.expert_end = rank * self.n_local, (rank + 1) * self.n_local
        self._backend = dist.get_backend(group) if world > 1 else None
        self.in_proj, self.out_proj = layer.in_proj, layer.out_proj
        del layer.in_proj, layer.out_proj
        self.layer = layer
        E, dev = layer.n_experts, layer.router.weight.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.register_buffer("local_counts", torch.zeros(E, **i32), persistent=False)
        self.register_buffer("last_counts", torch.zeros(E, **i32), persistent=False)
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        self.register_buffer("dropped", zero, persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.last_send_rows: list[int] | None = None

    @classmethod
    def from_config(
        cls,
        d_model: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        group: object = None,
        *,
        mode: str = "dropless",
        capacity_factor: float = 1.25,
        tokens_per_rank: int | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ) -> ExpertParallelMoE:
        """Build the layer with only this rank's experts allocated. ``options``: MoELayer's
        (gated, score_fn, impl, expert_bias, n_shared_experts, ...); ``device`` / ``dtype``: its
        factory kwargs. Deterministic in ``seed`` and the same model for any world size: the
        router, bias and shared experts are ``MoELayer.reset_parameters()``'s draws on CPU
        after ``torch.manual_seed(seed)`` (the global RNG state is restored), expert e's weights
        ``expert_weights(seed, e, ...)``."""
        _check_mode(mode, capacity_factor, tokens_per_rank)
        for name, v in (("n_experts", n_experts), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        pg, W, rank = _group_size(group)
        _check_split(n_experts, W)
        # Every check of MoELayer, no memory; then everything but the experts on the CPU.
        layer = MoELayer(d_model, n_experts, top_k, hidden, device="meta", dtype=dtype, **options)
        meta_in, meta_out = layer.in_proj, layer.out_proj
        del layer.in_proj, layer.out_proj
        layer.to_empty(device="cpu")
        for buf in layer.buffers():  # (reset_parameters zeroes the ones it knows)
            buf.zero_()
        # Zero-expert stand-ins, so that the layer's own init covers everything but the experts.
        layer.in_proj = nn.Parameter(meta_in.new_empty(0, *meta_in.shape[1:], device="cpu"))
        layer.out_proj = nn.Parameter(meta_out.new_empty(0, *meta_out.shape[1:], device="cpu"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layer.reset_parameters()
        L = n_experts // W
        pairs = [
            expert_weights(seed, e, meta_in.shape[1], d_model, hidden)
            for e in range(rank * L, (rank + 1) * L)
        ]
        with torch.no_grad():
            layer.in_proj = nn.Parameter(torch.stack([p[0] for p in pairs]).to(meta_in.dtype))
            layer.out_proj = nn.Parameter(torch.stack([p[1] for p in pairs]).to(meta_out.dtype))
        layer = layer.to(device) if device is not None else layer
        ep = cls.__new__(cls)
        nn.Module.__init__(ep)
        ep._setup(layer, pg, W, rank, mode, capacity_factor, tokens_per_rank)
        return ep

    # -----------------------------------------------------------------------------------------

    @property
    def impl(self) -> str:
        return self.layer.impl

    def capacity(self, tokens: int) -> int:
        """C, the padded mode's rows per (source rank, expert) for ``tokens`` rows per rank."""
        T = self.tokens_per_rank if self.tokens_per_rank is not None else tokens
        E, k = self.layer.n_experts, self.layer.top_k
        return min(math.ceil(self.capacity_factor * T * k / E), T)

    def update_expert_bias(self, rate: float) -> None:
        """The layer's DeepSeek-V3 bias step from the group's ``last_counts`` (the same on
        every rank, so the replicated bias stays replicated)."""
        self.layer.update_expert_bias(rate)

    def _check_x(self, x: object) -> torch.Tensor:
        """x (..., d_model) on the router's device, checked before any collective -> x_TD."""
        layer = self.layer
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != layer.d_model:
            raise ValueError(
                f"x must have shape (..., d_model={layer.d_model}), got {tuple(x.shape)}"
            )
        if x.device != layer.router.weight.device:
            raise ValueError(f"x is on {x.device}, the layer on {layer.router.weight.device}")
        if self.world_size > 1:
            backend = str(self._backend)
            if "nccl" in backend and "gloo" not in backend and not x.is_cuda:
                raise ValueError(f"the group's backend {backend} needs CUDA tensors, x is on CPU")
            if backend == "gloo" and x.device.type != "cpu":
                raise ValueError(
                    f"the group's backend gloo exchanges CPU tensors, x is on {x.device}"
                )
        x_TD = x.reshape(-1, layer.d_model)
        _check_mode(self.mode, self.capacity_factor, self.tokens_per_rank)
        limit = self.tokens_per_rank
        if self.mode == "padded" and limit is not None and x_TD.shape[0] > limit:
            raise ValueError(f"x has {x_TD.shape[0]} tokens, more than tokens_per_rank={limit}")
        return x_TD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., d_model) in x's dtype for this rank's tokens x (..., d_model)."""
        x_TD = self._check_x(x)
        guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
        with guard:
            y_TD = self._forward(x_TD)
        return y_TD.view(x.shape)

    def _forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        from moe_kernels import route

        layer = self.layer
        T = x_TD.shape[0]
        E, k, W = layer.n_experts, layer.top_k, self.world_size
        scores_TE = layer.scores(x_TD)  # the dtype check of the impl, before any collective
        plan = route(scores_TE, k, **layer.route_options())
        record = torch.is_grad_enabled() and (
            x_TD.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        counts_WE = X.gather_counts(plan.counts, W, self.group)
        with torch.no_grad():
            self.local_counts.copy_(plan.counts)
            self.last_counts.copy_(counts_WE.sum(0, dtype=torch.int32))
            layer.last_counts.copy_(self.last_counts)
        baseline = layer.impl == "baseline"
        x_send = x_TD if baseline else x_TD.to(self.in_proj.dtype)
        if self.mode == "dropless":
            lay = X.DroplessLayout.build(counts_WE, self.rank, self.n_local, T * k)
            send_rows, recv_rows, local = lay.send_rows, lay.recv_rows, lay.local
            send_ND = X.move_rows(x_send, plan.token_indices, plan.inverse)
            self.dropped.zero_()
        else:
            C = self.capacity(T)
            pad = X.PaddedLayout.build(plan, E, C, W)
            send_rows = recv_rows = [self.n_local * C] * W
            local = pad.local
            send_ND = X.move_rows(x_send, pad.token_of_slot, pad.slot_TK)
            with torch.no_grad():
                self.dropped.copy_(pad.dropped)
        self.last_send_rows = list(send_rows)
        recv_RD = self._exchange(send_ND, recv_rows, send_rows, record)
        ys_sorted = _local_experts(self, recv_RD, local, record)
        ys_recv = X.move_rows(ys_sorted, local.sorted_of_row, local.row_of_sorted.view(-1, 1))
        back_ND = self._exchange(ys_recv, send_rows, recv_rows, record)
        if self.mode == "dropless":
            ys_PD, kept = back_ND, plan
        else:
            ys_PD = X.move_rows(back_ND, pad.slot_P, pad.pair_of_slot)
            kept = plan._replace(inverse=torch.where(pad.slot_TK >= 0, plan.inverse, -1))
        y_TD = _combine(layer, ys_PD, plan, kept, x_TD.dtype)
        shared_TD = layer.shared_output(x_TD)  # replicated: this rank's own tokens
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        self.aux_loss = None
        if layer.aux_loss_coef > 0 and torch.is_grad_enabled():
            self.aux_loss = switch_aux_loss(scores_TE, plan.counts, k, layer.aux_loss_coef)
        layer.aux_loss = self.aux_loss
        return y_TD

    def _exchange(
        self, x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], record: bool
    ) -> torch.Tensor:
        if self.world_size == 1:
            return x_ND
        return X.all_to_all_rows(x_ND, out_rows, in_rows, self.group, record)

    def extra_repr(self) -> str:
        text = (
            f"world_size={self.world_size}, rank={self.rank}, experts=[{self.expert_start}, "
            f"{self.expert_end}), mode={self.mode!r}"
        )
        if self.mode == "padded":
            text += f", capacity_factor={self.capacity_factor}"
            if self.tokens_per_rank is not None:
                text += f", tokens_per_rank={self.tokens_per_rank}"
        return text


# ---------------------------------------------------------------------------------------------
# Routing, the local experts and the combine


def _local_experts(
    ep: ExpertParallelMoE, recv_RD: torch.Tensor, local: X.LocalPlan, record: bool
) -> torch.Tensor:
    """The local experts on the received rows -> (R, D) in (local expert, source, token) order,
    computed as the layer's impl computes its experts (``moe_model.moe``)."""
    from moe_kernels import expert_activation, gather_grouped_mm
    from moe_model import moe

    impl, gated = ep.layer.impl, ep.layer.gated
    if impl == "baseline":
        return _baseline_experts(ep, recv_RD, local)
    groups = _Offsets(local.offsets)
    if impl in ("torch", "fbgemm"):
        xs = X.move_rows(recv_RD, local.row_of_sorted, local.sorted_of_row.view(-1, 1))
        h = moe.grouped_mm(xs, ep.in_proj.mT, local.offsets, local.expert_of_sorted)
        a = moe._activation(h, gated)
        return moe.grouped_mm(a, ep.out_proj.mT, local.offsets, local.expert_of_sorted)
    if impl == "mxfp8" or record:  # the unfused chain (training, and mxfp8 always)
        mm = moe._mm_mxfp8 if impl == "mxfp8" else moe._mm_kernels
        xs = X.move_rows(recv_RD, local.row_of_sorted, local.sorted_of_row.view(-1, 1))
        h = mm(xs, ep.in_proj.mT, groups)
        return mm(expert_activation(h, gated), ep.out_proj.mT, groups)
    # triton_* without autograd: moe._fused_experts on the received rows
    act = None if gated else "silu"
    h = gather_grouped_mm(recv_RD, ep.in_proj, local.offsets, local.row_of_sorted, activation=act)
    if gated:
        h = expert_activation(h, gated=True)
    if moe._grouped_mm_supported(h, ep.out_proj.mT):
        return moe.grouped_mm(h, ep.out_proj.mT, local.offsets, local.expert_of_sorted)
    return gather_grouped_mm(h, ep.out_proj, local.offsets)


def _baseline_experts(
    ep: ExpertParallelMoE, recv_RD: torch.Tensor, local: X.LocalPlan
) -> torch.Tensor:
    """``moe._forward_baseline``'s experts: fp32 GEMMs per expert block, fp32 rows out."""
    import torch.nn.functional as F

    xs = X.move_rows(recv_RD, local.row_of_sorted, local.sorted_of_row.view(-1, 1)).float()
    bounds = local.host_offsets
    if bounds is None:
        bounds = local.offsets.tolist()  # the baseline syncs anyway
    out = [xs.new_zeros(0, ep.layer.d_model)]
    for l in range(ep.n_local):
        rows = xs[bounds[l] : bounds[l + 1]]
        h = rows @ ep.in_proj[l].float().t()
        if ep.layer.gated:
            h = F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
        else:
            h = F.silu(h)
        out.append(h @ ep.out_proj[l].float().t())
    return torch.cat(out)


def _combine(
    layer: MoELayer, ys_PD: torch.Tensor, plan: Any, kept: Any, dtype: torch.dtype
) -> torch.Tensor:
    """The layer impl's weighted sum over each token's k choices, in choice order, fp32.
    ``kept``: the plan with dropped choices' inverse -1 (zero rows in ys_PD for the torch sum)."""
    impl = layer.impl
    if impl in ("triton_bf16", "triton_fp32", "mxfp8"):
        from moe_kernels import combine

        out_dtype = torch.bfloat16 if impl == "triton_bf16" else torch.float32
        return combine(ys_PD, kept, weighted=True, out_dtype=out_dtype).to(dtype)
    T, k = plan.inverse.shape
    inv = plan.inverse.reshape(-1)
    y_TkD = ys_PD[inv].view(T, k, ys_PD.shape[1]).float()
    w_Tk = plan.weights[inv].view(T, k)
    return (y_TkD * w_Tk.unsqueeze(-1)).sum(dim=1).to(dtype)
