"""The routing launch plan: one frozen ``Plan`` per problem, made by ``choose_plan``.

Every call (eager, compiled, captured in a CUDA graph) runs the plan of its ``Problem`` on its
``Device``; tests and benchmarks may narrow the choice with ``Constraints`` (typed, validated),
the only override there is. Pure Python: no Triton needed to read or test it.

The rules, in order (measurements behind them: ``docs/routing.md``):

1. Family. ``columns`` wherever it applies (16-bit scores whose rows read as 4-byte pairs, 64 or
   128 experts, top_k <= 8, no renormalize): A takes the top-k by a threshold and places each
   pair among its program's pairs in sorted order itself. Otherwise, up to ``RANKED_MAX_PAIRS``
   pairs (T * top_k), ``ranked``: A ranks each pair inside its expert by bitmasks and C
   scatters it to its place. Above, A stores bare choices and C orders each program's pairs so
   that each expert's run is stored contiguously: by counting (``counted``: <= 16 local
   experts), by prefix sums (``prefix``: index_shuffling, 16-32 local experts) or by sorting
   (``sorted``). These key each pair by (local expert, index) in 32 bits: where that cannot
   hold them (millions of experts) the pairs are ``ranked`` at any size.
2. Top-k of the row families: per-thread ``insert`` (top_k <= 8) for the sorted placements, else
   ``rounds`` of row maxima; fp32 keys for 16-bit scores (``fkey``, <= 128 experts), sort-and-merge
   of each 16-byte load for top_k in 5..8 (``merge``), route's 16-bit weights carried in the
   choice words (``pack_w``).
3. Programs: ``columns`` 128 tokens, ``insert`` 64 tokens (one a thread); the others about
   2048 keys (fp32) / 4096 (16-bit) a block, halved up to T = 65536, at most 4096 programs.
4. Scan: C reduces the (local experts, programs) histogram itself (``scan_in_c``) where it is
   small (at most ``SCAN_IN_C_MAX_HIST`` padded entries, ``SCAN_IN_C_MAX_PROGRAMS`` programs),
   with a warp per 2048 entries so no thread loads more than 64; otherwise a scan launch.
5. After a scan launch, ``columns`` writes its sorted pairs by (group of programs, expert) in a
   launch of its own (D, ``expert_runs``): one contiguous run each.
6. route's selection options (a bias, a group limit, scaled weights: ``Problem.selection``) take
   kernel A ``topk_grouped`` with a sorted placement (``counted`` for <= 16 local experts),
   weights in fp32 scratch, no cooperative launch: above ``RANKED_MAX_PAIRS`` pairs,
   per-thread insertion of int64 keys (``grouped_insert``, 64 tokens a program; top_k <= 8,
   <= 32 groups); else rounds of row maxima over one tile per block of rows (``grouped``; up
   to ``RANKED_MAX_PAIRS`` pairs programs of <= 4 rows, 4-9x faster there than insertion's 64
   rows a thread each; above, about 2048 tile entries a block, C's ~512 pairs a program; also
   where ``Constraints.block_t`` is given).
7. ``cooperative``: A and C run as one launch joined by a grid barrier where there is no scan
   or D launch and the programs fit one per SM (not in the interpreter, and not while a CUDA
   graph is captured: the launcher checks that), with ``warps_fused`` warps: C's for the row
   families, A's for ``columns`` (whose warp-level transposes need its layout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from ..blocks import cdiv, next_pow2

Placement = Literal["ranked", "sorted", "counted", "prefix", "columns"]
TopK = Literal["rounds", "insert", "threshold", "grouped", "grouped_insert"]

RANKED_MAX_PAIRS = 32768
SCAN_IN_C_MAX_PROGRAMS = 256
SCAN_IN_C_MAX_HIST = 16384
MAX_PROGRAMS = 4096  # of the row families (bounds a histogram row)
SORT_PAIRS = 512  # pairs a program for C's sort (rounds)
COLUMNS_TOKENS = 128
INSERT_TOKENS = 64
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class Problem:
    """What a call asks for: (T, E) scores of ``dtype`` (``words``: 16-bit rows readable as
    4-byte aligned pairs), ``top_k``, the local experts [start, end), whether a valid token count
    is given, and the op: ``route`` (weights, inverse, counts, offsets) or index_shuffling."""

    T: int
    E: int
    top_k: int
    start: int
    end: int
    dtype: torch.dtype
    route: bool
    renormalize: bool = False
    has_vtc: bool = False
    words: bool = False
    has_bias: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    scaled: bool = False

    @property
    def selection(self) -> bool:
        """route's selection options (a bias, a group limit, scaled weights): kernel A
        ``topk_grouped``."""
        return self.has_bias or self.topk_groups < self.n_groups or self.scaled

    @property
    def kind(self) -> int:
        """0 fp32, 1 bf16, 2 fp16."""
        return _KINDS[self.dtype]

    @property
    def L(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Device:
    """What the plan needs of the device: its SM count, or the interpreter (CPU)."""

    sm_count: int
    interpret: bool = False


INTERPRETER = Device(sm_count=1 << 30, interpret=True)


@dataclass(frozen=True)
class Constraints:
    """Narrow the chooser (tests, benchmarks): each field left None is chosen as usual. A
    constraint the problem cannot meet raises a ValueError naming it."""

    placement: Placement | None = None
    topk: Literal["rounds", "insert"] | None = None  # of the row families
    block_t: int | None = None  # rows a block of A (a power of two)
    sub: int | None = None  # blocks a program (a power of two)
    scan_in_c: bool | None = None
    runs_group: int | None = None  # D's programs of A a group (a power of two <= 256)

    def __post_init__(self) -> None:
        if self.placement not in (None, "ranked", "sorted", "counted", "prefix", "columns"):
            raise ValueError(f"Constraints.placement: unknown {self.placement!r}")
        if self.topk not in (None, "rounds", "insert"):
            raise ValueError(f"Constraints.topk: unknown {self.topk!r}")
        for name, hi in (("block_t", 256), ("sub", MAX_PROGRAMS), ("runs_group", 256)):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1 or v > hi or v & (v - 1)):
                raise ValueError(f"Constraints.{name} must be a power of two <= {hi}, got {v!r}")
        if self.scan_in_c is not None and type(self.scan_in_c) is not bool:
            raise ValueError(f"Constraints.scan_in_c must be a bool, got {self.scan_in_c!r}")


@dataclass(frozen=True)
class Plan:
    """How a problem is routed (see the module): the algorithms, the programs, the launches."""

    placement: Placement
    topk: TopK
    block_t: int  # tokens a block of A
    sub: int  # blocks a program of A (and C)
    n_programs: int
    scan_in_c: bool
    expert_runs: bool
    runs_group: int
    cooperative: bool
    fkey: bool
    merge: bool
    pack_w: bool
    warps_a: int
    warps_c: int
    warps_fused: int

    @property
    def tokens_per_program(self) -> int:
        return self.block_t * self.sub


def columns_apply(p: Problem) -> bool:
    """The ``columns`` family's conditions (rule 1)."""
    return (
        p.kind != 0 and p.words and p.E in (64, 128) and p.top_k <= 8
        and not (p.route and p.renormalize) and not p.selection
    )  # fmt: skip


def _family(p: Problem, c: Constraints) -> Placement:
    if c.placement is not None:
        return c.placement
    if p.selection:
        return "counted" if max(next_pow2(p.L), 2) <= 16 else "sorted"
    if columns_apply(p) and c.topk is None and c.block_t is None and c.sub is None:
        return "columns"
    if p.T * p.top_k <= RANKED_MAX_PAIRS or not _keys_fit(p, INSERT_TOKENS):
        return "ranked"
    l_pad = max(next_pow2(p.L), 2)
    if not p.route and 16 <= l_pad <= 32:
        return "prefix"
    return "counted" if l_pad <= 16 else "sorted"


def _keys_fit(p: Problem, tokens: int) -> bool:
    """Whether a sorted placement's 32-bit keys hold (local expert, index in the program)."""
    l_bits = max(1, (max(p.L, 1) - 1).bit_length())
    return l_bits + (tokens * next_pow2(p.top_k) - 1).bit_length() <= 30


def _rows_blocks(
    p: Problem, d: Device, c: Constraints, topk: TopK, placement: Placement
) -> tuple[int, int, int]:
    """(block_t, sub, warps of A) of the row families (rule 3)."""
    e_pad = max(next_pow2(p.E), 4)
    if topk == "insert":
        block_t, sub, warps = INSERT_TOKENS, 1, 2
    else:
        keys = 2048 if p.kind == 0 else 4096
        if p.T <= 65536 and not d.interpret:
            keys //= 2
        min_programs = 1 if d.interpret else 128
        block_t = max(1, min(keys // e_pad, 32, next_pow2(cdiv(p.T, min_programs))))
        warps = max(2, min(8, block_t * e_pad // 1024))
        if not d.interpret and block_t * e_pad >= 4096 and 8 * MAX_PROGRAMS * block_t <= p.T:
            block_t, warps = block_t // 2, max(2, warps // 2)
        sub = next_pow2(cdiv(cdiv(p.T, block_t), MAX_PROGRAMS))
    block_t = c.block_t or block_t
    if c.sub is None and topk == "rounds" and placement != "ranked":
        n_blocks = cdiv(p.T, block_t)  # C sorts about SORT_PAIRS pairs a program
        k_pad = next_pow2(p.top_k)
        sub = max(1, min(SORT_PAIRS // (block_t * k_pad), next_pow2(n_blocks // 1024 + 1) // 2))
    return block_t, c.sub or sub, 1 if d.interpret else warps


def grouped_width(p: Problem) -> tuple[int, int]:
    """(G_PAD, EG_PAD): the padded groups and experts a group of ``topk_grouped``'s tile."""
    return next_pow2(p.n_groups), next_pow2(p.E // p.n_groups)


def _grouped_blocks(p: Problem, d: Device, c: Constraints) -> tuple[int, int, int]:
    """(block_t, sub, warps of A) of ``topk_grouped``'s tile: about 2048 tile entries a block
    (1024 up to T = 65536), C's ~SORT_PAIRS pairs a program (at most 128 tokens: ``counted``);
    up to RANKED_MAX_PAIRS pairs, programs of at most 4 rows (sub 1: latency-bound sizes)."""
    g_pad, eg_pad = grouped_width(p)
    width = g_pad * eg_pad
    keys = 1024 if p.T <= 65536 and not d.interpret else 2048
    min_programs = 1 if d.interpret else 128
    small = p.T * p.top_k <= RANKED_MAX_PAIRS and not d.interpret  # latency: many programs
    cap = 4 if small else 32
    block_t = c.block_t or max(1, min(keys // width, cap, next_pow2(cdiv(p.T, min_programs))))
    tokens = max(block_t, min(128, SORT_PAIRS // next_pow2(p.top_k)))
    sub = max(1, min(tokens // block_t, next_pow2(cdiv(p.T, block_t * 256))))
    sub = c.sub or (1 if small else sub)
    warps = max(1, min(8, block_t * width // 512))
    return block_t, sub, 1 if d.interpret else warps


@functools.lru_cache(maxsize=1024)
def choose_plan(p: Problem, d: Device, c: Constraints | None = None) -> Plan:
    """The plan of problem ``p`` on device ``d`` (the module's rules), within ``c``. Cached: a
    call of a kind seen before pays a lookup, not the rules."""
    c = c or Constraints()
    placement = _family(p, c)
    k_pad = next_pow2(p.top_k)
    l_pad = max(next_pow2(p.L), 2)
    if placement == "columns":
        if not columns_apply(p):
            raise ValueError(
                "Constraints.placement='columns' needs 16-bit scores with 4-byte aligned rows, "
                f"64 or 128 experts, top_k <= 8 and no renormalize: {p}"
            )
        if c.topk is not None or c.block_t is not None or c.sub is not None:
            raise ValueError("Constraints.topk/block_t/sub do not apply to placement='columns'")
        topk: TopK = "threshold"
        block_t, sub, warps_a = COLUMNS_TOKENS, 1, 1 if d.interpret else COLUMNS_TOKENS // 32
    elif p.selection:
        if placement not in ("sorted", "counted") or c.topk is not None:
            raise ValueError(
                "a selection bias, group limit or weight scale takes kernel A 'grouped' with "
                f"placement 'sorted' or 'counted', not placement={placement!r}, topk={c.topk!r}"
            )
        insert = k_pad <= 8 and (p.topk_groups == p.n_groups or next_pow2(p.n_groups) <= 32)
        # (the interpreter runs insertion at every size: the tests' small problems cover it)
        big = p.T * p.top_k > RANKED_MAX_PAIRS or d.interpret
        insert = insert and big and c.block_t is None
        topk = "grouped_insert" if insert else "grouped"
        if topk == "grouped_insert":
            block_t, sub, warps_a = INSERT_TOKENS, c.sub or 1, 1 if d.interpret else 2
        else:
            block_t, sub, warps_a = _grouped_blocks(p, d, c)
        if block_t > (INSERT_TOKENS if topk == "grouped_insert" else 32):
            raise ValueError(f"Constraints.block_t={block_t} too large for topk={topk!r}")
    else:
        topk = c.topk or ("insert" if placement != "ranked" and k_pad <= 8 else "rounds")
        if topk == "insert" and (placement == "ranked" or k_pad > 8):
            raise ValueError("Constraints.topk='insert' needs a sorted placement and top_k <= 8")
        block_t, sub, warps_a = _rows_blocks(p, d, c, topk, placement)
        if block_t > (256 if topk == "insert" else 32):
            raise ValueError(f"Constraints.block_t={block_t} too large for topk={topk!r}")
    tokens = block_t * sub
    n_programs = cdiv(p.T, tokens)
    l_bits = max(1, (max(p.L, 1) - 1).bit_length())
    idx_bits = (tokens * k_pad - 1).bit_length()
    if placement == "ranked" and (tokens - 1).bit_length() + l_bits > 31:
        raise ValueError(f"too many experts ({p.L}) for ranked blocks of {tokens} tokens")
    if placement == "counted" and (tokens > 255 or l_pad > 128):
        raise ValueError("Constraints.placement='counted' needs <= 255 tokens, <= 128 experts")
    if placement in ("sorted", "prefix") and not _keys_fit(p, tokens):
        raise ValueError(f"{p.L} experts: too many for a sorted placement's 32-bit keys")
    if placement == "prefix" and p.route:
        raise ValueError("Constraints.placement='prefix' is index_shuffling's")
    np_pad = max(next_pow2(n_programs), 2)
    scan_in_c = c.scan_in_c
    if scan_in_c is None:
        small_hist = l_pad * np_pad <= SCAN_IN_C_MAX_HIST
        scan_in_c = p.L == 0 or (small_hist and n_programs <= SCAN_IN_C_MAX_PROGRAMS)
    expert_runs = placement == "columns" and not scan_in_c and p.L > 0
    if c.runs_group is not None and not expert_runs:
        raise ValueError("Constraints.runs_group needs the columns placement after a scan launch")
    sorted_family = placement != "ranked"
    fkey = topk == "insert" and p.kind != 0 and max(next_pow2(p.E), 4) <= 128
    merge = topk == "insert" and k_pad == 8 and p.kind != 0 and p.E > 4
    pack_w = (
        placement in ("sorted", "counted") and p.route and not p.renormalize and p.kind != 0
        and l_bits + idx_bits <= 16 and not p.selection
    )  # fmt: skip
    if d.interpret:
        warps_c = 1
    elif placement == "columns":
        warps_c = max(1, min(8, tokens * k_pad // 128))
    elif sorted_family:
        warps_c = max(1, min(4, tokens * k_pad // 128))
    else:
        warps_c = max(1, min(4, min(tokens, 2048 // k_pad) * k_pad // 256))
    hist = l_pad * np_pad
    if scan_in_c and not d.interpret:
        warps_c = max(warps_c, min(8, hist // 2048))
    cooperative = (
        not d.interpret and scan_in_c and not expert_runs and n_programs <= d.sm_count
        and not p.selection
    )  # fmt: skip
    return Plan(
        placement=placement, topk=topk, block_t=block_t, sub=sub, n_programs=n_programs,
        scan_in_c=scan_in_c, expert_runs=expert_runs,
        runs_group=min(c.runs_group or 128, np_pad), cooperative=cooperative, fkey=fkey,
        merge=merge, pack_w=pack_w, warps_a=warps_a, warps_c=warps_c,
        warps_fused=warps_a if placement == "columns" else max(warps_a, warps_c),
    )  # fmt: skip
