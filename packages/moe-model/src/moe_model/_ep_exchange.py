"""The token exchange of ``ExpertParallelMoE``: differentiable all-to-alls and the two layouts.

W ranks each hold ``L = E // W`` contiguous experts. A rank's routing plan (over all E experts)
sorts its (token, expert) pairs by expert, so the pairs bound for rank d are one contiguous run.

* ``dropless``: the split sizes are data-dependent. The (E,) counts are exchanged on the device,
  then read on the host once (``DroplessLayout.build``: the only host sync of the layer) to size
  the row exchange. Received rows come grouped by (source rank, local expert, token); the local
  grouped GEMMs want (local expert, source rank, token), a permutation found on the device.
* ``padded``: every (source rank, expert) gets a static capacity of C rows (``PaddedLayout``):
  pairs are packed in a (W, L, C) slot grid by (expert, token) order and the ones past C
  dropped; fixed split sizes, so no host sync and the forward can be captured in a CUDA graph.

Rows move by ``expert_ops.move_rows`` (a gather whose backward is the inverse gather, one row
each: exact) or ``all_to_all`` (backward: the reverse all-to-all); every index is built by
sorts, cumsums and scatters to unique positions: deterministic, no atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_kernels import RoutingPlan

# ---------------------------------------------------------------------------------------------
# Collectives


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; backward: the reverse all-to-all of the gradient rows."""

    @staticmethod
    def forward(ctx, x_ND, anchor, out_rows, in_rows, group):  # anchor: see all_to_all_rows
        ctx.out_rows, ctx.in_rows, ctx.group = out_rows, in_rows, group
        return _all_to_all(x_ND, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx, grad_MD):
        grad_ND = _all_to_all(grad_MD, ctx.in_rows, ctx.out_rows, ctx.group)
        return grad_ND, None, None, None, None


def _all_to_all(
    x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], group: object
) -> torch.Tensor:
    """Rows ``in_rows[d]`` of x (in order) go to rank d; ``out_rows[s]`` rows come from rank s."""
    x_ND = x_ND.contiguous()
    out_MD = x_ND.new_empty((sum(out_rows), *x_ND.shape[1:]))
    dist.all_to_all_single(out_MD, x_ND, out_rows, in_rows, group=group)
    return out_MD


def all_to_all_rows(
    x_ND: torch.Tensor,
    out_rows: list[int],
    in_rows: list[int],
    group: object,
    record: bool,
) -> torch.Tensor:
    """Differentiable row all-to-all (``in_rows[d]`` rows of x_ND to rank d, ``out_rows[s]``
    from rank s) -> (sum(out_rows), ...). With ``record`` the node is always put on the tape,
    even when x needs no gradient on this rank, so that every rank runs the reverse exchange
    in backward (a rank skipping it would leave the others waiting)."""
    if not record:
        with torch.no_grad():
            return _all_to_all(x_ND, out_rows, in_rows, group)
    anchor = torch.empty(0, device=x_ND.device, requires_grad=True)
    return _AllToAll.apply(x_ND, anchor, out_rows, in_rows, group)


def gather_counts(counts_E: torch.Tensor, world: int, group: object) -> torch.Tensor:
    """(W, E) int32: row s = rank s's (E,) pair counts, on the device: an all-gather as one
    equal-split ``all_to_all_single`` (which gloo and NCCL take in every supported torch)."""
    if world == 1:
        return counts_E.view(1, -1)
    send = counts_E.repeat(world).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(world, -1)


# ---------------------------------------------------------------------------------------------
# The receiving side: the local plan of the grouped GEMMs


class LocalPlan(NamedTuple):
    """The rows a rank's L experts run, R of them, in (local expert, source, token) order.

    offsets:       (L+1,) int32 device: group bounds of the grouped GEMMs.
    host_offsets:  (L+1,) Python ints, or None where only the device knows them.
    row_of_sorted: (R,) int32: the received row each sorted row reads.
    sorted_of_row: (R,) int32: the sorted row of each received row (the inverse).
    expert_of_sorted: (R,) int32: the local expert of each sorted row.
    """

    offsets: torch.Tensor
    host_offsets: list[int] | None
    row_of_sorted: torch.Tensor
    sorted_of_row: torch.Tensor
    expert_of_sorted: torch.Tensor

    @property
    def rows(self) -> int:
        return self.row_of_sorted.shape[0]


def _exclusive_cumsum(x_N: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x_N, 0) - x_N


class DroplessLayout(NamedTuple):
    """Host split sizes of the two row exchanges and the receiver's local plan (dropless)."""

    send_rows: list[int]  # (W,) rows this rank sends to each rank
    recv_rows: list[int]  # (W,) rows it receives from each rank
    local: LocalPlan

    @staticmethod
    def build(counts_WE: torch.Tensor, rank: int, n_local: int, pairs: int) -> DroplessLayout:
        """From the gathered counts (``gather_counts``), read on the host: the one sync of the
        dropless mode. A single rank (W = 1) needs none: it keeps its ``pairs`` = T*k rows."""
        W, E = counts_WE.shape
        L = n_local
        lo = rank * L
        recv_WL = counts_WE[:, lo : lo + L].long()
        if W == 1:
            send_rows, recv_rows, host_offsets, R = [pairs], [pairs], None, pairs
        else:
            counts = counts_WE.tolist()  # the host sync
            send_rows = [sum(counts[rank][d * L : (d + 1) * L]) for d in range(W)]
            recv = [row[lo : lo + L] for row in counts]
            recv_rows = [sum(row) for row in recv]
            host_offsets = [0]
            for l in range(L):
                host_offsets.append(host_offsets[-1] + sum(recv[s][l] for s in range(W)))
            R = host_offsets[-1]
        return DroplessLayout(send_rows, recv_rows, _local_plan(recv_WL, R, host_offsets))


def _local_plan(recv_WL: torch.Tensor, rows: int, host_offsets: list[int] | None) -> LocalPlan:
    """The permutation from receive order (source, expert, token) to (expert, source, token)."""
    W, L = recv_WL.shape
    dev = recv_WL.device
    recv_start_WL = _exclusive_cumsum(recv_WL.reshape(-1)).view(W, L)
    by_expert_LW = recv_WL.t().reshape(-1)
    sorted_end_B = torch.cumsum(by_expert_LW, 0)  # B = L*W blocks in (expert, source) order
    j_R = torch.arange(rows, device=dev)
    block_R = torch.searchsorted(sorted_end_B, j_R, right=True).clamp(max=L * W - 1)
    l_R, s_R = block_R // W, block_R % W
    row_R = recv_start_WL[s_R, l_R] + (j_R - (sorted_end_B - by_expert_LW)[block_R])
    inv_R = torch.empty_like(row_R).scatter_(0, row_R, j_R)
    offsets = torch.cat([recv_WL.new_zeros(1), torch.cumsum(recv_WL.sum(0), 0)])
    return LocalPlan(
        offsets.to(torch.int32),
        host_offsets,
        row_R.to(torch.int32),
        inv_R.to(torch.int32),
        l_R.to(torch.int32),
    )


# ---------------------------------------------------------------------------------------------
# Padded: static slots


class PaddedLayout(NamedTuple):
    """The sender's packing of its P = T*k pairs into E*C slots (slot e*C + q: the q-th pair of
    expert e, by token), C rows per (source rank, expert), and the receiver's local plan.

    slot_P:      (P,) int32: each sorted pair's slot, -1 when dropped (q >= C).
    slot_TK:     (T, k) int32: the slot of token t's j-th choice, -1 when dropped.
    token_of_slot: (E*C,) int32: the token a slot holds, -1 for padding.
    pair_of_slot:  (E*C, 1) int32: the sorted pair a slot holds, -1 for padding.
    dropped:     () int64 device: pairs past capacity.
    """

    slot_P: torch.Tensor
    slot_TK: torch.Tensor
    token_of_slot: torch.Tensor
    pair_of_slot: torch.Tensor
    dropped: torch.Tensor
    local: LocalPlan

    @staticmethod
    def build(plan: RoutingPlan, n_experts: int, capacity: int, world: int) -> PaddedLayout:
        E, C, W = n_experts, capacity, world
        L = E // W
        dev = plan.inverse.device
        P = plan.token_indices.shape[0]
        p_P = torch.arange(P, device=dev)
        e_P = plan.expert_indices.long()
        q_P = p_P - plan.offsets.long()[e_P.clamp(min=0)]
        keep_P = (e_P >= 0) & (q_P < C)
        slot_P = torch.where(keep_P, e_P * C + q_P, -1)
        # Scatter to unique positions: kept pairs to their slot, dropped ones past the grid.
        where_P = torch.where(keep_P, slot_P, E * C + p_P)
        tok = torch.full((E * C + P,), -1, dtype=torch.long, device=dev)
        tok = tok.scatter(0, where_P, plan.token_indices.long())[: E * C]
        pair = torch.full((E * C + P,), -1, dtype=torch.long, device=dev)
        pair = pair.scatter(0, where_P, p_P)[: E * C]
        inv_TK = plan.inverse.long()
        slot_TK = torch.where(inv_TK >= 0, slot_P[inv_TK.clamp(min=0)], -1)
        dropped = (~keep_P).sum()
        # Receiver: rows arrive as (source, expert, slot); the GEMMs read (expert, source, slot).
        R = W * L * C
        j_R = torch.arange(R, device=dev)
        l_R, rest = j_R // (W * C), j_R % (W * C)
        s_R, c_R = rest // C, rest % C
        row_R = s_R * (L * C) + l_R * C + c_R
        inv_R = torch.empty_like(row_R).scatter_(0, row_R, j_R)
        offsets = torch.arange(L + 1, device=dev, dtype=torch.int32) * (W * C)
        local = LocalPlan(
            offsets,
            [l * W * C for l in range(L + 1)],
            row_R.to(torch.int32),
            inv_R.to(torch.int32),
            l_R.to(torch.int32),
        )
        i32 = torch.int32
        return PaddedLayout(
            slot_P.to(i32),
            slot_TK.to(i32),
            tok.to(i32),
            pair.to(i32).view(E * C, 1),
            dropped,
            local,
        )
