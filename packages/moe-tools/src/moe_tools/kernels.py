"""``moe-bench kernels``: every moe-kernels op against its torch-native version, a clone of the
same bytes, and peers (fbgemm_gpu, torchao) when importable.

For each case (an op at one shape) the rows are one per implementation: ``moe_kernels`` (the
public op: Triton on CUDA), ``torch`` (the torch-native version the op replaces), peers, and
``clone`` (``clone()`` of a buffer whose read + write bytes equal the op's). Columns: median time,
effective GB/s (bytes read + written, minimum traffic), percent of the copy ceiling (``clone`` of
a large tensor, measured once per run), ``vs_clone`` (clone time / time: 1.0 = as fast as copying
the bytes) and ``speedup`` (torch-native time / time).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from moe_tools import report
from moe_tools.report import Result, Row, short_error
from moe_tools.timing import bench_us, default_device, graph_time_fn

COLUMNS = [
    "op",
    "shape",
    "impl",
    "us",
    "gbps",
    "pct_ceiling",
    "vs_clone",
    "speedup",
    "graph_us",
    "graph_vs_clone",
    "bytes",
    "status",
]

OPS = (
    "route",
    "index_shuffling",
    "dispatch",
    "gather_scale",
    "combine",
    "scatter_add",
    "blocked_2d",
    "blocked_3d",
    "to_mxfp8",
    "to_mxfp8_dim1",
    "from_mxfp8",
)

Thunk = Callable[[], object]


@dataclass
class Case:
    """One op at one shape: callables per implementation, and the bytes one call must move."""

    op: str
    shape: str
    nbytes: int
    impls: dict[str, Thunk] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# shapes


def shapes(quick: bool) -> dict[str, list[tuple[int, ...]]]:
    """The benchmark shapes of every op: the issue's sizes, or small ones (``--quick``, CPU)."""
    if quick:
        return {
            "route": [(512, 16, 4), (1024, 128, 8)],  # (T, E, k)
            "tokens": [(512, 4, 256)],  # (T, k, D)
            "blocked_2d": [(1024, 64, 4)],  # (rows, cols, groups)
            "blocked_3d": [(4, 256, 32)],  # (E, N, C)
            "quant": [(256, 1024)],  # (M, K)
        }
    return {
        "route": [(4096, 16, 8), (4096, 128, 8), (65536, 128, 8), (1048576, 128, 8)],
        "tokens": [(65536, 8, 2048)],
        # G > 32, C not a multiple of 4 and C < 16 beside the seed shapes
        "blocked_2d": [
            *((16640, 160, 16), (131072, 224, 8), (131072, 64, 8), (524288, 256, 8)),
            *((20000, 37, 40), (131072, 3, 8), (65536, 15, 64), (8192, 8, 256)),
        ],
        "blocked_3d": [
            *((8, 2048, 224), (8, 7168, 64), (16, 4096, 64)),
            *((8, 2050, 37), (64, 512, 3), (128, 768, 15)),
        ],
        "quant": [(16384, 8192), (131072, 2048)],
    }


# ----------------------------------------------------------------------------------------------
# torch-native versions and peers


def torch_route(scores_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """What the routing kernels replace: topk, a stable sort of the expert ids, bincount."""
    weights_TK, experts_TK = torch.topk(scores_TE, top_k, dim=1)
    flat_N = experts_TK.flatten()
    _, order_N = torch.sort(flat_N, stable=True)
    counts_E = torch.bincount(flat_N, minlength=scores_TE.shape[1])
    return counts_E, order_N, flat_N[order_N], weights_TK.flatten()[order_N]


def _fbgemm_op(name: str) -> Callable[..., Any]:
    """``torch.ops.fbgemm.<name>`` after importing the module that registers it."""
    import fbgemm_gpu.experimental.gen_ai.moe  # noqa: F401

    return getattr(torch.ops.fbgemm, name)


def _torchao_layouts() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from torchao.prototype.moe_training.kernels.mxfp8 import (  # type: ignore[import-not-found]
        triton_mx_block_rearrange_2d_M_groups,
        triton_mx_block_rearrange_per_group_3d,
    )

    return triton_mx_block_rearrange_2d_M_groups, triton_mx_block_rearrange_per_group_3d


def _peer(case: Case, name: str, make: Callable[[], Thunk]) -> None:
    """Add a peer row when the peer imports and runs on these inputs; otherwise nothing."""
    try:
        fn = make()
        fn()
    except Exception:
        return
    case.impls[name] = fn


def _ours(case: Case, make: Callable[[], Thunk]) -> None:
    try:
        fn = make()
    except Exception as exc:
        case.unavailable["moe_kernels"] = short_error(exc)
        return
    case.impls["moe_kernels"] = fn


# ----------------------------------------------------------------------------------------------
# cases


def _group_ends(rows: int, groups: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """(groups,) int32 distinct multiples of 32 ending at ``rows`` (rows % 32 == 0)."""
    blocks = rows // 32
    cut = torch.randperm(blocks - 1, generator=gen, device=gen.device)[: groups - 1] + 1
    ends = torch.cat([cut.sort().values, cut.new_full((1,), blocks)]) * 32
    return ends.to(device=device, dtype=torch.int32)


def _randn_bf16(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Normal bf16 values drawn where ``gen`` lives (the GPU for the big shapes)."""
    x = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.bfloat16)
    return x.to(device)


def _random_scales(
    shape: tuple[int, ...], gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random e8m0 scale bytes."""
    u8 = torch.randint(0, 256, shape, generator=gen, device=gen.device, dtype=torch.uint8)
    return u8.to(device).view(torch.float8_e8m0fnu)


def _scores(T: int, E: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    logits = torch.randn(T, E, generator=gen, device=gen.device)
    return logits.softmax(dim=-1).to(device=device, dtype=torch.bfloat16)


def route_cases(device: torch.device, quick: bool, gen: torch.Generator) -> Iterator[Case]:
    import moe_kernels.routing as R

    for T, E, k in shapes(quick)["route"]:
        scores = _scores(T, E, gen, device)
        N = T * k
        shape = f"T={T} E={E} k={k}"
        esz = scores.element_size()
        case = Case("route", shape, T * E * esz + N * 4 * 5 + (2 * E + 1) * 4)
        _ours(case, lambda s=scores, k=k: lambda: R.route(s, k))
        case.impls["torch"] = lambda s=scores, k=k: torch_route(s, k)
        yield case

        case = Case("index_shuffling", shape, T * E * esz + N * 4 * 2 + (E + 2) * 4)
        _ours(case, lambda s=scores, k=k: lambda: R.index_shuffling(s, top_k=k))
        case.impls["torch"] = lambda s=scores, k=k: torch_route(s, k)
        _peer(
            case, "fbgemm", lambda s=scores, k=k: partial(_fbgemm_op("index_shuffling"), s, top_k=k)
        )
        yield case


def token_cases(device: torch.device, quick: bool, gen: torch.Generator) -> Iterator[Case]:
    for T, k, D in shapes(quick)["tokens"]:
        yield from _token_cases_at(T, k, D, device, gen)


def _token_cases_at(
    T: int, k: int, D: int, device: torch.device, gen: torch.Generator
) -> Iterator[Case]:
    import moe_kernels.routing as R
    import moe_kernels.tokens as Tk

    E = 16
    N = T * k
    shape = f"T={T} k={k} D={D}"
    scores = _scores(T, E, gen, device)
    x = _randn_bf16((T, D), gen, device)
    try:
        plan = R.route(scores, k)
        _, expert_idx, token_idx = R.index_shuffling(scores, top_k=k)
    except Exception as exc:  # routing missing: the token ops have no inputs
        for op in ("dispatch", "gather_scale", "combine", "scatter_add"):
            yield Case(op, shape, 0, unavailable={"moe_kernels": f"routing: {short_error(exc)}"})
        return
    tok_long = plan.token_indices.long()
    xbytes = N * D * x.element_size()

    case = Case("dispatch", shape, 2 * xbytes + N * 4)
    _ours(case, lambda: partial(Tk.dispatch, x, plan))
    case.impls["torch"] = partial(x.index_select, 0, tok_long)
    yield case

    case = Case("gather_scale", shape, 2 * xbytes + N * 4 * 3)
    _ours(case, lambda: partial(Tk.gather_scale_dense_tokens, x, token_idx, expert_idx, scores))
    tl_, el_ = token_idx.long(), expert_idx.long()
    case.impls["torch"] = lambda: x.index_select(0, tl_) * scores[tl_, el_][:, None]
    _peer(
        case,
        "fbgemm",
        lambda: partial(_fbgemm_op("gather_scale_dense_tokens"), x, token_idx, expert_idx, scores),
    )
    yield case

    y = _randn_bf16((N, D), gen, device)
    case = Case("combine", shape, xbytes + T * D * y.element_size() + N * 4 * 2)
    _ours(case, lambda: partial(Tk.combine, y, plan))
    w = plan.weights

    def torch_combine() -> torch.Tensor:
        acc = torch.zeros(T, D, device=device, dtype=torch.float32)
        return acc.index_add_(0, tok_long, y.float() * w[:, None]).to(y.dtype)

    case.impls["torch"] = torch_combine
    yield case

    out = torch.zeros(T, D, device=device, dtype=torch.float32)
    case = Case("scatter_add", shape + " bf16->fp32", xbytes + 2 * T * D * 4 + N * 4)
    _ours(case, lambda: partial(Tk.scatter_add_dense_tokens, out, y, token_idx))
    case.impls["torch"] = lambda: out.index_add_(0, tl_, y.float())
    _peer(
        case, "fbgemm", lambda: partial(_fbgemm_op("scatter_add_dense_tokens"), out, y, token_idx)
    )
    yield case


def mxfp8_cases(device: torch.device, quick: bool, gen: torch.Generator) -> Iterator[Case]:
    import moe_kernels.mxfp8 as M
    from moe_kernels._reference import mxfp8 as ref

    sz = shapes(quick)
    for rows, cols, groups in sz["blocked_2d"]:
        scale = _random_scales((rows, cols), gen, device)
        ends = _group_ends(rows, groups, gen, device)
        cols_p = -(-cols // 4) * 4
        case = Case(
            "blocked_2d",
            f"({rows},{cols}) G={groups}",
            rows * cols + (rows + 128 * groups) * cols_p + groups * 4,
        )
        _ours(case, lambda s=scale, e=ends: lambda: M.to_blocked_per_group_2d(s, e))
        case.impls["torch"] = lambda s=scale, e=ends: ref.to_blocked_per_group_2d(s, e)
        _peer(
            case,
            "torchao",
            lambda s=scale, e=ends: partial(_torchao_layouts()[0], s.view(torch.uint8), e),
        )
        yield case
    for E, N, C in sz["blocked_3d"]:
        scale = _random_scales((E, N, C), gen, device)
        out_bytes = E * (-(-N // 128) * 128) * (-(-C // 4) * 4)
        case = Case("blocked_3d", f"({E},{N},{C})", E * N * C + out_bytes)
        _ours(case, lambda s=scale: lambda: M.to_blocked_per_group_3d(s))
        case.impls["torch"] = lambda s=scale: ref.to_blocked_per_group_3d(s)
        _peer(case, "torchao", lambda s=scale: partial(_torchao_layouts()[1], s.view(torch.uint8)))
        yield case
    for m, k in sz["quant"]:
        x = _randn_bf16((m, k), gen, device)
        nbytes = m * k * 2 + m * k + m * k // 32
        for op, fn in (("to_mxfp8", "to_mxfp8"), ("to_mxfp8_dim1", "to_mxfp8_dim1")):
            case = Case(op, f"({m},{k}) bf16", nbytes)
            _ours(case, lambda x=x, fn=fn: partial(getattr(M, fn), x))
            yield case
        data, scale = ref.to_mxfp8(x)
        del x
        case = Case("from_mxfp8", f"({m},{k}) -> bf16", nbytes)
        _ours(case, lambda d=data, s=scale: partial(M.from_mxfp8, d, s))
        case.impls["torch"] = partial(ref.from_mxfp8, data, scale)
        yield case
        del data, scale


def all_cases(
    device: torch.device, quick: bool, gen: torch.Generator, ops: Sequence[str] | None = None
) -> Iterator[Case]:
    """Every case, lazily (inputs of one family live only while it is measured)."""
    families = (
        (("route", "index_shuffling"), route_cases),
        (("dispatch", "gather_scale", "combine", "scatter_add"), token_cases),
        (("blocked_2d", "blocked_3d", "to_mxfp8", "to_mxfp8_dim1", "from_mxfp8"), mxfp8_cases),
    )
    for family_ops, make in families:
        wanted = [o for o in family_ops if ops is None or o in ops]
        if not wanted:
            continue
        try:
            for case in make(device, quick, gen):
                if case.op in wanted:
                    yield case
        except ImportError as exc:
            for op in wanted:
                yield Case(op, "-", 0, unavailable={"moe_kernels": short_error(exc)})


# ----------------------------------------------------------------------------------------------
# measurement


def copy_ceiling_gbps(device: torch.device) -> float:
    """Bytes read + written per second by ``clone()`` of a buffer far larger than the caches
    (1 GiB on CUDA, at most 1/8 of the GPU's memory; 32 MiB on CPU)."""
    if device.type == "cuda":
        n = min(1 << 30, torch.cuda.get_device_properties(device).total_memory // 8)
    else:
        n = 32 << 20
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    buf.fill_(1)
    us = bench_us(buf.clone, device)
    del buf
    return 2 * n / us / 1e3


def _clone_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer whose clone reads + writes ``nbytes``."""
    return torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device=device)


def clone_us(nbytes: int, device: torch.device) -> float:
    """Median time of cloning a buffer whose read + write traffic is ``nbytes``."""
    return bench_us(_clone_buffer(nbytes, device).clone, device)


# Implementations timed a second way, replayed from a CUDA graph: ours and the clone are
# capture-safe by contract, torchao's layout kernels capture too (a failed capture gives no
# number); torch-native routing syncs (bincount), so it is never captured.
GRAPH_IMPLS = ("moe_kernels", "clone", "torchao")


def graph_us(fn: Thunk, device: torch.device, calls: int = 1) -> float | None:
    """Median device time of one call replayed from a CUDA graph of ``calls`` calls (no host
    launch cost; the inputs stay in L2 when they fit), or None on CPU or when capture fails."""
    try:
        timing = graph_time_fn(fn, device, warmup=2, iters=50, calls=calls)
    except Exception:
        return None
    return None if timing is None else 1e3 * timing.median_ms


def measure_case(case: Case, device: torch.device, ceiling_gbps: float | None) -> list[Row]:
    """Rows of one case: each implementation, then the same-bytes clone."""
    rows: list[Row] = []
    base = dict(op=case.op, shape=case.shape, bytes=case.nbytes or None)
    # Small cases (under 64 MB moved) go 10 calls to a graph, so the graph's own launch (~10 us)
    # does not swamp microsecond kernels; every implementation of a case gets the same count.
    calls = 10 if case.nbytes and case.nbytes < 64 * 2**20 else 1
    clone = clone_graph = None
    if case.nbytes:
        buf = _clone_buffer(case.nbytes, device)
        clone = bench_us(buf.clone, device)
        clone_graph = graph_us(buf.clone, device, calls)
        del buf
    graphs: dict[str, float | None] = {}
    times: dict[str, float] = {}
    for impl, fn in case.impls.items():
        try:
            fn()  # first call: compile / autotune, and surfaces errors
            times[impl] = bench_us(fn, device)
            if impl in GRAPH_IMPLS:
                graphs[impl] = graph_us(fn, device, calls)
        except Exception as exc:
            case.unavailable[impl] = short_error(exc)
    native = times.get("torch")
    for impl in ["moe_kernels", "torch", *sorted(set(case.impls) - {"moe_kernels", "torch"})]:
        if impl in case.unavailable:
            rows.append({**base, "impl": impl, "status": f"unavailable: {case.unavailable[impl]}"})
            continue
        if impl not in times:
            continue
        us = times[impl]
        gbps = case.nbytes / us / 1e3 if case.nbytes else None
        rows.append(
            {
                **base,
                "impl": impl,
                "us": us,
                "gbps": gbps,
                "pct_ceiling": 100.0 * gbps / ceiling_gbps if gbps and ceiling_gbps else None,
                "vs_clone": clone / us if clone else None,
                "speedup": native / us if native else None,
                "graph_us": graphs.get(impl),
                "graph_vs_clone": _ratio(clone_graph, graphs.get(impl)),
                "status": "ok",
            }
        )
    if clone is not None:
        gbps = case.nbytes / clone / 1e3
        rows.append(
            {
                **base,
                "impl": "clone",
                "us": clone,
                "gbps": gbps,
                "pct_ceiling": 100.0 * gbps / ceiling_gbps if ceiling_gbps else None,
                "vs_clone": 1.0,
                "speedup": native / clone if native else None,
                "graph_us": clone_graph,
                "graph_vs_clone": 1.0 if clone_graph else None,
                "status": "ok",
            }
        )
    return rows


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def run(
    *,
    device: torch.device | str | None = None,
    quick: bool = False,
    ops: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Result:
    """Rows for every case; ``extra["ceiling_gbps"]`` is the measured copy ceiling."""
    device = torch.device(device) if device is not None else default_device()
    quick = quick or device.type != "cuda"
    if ops is not None:
        unknown = sorted(set(ops) - set(OPS))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    gen = torch.Generator(device=device).manual_seed(seed)
    ceiling = copy_ceiling_gbps(device)
    rows: list[Row] = []
    bar = report.progress(enabled=progress, desc="kernels", unit="case")
    with torch.no_grad():
        for case in all_cases(device, quick, gen, ops):
            bar.set_postfix_str(f"{case.op} {case.shape}")
            rows.extend(measure_case(case, device, ceiling))
            bar.update()
            del case
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    extra = {
        "ceiling_gbps": ceiling,
        "quick": quick,
        "notes": [f"copy ceiling (clone of a large buffer, read + write): {ceiling:.1f} GB/s"],
    }
    return Result("kernels", rows, COLUMNS, extra)
