"""``ExpertParallelMoE``: one ``MoELayer`` sharded by experts over the W ranks of a process group.

Rank r keeps the router (and the expert bias and shared experts) replicated and only its
contiguous experts ``[r * E // W, (r + 1) * E // W)``. ``forward(x)`` of the rank's own tokens is
the layer's own walk (``MoELayer.run``: the implementation's route, experts and combine of
``moe_model.impls``) with this rank's experts, and this module as the exchange between them:

* ``to_experts``: the (E,) counts of every rank gathered on the device (one small all-to-all),
  each pair's token row sent to the rank owning its expert (``all_to_all_single``) in one of two
  modes (``_ep_exchange``): ``"dropless"`` (exact; split sizes read on the host: one host sync
  per forward) or ``"padded"`` (C rows per (source rank, expert), no host sync, CUDA-graph
  capturable; pairs past C dropped and counted in ``dropped``); the rows received handed to the
  experts grouped by local expert;
* ``from_experts``: the outputs sent back (the reverse all-to-all) in the plan's pair order,
  dropped choices marked -1 in the plan's inverse.

With nothing dropped the output equals the single-process layer's on the same tokens. Backward
runs through both exchanges to x, the router and the local experts; every rank must run it (a
collective per exchange).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from moe_kernels import RoutingPlan
from moe_model._checks import check_device
from moe_model._ep_exchange import (
    DroplessLayout,
    LocalPlan,
    PaddedLayout,
    all_to_all_rows,
    gather_counts,
)
from moe_model.expert_ops import ExpertRows, move_rows
from moe_model.impls import IMPLS
from moe_model.moe import MoELayer

EP_MODES: tuple[str, ...] = ("dropless", "padded")


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


def _check_expert_parallel(layer: MoELayer) -> None:
    if layer.has_features:
        raise ValueError(
            "layer has expert biases, another activation or the weight on the input "
            "(moe_model.expert_features): ExpertParallelMoE runs plain experts only"
        )
    impl = layer.impl
    reason = IMPLS[impl].refuses_expert_parallel
    if reason:
        raise ValueError(
            f"impl {impl!r} has no expert-parallel path ({reason}); wrap a layer of another impl"
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


class Sent(NamedTuple):
    """``to_experts``' hand-over: the experts' input (``rows``), the group's (E,) counts the
    layer records (``counts``), and what ``from_experts`` needs to bring the outputs back."""

    rows: ExpertRows
    counts: torch.Tensor
    plan: RoutingPlan
    send_rows: list[int]  # (W,) rows this rank sent to each rank
    recv_rows: list[int]  # (W,) rows it received from each rank
    local: LocalPlan
    padded: PaddedLayout | None


class ExpertParallelMoE(nn.Module):
    """A ``MoELayer`` whose experts are split over the W ranks of ``group`` (default: the
    default group; none initialised: a single rank, no collectives).

    Args:
        layer: a full ``MoELayer`` (any options; any impl but ``fbgemm``), the same on every
            rank. This module takes ownership of it (``MoELayer.give_experts``): it becomes
            ``self.layer`` (router, expert bias and shared experts, replicated), its experts
            move here as this rank's slices ``in_proj`` (L, H', D) / ``out_proj`` (L, D, H),
            L = E // W, and the full tensors are freed. Calling the layer alone then raises
            RuntimeError; wrapping it again ValueError.
        mode: ``"dropless"`` or ``"padded"`` (see the module doc); can be changed later.
        capacity_factor: padded mode: C = min(ceil(capacity_factor * T * k / E), T) rows per
            (source rank, expert), T = ``tokens_per_rank`` or else the input's row count.
            ``capacity_factor >= E / k`` never drops.
        tokens_per_rank: padded mode: the static token count C is sized for; every rank's input
            may then hold any number of tokens up to it (uneven counts, zero). Without it C
            comes from each call's row count, which must then be the same on every rank.

    State after each forward: ``local_counts`` (E,) int32 (this rank's pairs per expert),
    ``last_counts`` (E,) int32 (the group's: ``layer.last_counts``, so ``update_expert_bias``
    moves the replicated bias identically on every rank), ``dropped`` (0-d int64 device tensor:
    this rank's pairs dropped by the padded mode), ``aux_loss`` (``layer.aux_loss``: the Switch
    loss of this rank's tokens, or None), ``last_send_rows`` (host list: rows sent to each rank,
    the padding included).
    """

    local_counts: torch.Tensor
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
        _check_expert_parallel(layer)
        _check_mode(mode, capacity_factor, tokens_per_rank)
        group, W, rank = _group_size(group)
        _check_split(layer.n_experts, W)
        L = layer.n_experts // W
        local = []
        for full in layer.give_experts(type(self).__name__):  # this rank's slices; the rest freed
            w = full.detach()[rank * L : (rank + 1) * L].clone()
            local.append(nn.Parameter(w, requires_grad=full.requires_grad))
        self._setup(layer, *local, group, W, rank, mode, capacity_factor, tokens_per_rank)

    def _setup(
        self,
        layer: MoELayer,
        in_proj: nn.Parameter,
        out_proj: nn.Parameter,
        group: object,
        world: int,
        rank: int,
        mode: str,
        capacity_factor: float,
        tokens_per_rank: int | None,
    ) -> None:
        """Hold ``layer`` (its experts given away) and this rank's experts."""
        self.group, self.world_size, self.rank = group, world, rank
        self.mode, self.capacity_factor = mode, capacity_factor
        self.tokens_per_rank = tokens_per_rank
        self.n_local = layer.n_experts // world
        self.expert_start, self.expert_end = rank * self.n_local, (rank + 1) * self.n_local
        self._backend = dist.get_backend(group) if world > 1 else None
        self.layer, self.in_proj, self.out_proj = layer, in_proj, out_proj
        E, dev = layer.n_experts, layer.router.weight.device
        self.register_buffer(
            "local_counts", torch.zeros(E, dtype=torch.int32, device=dev), persistent=False
        )
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        self.register_buffer("dropped", zero, persistent=False)
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
        ``expert_weights(seed, e, ...)``. ``device`` and ``dtype`` are checked as MoELayer's
        (before anything is built)."""
        device = check_device(device)
        _check_mode(mode, capacity_factor, tokens_per_rank)
        for name, v in (("n_experts", n_experts), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        pg, W, rank = _group_size(group)
        _check_split(n_experts, W)
        # Every check of MoELayer, no memory; then everything but the experts on the CPU.
        layer = MoELayer(d_model, n_experts, top_k, hidden, device="meta", dtype=dtype, **options)
        _check_expert_parallel(layer)
        meta_in, meta_out = layer.give_experts(cls.__name__)
        layer.to_empty(device="cpu")
        for buf in layer.buffers():  # (reset_parameters zeroes the ones it knows)
            buf.zero_()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layer.reset_parameters()  # (not the experts: they are no longer the layer's)
        L = n_experts // W
        pairs = [
            expert_weights(seed, e, meta_in.shape[1], d_model, hidden)
            for e in range(rank * L, (rank + 1) * L)
        ]
        w_in = torch.stack([p[0] for p in pairs]).to(device=device, dtype=meta_in.dtype)
        w_out = torch.stack([p[1] for p in pairs]).to(device=device, dtype=meta_out.dtype)
        layer = layer.to(device) if device is not None else layer
        ep = cls.__new__(cls)
        nn.Module.__init__(ep)
        experts = nn.Parameter(w_in), nn.Parameter(w_out)
        ep._setup(layer, *experts, pg, W, rank, mode, capacity_factor, tokens_per_rank)
        return ep

    # -----------------------------------------------------------------------------------------

    @property
    def impl(self) -> str:
        return self.layer.impl

    @property
    def last_counts(self) -> torch.Tensor:
        return self.layer.last_counts

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return self.layer.aux_loss

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
        """x (..., d_model) as the layer checks it, the group's backend, the mode and the impl,
        all before any collective -> x_TD."""
        x_TD = self.layer.check_x(x)
        if self.world_size > 1:
            backend = str(self._backend)
            if "nccl" in backend and "gloo" not in backend and not x_TD.is_cuda:
                raise ValueError(f"the group's backend {backend} needs CUDA tensors, x is on CPU")
            if backend == "gloo" and x_TD.device.type != "cpu":
                raise ValueError(
                    f"the group's backend gloo exchanges CPU tensors, x is on {x_TD.device}"
                )
        _check_mode(self.mode, self.capacity_factor, self.tokens_per_rank)
        limit = self.tokens_per_rank
        if self.mode == "padded" and limit is not None and x_TD.shape[0] > limit:
            raise ValueError(f"x has {x_TD.shape[0]} tokens, more than tokens_per_rank={limit}")
        _check_expert_parallel(self.layer)
        return x_TD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., d_model) in x's dtype for this rank's tokens x (..., d_model)."""
        x_TD = self._check_x(x)
        guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
        with guard:
            y_TD = self.layer.run(x_TD, self, self.in_proj, self.out_proj)
        return y_TD.view(x.shape)

    # -----------------------------------------------------------------------------------------
    # The exchange (MoELayer.run calls these two)

    def to_experts(self, x_TD: torch.Tensor, plan: RoutingPlan, record: bool) -> Sent:
        """Send each pair's row x_TD[t] to the rank of its expert; the rows this rank received,
        grouped by local expert, are the experts' input."""
        T = x_TD.shape[0]
        counts_WE = gather_counts(plan.counts, self.world_size, self.group)
        with torch.no_grad():
            self.local_counts.copy_(plan.counts)
        padded = None
        if self.mode == "dropless":
            lay = DroplessLayout.build(counts_WE, self.rank, self.n_local, T * self.layer.top_k)
            send_rows, recv_rows, local = lay.send_rows, lay.recv_rows, lay.local
            send_ND = move_rows(x_TD, plan.token_indices, plan.inverse)
            self.dropped.zero_()
        else:
            C = self.capacity(T)
            padded = PaddedLayout.build(plan, self.layer.n_experts, C, self.world_size)
            send_rows = recv_rows = [self.n_local * C] * self.world_size
            local = padded.local
            send_ND = move_rows(x_TD, padded.token_of_slot, padded.slot_TK)
            with torch.no_grad():
                self.dropped.copy_(padded.dropped)
        self.last_send_rows = list(send_rows)
        recv_RD = self._exchange(send_ND, recv_rows, send_rows, record)
        rows = ExpertRows(
            recv_RD,
            local.row_of_sorted,
            local.sorted_of_row.view(-1, 1),
            local.offsets,
            local.expert_of_sorted,
            local.host_offsets,
        )
        counts_E = counts_WE.sum(0, dtype=torch.int32)
        return Sent(rows, counts_E, plan, send_rows, recv_rows, local, padded)

    def from_experts(
        self, ys_RD: torch.Tensor, sent: Sent, record: bool
    ) -> tuple[torch.Tensor, RoutingPlan]:
        """The experts' outputs back to the ranks of their tokens -> (outputs in the plan's pair
        order, the plan with dropped choices' inverse -1)."""
        local = sent.local
        ys_recv = move_rows(ys_RD, local.sorted_of_row, local.row_of_sorted.view(-1, 1))
        back_ND = self._exchange(ys_recv, sent.send_rows, sent.recv_rows, record)
        if sent.padded is None:
            return back_ND, sent.plan
        pad, plan = sent.padded, sent.plan
        ys_PD = move_rows(back_ND, pad.slot_P, pad.pair_of_slot)
        return ys_PD, plan._replace(inverse=torch.where(pad.slot_TK >= 0, plan.inverse, -1))

    def _exchange(
        self, x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], record: bool
    ) -> torch.Tensor:
        if self.world_size == 1:
            return x_ND
        return all_to_all_rows(x_ND, out_rows, in_rows, self.group, record)

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
