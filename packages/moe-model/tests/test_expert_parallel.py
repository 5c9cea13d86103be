"""ExpertParallelMoE on CPU: gloo process groups of 1, 2 and 4 ranks (``torch.multiprocessing``
spawn, one group per world size, every case inside it), each rank's forward and backward
against the single-process MoELayer on that rank's tokens (x, router and shared-expert
gradients) and on the whole group's tokens (expert gradients, counts); a rank with no tokens,
uneven token counts, gated and plain layers, every impl, the routing options, the padded mode
with and without drops (against a per-token oracle that drops the same pairs), from_config, and
the configuration errors (raised before any collective).

Tolerances, ``max |a - b| / max |b|``: bitwise where the shapes match the single-process layer's
(one rank, dropless), else ``TOL`` (1e-6: the CPU reference GEMMs of an expert's rows round
differently when that expert's block holds other rows: 1-3 ulp measured) and ``TOL_BF16`` for
triton_bf16, whose combine rounds to bf16 (one bf16 ulp of a value may flip).
"""

from __future__ import annotations

import copy
import datetime
import importlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moe_model import IMPLS, MoELayer
from moe_model.expert_parallel import ExpertParallelMoE, expert_weights

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo"
)

D, E, H = 32, 8, 16
TOL, TOL_BF16, TOL_ORACLE = 1e-6, 1e-2, 1e-5
TOKENS = {1: [7], 2: [9, 0], 4: [5, 0, 11, 3]}  # tokens per rank: uneven, one rank with none

# (name, MoELayer kwargs, mode, capacity_factor): every case runs forward + backward.
CASES = [
    ("plain", dict(top_k=2, impl="triton_fp32"), "dropless", 1.0),
    (
        "gated-bf16-options",
        dict(
            top_k=3,
            gated=True,
            renormalize=True,
            impl="triton_bf16",
            expert_bias=True,
            n_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.0,
            n_shared_experts=1,
            aux_loss_coef=0.01,
        ),
        "dropless",
        1.0,
    ),  # fmt: skip
    ("torch-gated", dict(top_k=2, gated=True, impl="torch", score_fn="sigmoid"), "dropless", 1.0),
    ("baseline", dict(top_k=2, impl="baseline", renormalize=True), "dropless", 1.0),
    ("mxfp8", dict(top_k=2, impl="mxfp8", hidden=32), "dropless", 1.0),
    ("padded", dict(top_k=2, gated=True, impl="triton_fp32"), "padded", E / 2),
    ("padded-torch", dict(top_k=3, impl="torch", n_shared_experts=1), "padded", E / 3),
]


def _layer(seed: int = 0, **kw) -> MoELayer:
    kw = {"hidden": H, **kw}
    torch.manual_seed(seed)
    layer = MoELayer(D, E, kw.pop("top_k"), kw.pop("hidden"), **kw)
    if layer.expert_bias is not None:  # a bias that changes the routing
        layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    return layer


def _inputs(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's tokens and output gradients (the same on every rank: one generator)."""
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(t, D, generator=gen) for t in TOKENS[world]]
    return xs, [torch.randn(t, D, generator=gen) for t in TOKENS[world]]


def _run(module, x, dy, params):
    """y, and the gradients of x and of ``params`` (names) for the upstream gradient dy."""
    module.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    y = module(xx)
    loss = (y * dy).sum()
    aux = getattr(module, "aux_loss", None)
    if aux is not None:
        loss = loss + aux
    loss.backward()
    named = dict(module.named_parameters())
    return y.detach(), xx.grad, {n: named[n].grad for n in params}


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().float(), b.detach().float()
    diff, scale = float((a - b).abs().max()), float(b.abs().max())
    return diff / scale if scale > 0 else diff


class Checks:
    """Collects failures instead of raising: every rank runs the same collectives to the end."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failures = rank, []

    def close(self, what: str, a, b, tol: float) -> None:
        err = _rel(a, b)
        if a is None and b is None:
            ok = True
        elif tol == 0.0:
            ok = a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)
        else:
            ok = err <= tol
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}: rel err {err:.3g} (tol {tol})")

    def true(self, what: str, cond: bool) -> None:
        if not cond:
            self.failures.append(f"rank {self.rank}: {what}")

    def raises(self, what: str, exc: type, fn) -> None:
        try:
            fn()
        except exc:
            return
        except Exception as other:  # noqa: BLE001 (reported, not raised)
            self.failures.append(f"rank {self.rank}: {what}: {type(other).__name__}: {other}")
            return
        self.failures.append(f"rank {self.rank}: {what}: no {exc.__name__}")


def _case(checks: Checks, world: int, rank: int, name: str, kw: dict, mode: str, cf: float):
    xs, dys = _inputs(world)
    full = _layer(**kw)
    ep = ExpertParallelMoE(
        copy.deepcopy(full), mode=mode, capacity_factor=cf, tokens_per_rank=max(TOKENS[world])
    )
    replicated = [n for n, _ in full.named_parameters() if n not in ("in_proj", "out_proj")]
    y, dx, g = _run(ep, xs[rank], dys[rank], ["in_proj", "out_proj"])
    g.update(
        (n, p.grad) for n, p in ep.layer.named_parameters() if n in replicated
    )  # this rank's tokens' share of the replicated gradients
    ref = copy.deepcopy(full)
    y_ref, dx_ref, g_ref = _run(ref, xs[rank], dys[rank], replicated)
    one_shape = world == 1 and mode == "dropless"
    tol = TOL_BF16 if kw["impl"] == "triton_bf16" else TOL
    # One rank, dropless: the same forward bit for bit. The gradients reaching x and the router
    # differ by rounding: the layer's local walk runs its experts and combine as one node
    # (router weight applied after the data-gradient GEMM), the exchange keeps them apart.
    checks.close(f"{name}: y", y, y_ref, 0.0 if one_shape else tol)
    checks.close(f"{name}: dx", dx, dx_ref, tol)
    for n in replicated:
        checks.close(f"{name}: d {n}", g[n], g_ref[n], tol)
    checks.close(f"{name}: local_counts", ep.local_counts, ref.last_counts, 0.0)
    checks.close(f"{name}: aux_loss", ep.aux_loss, ref.aux_loss, tol)
    checks.true(f"{name}: dropped {int(ep.dropped)}", int(ep.dropped) == 0)
    # Expert gradients and the counts: the whole group's tokens through one layer.
    whole = copy.deepcopy(full)
    whole.aux_loss_coef = 0.0
    _, _, g_all = _run(whole, torch.cat(xs), torch.cat(dys), ["in_proj", "out_proj"])
    lo, hi = ep.expert_start, ep.expert_end
    for n in ("in_proj", "out_proj"):  # (the aux loss reaches the router only)
        checks.close(f"{name}: d {n}", g[n], g_all[n][lo:hi], tol)
    checks.close(f"{name}: last_counts", ep.last_counts, whole.last_counts, 0.0)
    checks.close(f"{name}: layer.last_counts", ep.layer.last_counts, whole.last_counts, 0.0)
    # Same inputs, same bits.
    y2, dx2, g2 = _run(ep, xs[rank], dys[rank], ["in_proj", "out_proj"])
    checks.close(f"{name}: repeat y", y2, y, 0.0)
    checks.close(f"{name}: repeat dx", dx2, dx, 0.0)
    checks.close(f"{name}: repeat d in_proj", g2["in_proj"], g["in_proj"], 0.0)
    if ep.layer.expert_bias is not None:  # the replicated bias moves the same on every rank
        ep.update_expert_bias(0.01)
        whole.update_expert_bias(0.01)
        checks.close(f"{name}: expert_bias step", ep.layer.expert_bias, whole.expert_bias, 0.0)


def _oracle(layer: MoELayer, x_TD: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per token in fp32 torch ops: route's choices and weights, a pair kept when fewer than
    ``capacity`` earlier tokens of this rank chose that expert (differentiable in x and the
    weights)."""
    from moe_kernels import route

    plan = route(layer.scores(x_TD), layer.top_k, **layer.route_options())
    T = x_TD.shape[0]
    weights = plan.weights[plan.inverse.reshape(-1)].view(T, layer.top_k)
    seen = [0] * layer.n_experts
    rows = []
    for t in range(T):
        y = x_TD.new_zeros(D)
        for j in range(layer.top_k):
            e = int(plan.expert_indices[plan.inverse[t, j]])
            keep = seen[e] < capacity
            seen[e] += 1
            if keep:
                h = F.silu(x_TD[t] @ layer.in_proj[e].t())
                y = y + weights[t, j] * (h @ layer.out_proj[e].t())
        rows.append(y)
    return torch.stack(rows) if rows else x_TD.new_zeros(0, D)


def _drops(checks: Checks, world: int, rank: int) -> None:
    """Padded mode with drops against the oracle: y, dx, the expert gradients, ``dropped``."""
    xs, dys = _inputs(world)
    kw = dict(top_k=2, impl="triton_fp32")
    full = _layer(seed=5, **kw)
    T_max = max(TOKENS[world])
    ep = ExpertParallelMoE(
        copy.deepcopy(full), mode="padded", capacity_factor=0.5, tokens_per_rank=T_max
    )
    C = ep.capacity(T_max)
    y, dx, g = _run(ep, xs[rank], dys[rank], ["in_proj", "out_proj"])
    ref = copy.deepcopy(full).requires_grad_(True)
    xx = [x.clone().requires_grad_() for x in xs]
    outs = [_oracle(ref, x, C) for x in xx]
    sum((o * dy).sum() for o, dy in zip(outs, dys, strict=True)).backward()
    checks.close("drops: y", y, outs[rank].detach(), TOL_ORACLE)
    dx_ref = xx[rank].grad if xx[rank].grad is not None else torch.zeros_like(xs[rank])  # T = 0
    checks.close("drops: dx", dx, dx_ref, TOL_ORACLE)
    lo, hi = ep.expert_start, ep.expert_end
    checks.close("drops: d in_proj", g["in_proj"], ref.in_proj.grad[lo:hi], TOL_ORACLE)
    checks.close("drops: d out_proj", g["out_proj"], ref.out_proj.grad[lo:hi], TOL_ORACLE)
    from moe_kernels import route

    counts = route(full.scores(xs[rank]), 2).counts.long()
    want = int((counts - C).clamp(min=0).sum())
    checks.true(f"drops: dropped {int(ep.dropped)} != {want}", int(ep.dropped) == want)
    total = torch.tensor([int(ep.dropped)])
    if world > 1:
        dist.all_reduce(total)
    checks.true("drops: some pair dropped in the group", int(total) > 0)


def _from_config(checks: Checks, world: int, rank: int) -> None:
    """Only the local experts allocated; the model the same for any world size (a one-rank
    group of each rank builds the whole of it); its forward equals a full MoELayer's."""
    kw = dict(gated=True, impl="triton_fp32", n_shared_experts=1, expert_bias=True)
    mine = None
    for r in range(world):  # every rank creates every subgroup, in the same order
        g = dist.new_group([r]) if world > 1 else None
        mine = g if r == rank else mine
    ep = ExpertParallelMoE.from_config(D, E, 2, H, seed=3, **kw)
    alone = ExpertParallelMoE.from_config(D, E, 2, H, mine, seed=3, **kw)
    L = E // world
    checks.true("from_config: local experts", tuple(ep.in_proj.shape) == (L, 2 * H, D))
    checks.true("from_config: one-rank group", alone.world_size == 1 and alone.n_local == E)
    lo, hi = ep.expert_start, ep.expert_end
    checks.close("from_config: in_proj", ep.in_proj, alone.in_proj[lo:hi], 0.0)
    checks.close("from_config: out_proj", ep.out_proj, alone.out_proj[lo:hi], 0.0)
    w_in, w_out = expert_weights(3, lo, 2 * H, D, H)
    checks.close("from_config: expert_weights", ep.in_proj[0].detach(), w_in, 0.0)
    pairs = zip(ep.layer.state_dict().items(), alone.layer.state_dict().values(), strict=True)
    for (n, a), b in pairs:
        checks.close(f"from_config: replicated {n}", a, b, 0.0)
    full = MoELayer(D, E, 2, H, **kw)
    full.load_state_dict(
        {**alone.layer.state_dict(), "in_proj": alone.in_proj, "out_proj": alone.out_proj}
    )
    xs, _ = _inputs(world)
    with torch.no_grad():
        checks.close("from_config: y", ep(xs[rank]), full(xs[rank]), 0.0 if world == 1 else TOL)


def _errors(checks: Checks, world: int, rank: int) -> None:
    """Configuration and input errors, raised locally before any collective: rank 0 alone
    makes the bad calls, then every rank runs a good forward (a collective left open by a bad
    call would hang or corrupt it)."""
    bad_E = 6 if world == 4 else (3 if world == 2 else None)
    if bad_E is not None:
        checks.raises("E % W", ValueError, lambda: ExpertParallelMoE(MoELayer(D, bad_E, 2, H)))
        checks.raises(
            "from_config E % W", ValueError, lambda: ExpertParallelMoE.from_config(D, bad_E, 2, H)
        )
    ep = ExpertParallelMoE(_layer(top_k=2, impl="triton_fp32"), mode="padded", tokens_per_rank=12)
    if rank == 0:
        layer = _layer(top_k=2)
        for what, exc, kw in [
            ("mode", ValueError, dict(mode="sparse")),
            ("mode type", TypeError, dict(mode=1)),
            ("capacity_factor 0", ValueError, dict(capacity_factor=0.0)),
            ("capacity_factor < 0", ValueError, dict(capacity_factor=-1.0)),
            ("capacity_factor inf", ValueError, dict(capacity_factor=float("inf"))),
            ("capacity_factor type", TypeError, dict(capacity_factor="1.5")),
            ("tokens_per_rank < 0", ValueError, dict(tokens_per_rank=-1)),
            ("tokens_per_rank type", TypeError, dict(tokens_per_rank=2.0)),
            ("group type", TypeError, dict(group="world")),
        ]:
            checks.raises(what, exc, lambda kw=kw: ExpertParallelMoE(layer, **kw))
        checks.raises("layer type", TypeError, lambda: ExpertParallelMoE(torch.nn.Linear(2, 2)))
        wrapped = ExpertParallelMoE(layer)
        checks.raises("wrapped twice", ValueError, lambda: ExpertParallelMoE(wrapped.layer))
        checks.raises("x type", TypeError, lambda: ep([[1.0] * D]))
        checks.raises("x shape", ValueError, lambda: ep(torch.randn(3, D + 1)))
        checks.raises("x 0-d", ValueError, lambda: ep(torch.tensor(1.0)))
        checks.raises("x device", ValueError, lambda: ep(torch.randn(3, D, device="meta")))
        checks.raises("x dtype", TypeError, lambda: ep(torch.randn(3, D, dtype=torch.float64)))
        checks.raises("x too many tokens", ValueError, lambda: ep(torch.randn(13, D)))
        ep.mode = "dense"
        checks.raises("mode set later", ValueError, lambda: ep(torch.randn(3, D)))
        ep.mode = "padded"
    xs, _ = _inputs(world)
    with torch.no_grad():
        y = ep(xs[rank].view(-1, 1, D))  # any leading shape
    checks.true("good forward after the errors", y.shape == (TOKENS[world][rank], 1, D))


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    importlib.import_module("torch._dynamo")  # before the group: docs/expert_parallel.md, limits
    dist.init_process_group("gloo", store, rank=rank, world_size=world, timeout=timeout)
    checks = Checks(rank)
    try:
        for name, kw, mode, cf in CASES:
            _case(checks, world, rank, name, kw, mode, cf)
        _drops(checks, world, rank)
        _from_config(checks, world, rank)
        _errors(checks, world, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not checks.failures, "\n".join(checks.failures)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_matches_the_layer(world, tmp_path):
    store = (tmp_path / "store").as_uri()  # the group meets in a file: no port to pick
    mp.spawn(_worker, args=(world, store), nprocs=world, join=True)


def test_single_process_without_a_group():
    """No process group initialised: one rank, no collectives, the layer's own results."""
    assert not dist.is_initialized()
    full = _layer(top_k=2, gated=True, impl="triton_fp32")
    ep = ExpertParallelMoE(copy.deepcopy(full))
    assert (
        ep.world_size == 1
        and ep.n_local == E
        and "in_proj" not in dict(ep.layer.named_parameters())
    )
    x = torch.randn(6, D)
    with torch.no_grad():
        assert torch.equal(ep(x), full(x))
    ep.mode = "padded"
    ep.capacity_factor = E / 2  # C = T: nothing dropped
    with torch.no_grad():
        y = ep(x)
    assert int(ep.dropped) == 0 and _rel(y, full(x).detach()) <= TOL
    with pytest.raises(TypeError, match="seed"):
        ExpertParallelMoE.from_config(D, E, 2, H, seed="0")
    with pytest.raises(ValueError, match="mode"):
        ExpertParallelMoE.from_config(D, E, 2, H, mode="sparse")
    assert sys.modules["moe_model.expert_parallel"].EP_MODES == ("dropless", "padded")


def test_ownership(monkeypatch):
    """The wrapper takes the layer it is given: the layer object is ``ep.layer``, its experts
    are gone from it, and alone it refuses to run or to be wrapped again. An impl without an
    expert-parallel path (fbgemm) is refused at construction, before anything is taken, and
    before any collective when switched to later."""
    assert not dist.is_initialized()
    layer = _layer(top_k=2, impl="triton_fp32")
    ep = ExpertParallelMoE(layer)
    assert ep.layer is layer and layer.experts_owner == "ExpertParallelMoE"
    assert {"in_proj", "out_proj"} <= dict(ep.named_parameters()).keys()
    x = torch.randn(5, D)
    with pytest.raises(RuntimeError, match="experts belong to an ExpertParallelMoE: call"):
        layer(x)
    with pytest.raises(ValueError, match="experts already belong to an ExpertParallelMoE"):
        ExpertParallelMoE(layer)
    monkeypatch.setattr(type(IMPLS["fbgemm"]), "available", True)
    fb = _layer(top_k=2, impl="fbgemm")
    with pytest.raises(ValueError, match="impl 'fbgemm' has no expert-parallel path"):
        ExpertParallelMoE(fb)
    assert fb.experts_owner is None and fb.in_proj.shape[0] == E  # nothing taken
    with pytest.raises(ValueError, match="impl 'fbgemm' has no expert-parallel path"):
        ExpertParallelMoE.from_config(D, E, 2, H, impl="fbgemm")
    ep.layer.impl = "fbgemm"
    with torch.no_grad(), pytest.raises(ValueError, match="no expert-parallel path"):
        ep(x)
