"""Launching a routing plan: kernel constexprs, one int32 buffer, runtime arguments, the run.

A plan's launches (``Launches``, cached per problem and plan) are A, then B (the scan) where C
does not reduce the histogram itself, C, then D (expert runs) where the plan has it; or A and C
as one cooperative launch (``fused.fused_kernel``) where the plan allows and no CUDA graph is
being captured. Outputs and scratch are segments of int32 storage in ``SEGMENTS`` order: one
buffer for eager calls (split into the outputs), separate outputs for custom-op calls (whose
outputs must not alias). An eager call also binds its launches for the next call of its kind
(``eager``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from ..._dispatch import INTERPRET, tracing
from ..._routing_outputs import RoutingPlan, Selection, ShuffledIndices
from ..blocks import next_pow2
from ..grid_sync import barrier_words
from ..launch import BoundLaunches, FastKernel, Rel, aligned, current_stream, fast_path_open
from . import eager as lane
from .expert_runs import expert_runs_kernel
from .fused import fused_kernel
from .place import PLACE, place_kernel
from .plan import (
    INTERPRETER,
    Constraints,
    Device,
    Plan,
    Problem,
    choose_plan,
    columns_apply,
    grouped_width,
)
from .scan import scan_kernel
from .topk_columns import topk_columns_kernel
from .topk_grouped import topk_grouped_kernel
from .topk_rows import topk_rows_kernel

# triton < 3.6's interpreter miscounts tl.histogram (topk_rows); the GPU never takes this
_OLD_INTERP = INTERPRET and tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6)
_topk_rows = FastKernel(topk_rows_kernel)
_topk_columns = FastKernel(topk_columns_kernel)
_topk_grouped = FastKernel(topk_grouped_kernel)
_scan = FastKernel(scan_kernel)
_place = FastKernel(place_kernel)
_expert_runs = FastKernel(expert_runs_kernel)
_fused = FastKernel(fused_kernel)

# Outputs first (route's then index_shuffling's, each contiguous from the start where the other
# op's are empty), then scratch; weights and scr_w hold fp32 bits.
SEGMENTS = ("expert", "token", "weights", "inverse", "tcpe", "counts", "offsets", "pad",
            "hist", "packed", "scr_w")  # fmt: skip
_SEG = {name: i for i, name in enumerate(SEGMENTS)}
_N_OUT = _SEG["pad"]
_FP32_SEGS = (_SEG["weights"], _SEG["scr_w"])
_PLAIN = Selection()  # route without a bias, groups or scale; index_shuffling
_ROUTE_OUT = ("expert", "token", "weights", "inverse", "counts", "offsets")
_SHUFFLE_OUT = ("expert", "token", "tcpe")


class Launches(NamedTuple):
    """A plan's launches: programs of A and C, segment sizes and starts (int32 elements), the
    constexprs and warps of A and C, (grid, constexprs, warps) of B and D or None."""

    n_prog: int
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    a: dict
    a_warps: int
    scan: tuple[int, dict, int] | None
    c: dict
    c_warps: int
    runs: tuple[int, dict, int] | None


@functools.lru_cache(maxsize=512)
def launches(p: Problem, plan: Plan) -> Launches:
    """The kernels' constexprs and the buffer's segments for ``plan`` of ``p``."""
    T, E, K, L = p.T, p.E, p.top_k, p.L
    Lm, P = max(L, 1), T * K
    k_pad, l_pad, e_pad = next_pow2(K), max(next_pow2(L), 2), max(next_pow2(E), 4)
    np_pad = max(next_pow2(plan.n_programs), 2)
    tokens = plan.tokens_per_program
    place = plan.placement
    route = p.route
    l_bits = max(1, (Lm - 1).bit_length())
    full_range = p.start == 0 and p.end == E
    if place == "columns":
        mode = (2 if p.kind == 1 else 3) + (2 if INTERPRET else 0)
        a = dict(K=K, E_PAD=e_pad, TP=tokens, HAS_VTC=p.has_vtc, FULL_RANGE=full_range,
                 MODE=mode, WEIGHTS=route)  # fmt: skip
        packed, scr_w = plan.n_programs * (tokens * K + e_pad), 0  # slots, then run starts
    elif plan.topk in ("grouped", "grouped_insert"):
        g_pad, eg_pad = grouped_width(p)
        w = 4 if p.kind == 0 else 8
        insert = plan.topk == "grouped_insert"
        a = dict(K=K, K_PAD=k_pad, E_PAD=max(next_pow2(E), w), G=p.n_groups, G_PAD=g_pad,
                 EG=E // p.n_groups, EG_PAD=eg_pad, TOPK_G=p.topk_groups, BLOCK_T=plan.block_t,
                 SUB=plan.sub,
                 KIND=p.kind, HAS_VTC=p.has_vtc, HAS_BIAS=p.has_bias, RENORM=p.renormalize,
                 SCALED=p.scaled, FULL_RANGE=full_range, HB=2 * l_pad,
                 OLD_INTERP=_OLD_INTERP, INSERT=insert, W=w,
                 MERGE=insert and k_pad == 8 and w == 8)  # fmt: skip
        packed, scr_w = P, P
    else:
        a = dict(
            K=K, K_PAD=k_pad, E_PAD=e_pad, L_BITS=l_bits, BLOCK_T=plan.block_t, SUB=plan.sub,
            KIND=p.kind, HAS_VTC=p.has_vtc, WEIGHTS=route, RENORM=p.renormalize,
            EVEN_E=e_pad == E, FULL_RANGE=full_range, SENT=-(2**63) if p.kind == 0 else -(2**31),
            RANKS=place == "ranked", HB=2 if place == "ranked" else 2 * l_pad,
            OLD_INTERP=_OLD_INTERP, INSERT=plan.topk == "insert",
            W=min(e_pad, 4 if p.kind == 0 else 8), FKEY=plan.fkey, MERGE=plan.merge,
            PACK_W=plan.pack_w,
        )  # fmt: skip
        packed, scr_w = P, P if route and not plan.pack_w else 0
    seg = dict(expert=P, token=P, weights=P if route else 0, inverse=P if route else 0,
               tcpe=0 if route else E + 2, counts=Lm, offsets=L + 1 if route else 0,
               hist=Lm * plan.n_programs, packed=packed, scr_w=scr_w)  # fmt: skip
    seg["pad"] = -sum(seg[n] for n in SEGMENTS[:_N_OUT]) % 4  # scratch 16-byte aligned
    sizes = tuple(seg[n] for n in SEGMENTS)
    c = dict(
        K=K, K_PAD=k_pad, L_PAD=l_pad, L_BITS=l_bits, NP_PAD=np_pad if plan.scan_in_c else 1,
        TOK_PER_PROG=tokens, CHUNK_T=max(1, min(tokens, 2048 // k_pad)),
        FUSE_SCAN=plan.scan_in_c, WEIGHTS=route, WHILE_LOOPS=INTERPRET, PLACE=PLACE[place],
        IDX_BITS=(tokens * k_pad - 1).bit_length(), PACK_W=plan.pack_w,
        IS_BF16=p.kind == 1,
        # at least 4 words: a (tokens, 1) count tensor trips triton 3.6-3.8's
        # TritonGPUOptimizeThreadLocality pass (unused words stay zero)
        NW=max(4, (l_pad + 3) // 4) if place == "counted" else 1,
        TOK_BITS=(tokens - 1).bit_length(), RUNS=plan.expert_runs,
    )  # fmt: skip
    scan = None
    if not plan.scan_in_c:
        chunk = min(np_pad, 16384)  # long rows in one or two chunks, 8 warps
        block_l = max(1, min(l_pad, 4096 // chunk))
        scan = (
            -(-L // block_l),
            dict(BLOCK_L=block_l, CHUNK=chunk, WHILE_LOOPS=INTERPRET),
            1 if INTERPRET else 8 if chunk >= 8192 else 4,
        )
    runs = None
    if plan.expert_runs:
        group = plan.runs_group
        consts = dict(K=K, TP=tokens, E_PAD=e_pad, L_PAD=l_pad, P=group, QB=1024,
                      WEIGHTS=route, IS_BF16=p.kind == 1, WHILE_LOOPS=INTERPRET)  # fmt: skip
        runs = (L * -(-plan.n_programs // group), consts, 1 if INTERPRET else 4)
    starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    return Launches(plan.n_programs, sizes, starts, a, plan.warps_a, scan, c, plan.warps_c, runs)


@functools.lru_cache(maxsize=16)
def device_of(index: int) -> Device:
    """The ``Device`` of CUDA device ``index`` (``INTERPRETER`` under the interpreter)."""
    if INTERPRET:
        return INTERPRETER
    return Device(sm_count=torch.cuda.get_device_properties(index).multi_processor_count)


def problem_of(scores: torch.Tensor, top_k: int, vtc: object, start: int, end: int,
               renormalize: bool, route: bool,
               sel: Selection | None = None) -> Problem:  # fmt: skip
    """The ``Problem`` of a call (16-bit rows read as pairs where 4-byte aligned)."""
    T, E = scores.shape
    sel = sel or _PLAIN
    words = (
        scores.dtype != torch.float32 and scores.stride(1) == 1 and scores.stride(0) % 2 == 0
        and aligned(scores, 4)
    )  # fmt: skip
    return Problem(T, E, top_k, start, end, scores.dtype, route, renormalize, vtc is not None,
                   words, sel.bias is not None, sel.n_groups, sel.topk_groups,
                   sel.scale != 1.0)  # fmt: skip


def _kernel_args(ln: Launches, seg: list, x: object, strides: tuple[int, int], vtc: object,
                 p: Problem) -> tuple[tuple, tuple, tuple, tuple]:  # fmt: skip
    """Runtime arguments of A, B, C and D in signature order. ``seg`` holds the segments in
    ``SEGMENTS`` order, ``x`` the scores, ``vtc`` the valid count (None: a dummy), all tensors
    or all int addresses (``Rel`` marks). Unused pointers alias used ones."""
    expert, token, weights, inverse, tcpe, counts, offsets, _, hist, packed, scr_w = seg
    columns = ln.c["PLACE"] == PLACE["columns"]
    if not ln.sizes[_SEG["scr_w"]]:
        scr_w = packed
    if not p.route:
        weights, inverse, offsets = scr_w, packed, counts
    else:
        tcpe = counts
    a_w = inverse if columns else scr_w  # columns: A writes route's inverse entries
    a = (x, *strides, strides[0] // 2 if columns else 0, expert if vtc is None else vtc, packed,
         a_w, hist, p.T, p.E, p.start, p.end, ln.n_prog)  # fmt: skip
    b = (hist, counts, p.L, ln.n_prog)
    c = (packed, scr_w, inverse, hist, counts, expert, token, weights, offsets, tcpe, p.T, p.E,
         p.L, p.start, ln.n_prog)  # fmt: skip
    d = (packed, hist, counts, expert, token, weights, p.L, p.start, ln.n_prog)
    return a, b, c, d


def _fused_launch(ln: Launches) -> tuple[dict, Callable[[tuple, object], tuple]]:
    """``fused_kernel``'s constexprs (A's and C's; dummies for the other A) and its runtime
    arguments from A's and C's and the barrier words."""
    dummies = dict(
        K_PAD=ln.c["K_PAD"], E_PAD=4, L_BITS=ln.c["L_BITS"], BLOCK_T=1, SUB=1, KIND=0,
        HAS_VTC=False, RENORM=False, EVEN_E=True, FULL_RANGE=True, SENT=0, RANKS=False, HB=2,
        OLD_INTERP=False, INSERT=False, W=1, FKEY=False, MERGE=False, PACK_W=ln.c["PACK_W"],
        TP=32, MODE=0,
    )  # fmt: skip

    def args(k: tuple, bar: object) -> tuple:
        x, stride_t, stride_e, stride_w, vtc, packed, a_w, hist, T, E, start, end, n_prog = k[0]
        _, scr_w, inverse, _, counts, expert, token, weights, offsets, tcpe, _, _, L, _, _ = k[2]
        return (x, vtc, bar, packed, a_w, hist, scr_w, inverse, counts, expert, token,
                weights, offsets, tcpe, stride_t, stride_e, stride_w, T, E, L, start, end,
                n_prog)  # fmt: skip

    return {**dummies, **ln.a, **ln.c}, args


def _outputs(seg: list, p: Problem) -> RoutingPlan | ShuffledIndices:
    """The op's named outputs from the typed segments."""
    if not p.route:
        return ShuffledIndices(seg[_SEG["tcpe"]], seg[0], seg[1])
    counts = seg[_SEG["counts"]][: p.L]  # (an empty range's segment holds one element)
    return RoutingPlan(counts, seg[_SEG["offsets"]], seg[0], seg[1], seg[2],
                       seg[_SEG["inverse"]].view(p.T, p.top_k))  # fmt: skip


def traceable(
    scores_TE: torch.Tensor,
    top_k: int,
    vtc: object,
    start: int,
    end: int,
    renormalize: bool,
    route: bool,
    selection: Selection | None = None,
) -> bool:
    """Whether a compiled call may trace its launches into Inductor's graph: every plan but
    ``columns``. Inductor's TTIR access analysis walks the columns kernel's dataflow path by
    path (pytorch#193703): 12-50 s per analysis at E=128, top_k=8 on torch 2.13, over ten
    minutes on 2.14, twice per compile. Those calls stay one opaque op."""
    p = problem_of(scores_TE, top_k, vtc, start, end, renormalize, route, selection)
    if p.T == 0 or not columns_apply(p):
        return True
    return choose_plan(p, device_of(scores_TE.device.index or 0)).placement != "columns"


def run(
    scores_TE: torch.Tensor,
    top_k: int,
    valid_token_count: torch.Tensor | None,
    start: int,
    end: int,
    renormalize: bool,
    route: bool,
    constraints: Constraints | None = None,
    one_buffer: bool = False,
    eager_key: tuple | None = None,
    selection: Selection | None = None,
) -> RoutingPlan | ShuffledIndices:
    """Route ``scores_TE`` (T > 0; arguments already checked): ``RoutingPlan`` for route,
    ``ShuffledIndices`` for index_shuffling. ``one_buffer``: outputs are views of one allocation
    (eager calls), and the launches are bound for the next call with the same ``eager_key``
    (``eager.eager_key``; not for route's ``selection`` options). ``constraints`` narrow the
    plan (tests, benchmarks)."""
    selection = selection or _PLAIN
    converted = scores_TE.dtype != torch.float32 and scores_TE.shape[1] > 2**16
    if converted:  # 16-bit keys hold the expert in 16 bits; fp32 is exact (never bound)
        scores_TE = scores_TE.float()
    vtc = valid_token_count
    key = None
    if one_buffer and not converted and selection.plain and fast_path_open():
        key = eager_key
        if key is None:  # (a public call's lane has looked its own key up already)
            key = lane.eager_key(scores_TE, top_k, vtc, start, end, renormalize, route,
                                 constraints)  # fmt: skip
            out = lane.bound_call(key, scores_TE, vtc)
            if out is not None:
                return out
    p = problem_of(scores_TE, top_k, vtc, start, end, renormalize, route, selection)
    dev = scores_TE.device
    plan = choose_plan(p, device_of(dev.index or 0), constraints)
    ln = launches(p, plan)
    if one_buffer:
        buf = torch.empty(sum(ln.sizes), dtype=torch.int32, device=dev)
        typed = list(buf.split_with_sizes(ln.sizes))
        for i in _FP32_SEGS:  # fp32 bits
            typed[i] = typed[i].view(torch.float32)
    else:  # op calls: a tensor per segment (outputs must not alias; under Inductor, each
        # kernel then writes only fresh tensors it can mutate in place, no views of a shared
        # one), none for an empty segment (``_kernel_args`` passes another in its place)
        dtypes = [torch.float32 if i in _FP32_SEGS else torch.int32 for i in range(len(ln.sizes))]
        typed = [torch.empty(n, dtype=d, device=dev) if n else None
                 for n, d in zip(ln.sizes, dtypes, strict=True)]  # fmt: skip
    x = scores_TE if p.kind == 0 else scores_TE.view(torch.int16)
    strides = scores_TE.stride()
    args = _kernel_args(ln, typed, x, strides, vtc, p)
    # (kernel, grid, constexprs, options, its arguments from _kernel_args' and the barrier's)
    todo: list[tuple[FastKernel, int, dict, dict, Callable[[tuple, object], tuple]]] = []
    # no cooperative launch while a graph is captured, nor where Inductor will launch the
    # kernels (its generated code may be captured later)
    capturing = tracing() or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if plan.cooperative and not capturing:
        bar = barrier_words(dev.index, current_stream(dev.index))
        consts, pick = _fused_launch(ln)
        opts = dict(num_warps=plan.warps_fused, launch_cooperative_grid=True)
        todo.append((_fused, ln.n_prog, consts, opts, pick))
    else:
        bar = None
        if p.selection:
            bias = selection.bias
            bias = x if bias is None else bias.to(torch.float32).contiguous()
            a_sel = (*args[0], bias, selection.scale)
            todo.append((_topk_grouped, ln.n_prog, ln.a, dict(num_warps=ln.a_warps),
                         lambda a, b: a_sel))  # fmt: skip
        else:
            ka = _topk_columns if plan.placement == "columns" else _topk_rows
            todo.append((ka, ln.n_prog, ln.a, dict(num_warps=ln.a_warps), lambda a, b: a[0]))
        if ln.scan is not None:
            todo.append((_scan, ln.scan[0], ln.scan[1], dict(num_warps=ln.scan[2]),
                         lambda a, b: a[1]))  # fmt: skip
        todo.append((_place, ln.n_prog, ln.c, dict(num_warps=ln.c_warps), lambda a, b: a[2]))
        if ln.runs is not None:
            todo.append((_expert_runs, ln.runs[0], ln.runs[1], dict(num_warps=ln.runs[2]),
                         lambda a, b: a[3]))  # fmt: skip
    handles = [kern.launch((g,), pick(args, bar), consts, **opts)
               for kern, g, consts, opts, pick in todo]  # fmt: skip
    # an empty expert range is not bound: its counts output is a slice of its segment
    if key is not None and p.L > 0 and all(handles) and not buf.data_ptr() & 15:
        outs = _ROUTE_OUT if route else _SHUFFLE_OUT
        split = [ln.sizes[_SEG[n]] for n in outs]
        split.append(sum(ln.sizes) - sum(split))
        marks = _kernel_args(ln, [Rel(0, 4 * s) for s in ln.starts], Rel(1, 0), strides,
                             None if vtc is None else Rel(2, 0), p)  # fmt: skip
        bound = BoundLaunches(
            [
                (h, g, pick(marks, Rel(3, 0)))
                for h, (_, g, _, _, pick) in zip(handles, todo, strict=True)
            ]
        )
        lane.bind(key, lane.Eager(sum(ln.sizes), tuple(split), bound,
                                  None if bar is None else barrier_words, dev, route, p.T,
                                  top_k))  # fmt: skip
    return _outputs(typed, p)
