"""Argument parity with FBGEMM's gen_ai MoE ops (one H200 run, fbgemm-gpu-genai carried as a
wheel): every call FBGEMM accepts, ours accepts too and gives the same result. The calls follow the
shapes and argument forms of FBGEMM's own tests: T up to 16384, E in {16, 32, 128, 320}, k in
{1, 2, 4, 8} (five (T, E, k) problems), bf16 / fp32 scores in row- and column-major layouts,
partial valid counts as int32 and int64 tensors, int32 / int64 index tensors, bf16 / fp32 / int32
tokens; eager and compiled.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/fbgemm_parity.py [--parts=silu_cases,shuffling_cases] [--quick]

Equal means: index_shuffling's counts equal and each expert's bucket holds the same tokens (FBGEMM's
order inside a bucket varies run to run; ours is sorted); gather bit-exact; scatter-add exact for
integer tokens and within bf16 rounding for float tokens (FBGEMM adds with atomics in any order).

The six ops of the drop-in issue, in the forms of FBGEMM's activation, gather-scatter and
shuffling tests: ``silu_mul`` / ``silu_mul_quant`` (T 1-16384, D 5120 / 7168, contiguous or
column slices of one (T, 2D) tensor, scale_ub None / 1200, valid counts), ``gather_scale_quant_
dense_tokens`` (E 2-8, row- and column-major scores, scale_ub), ``scatter_add_padded_tokens`` (T
64-256, E 16 / 128, EP 2-16, balanced int32 and bincount int64 counts), ``combine_shuffling`` /
``split_shuffling`` (num_tokens 1-16384, E 16 / 128, EP 4 / 8, dense and sparse expert ranges,
padded). All bit-exact (fp8 data and scales byte for byte) on the rows FBGEMM writes: rows below
the valid count, and for the shuffles the rows below the total count (FBGEMM leaves the rest
unwritten, ours are zero); the padded scatter-add's destinations each get one row in these forms,
so its atomics' order does not matter.
"""

from __future__ import annotations

import itertools
import sys

import torch
from common import same_bits

import moe_kernels as mk

try:
    import fbgemm_gpu.experimental.gen_ai.moe as fb
except Exception as exc:  # noqa: BLE001 - the peer is optional
    print("fbgemm_gpu not importable:", repr(exc)[:300])
    sys.exit(0)

dev = torch.device("cuda")
STATS = {"cases": 0, "fbgemm_rejects": 0, "ours_rejects": [], "mismatch": []}


def run(name: str, fb_call, our_call, same) -> None:
    STATS["cases"] += 1
    try:
        want = fb_call()
    except Exception:  # noqa: BLE001 - FBGEMM does not take this call: nothing to match
        STATS["fbgemm_rejects"] += 1
        return
    try:
        got = our_call()
    except Exception as exc:  # noqa: BLE001
        STATS["ours_rejects"].append(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
        return
    if not same(want, got):
        STATS["mismatch"].append(name)


def same_buckets(want, got) -> bool:
    """Counts equal, and the (expert, token) pairs equal once FBGEMM's are sorted (ours are)."""
    (fc, fe, ft), (oc, oe, ot) = want, got
    E = oc.shape[0] - 2
    if not torch.equal(fc[:E], oc[:E]):
        return False
    n = int(oc[:E].sum())
    scale = max(int(ot[:n].max()) + 1, 1) if n else 1
    f_key = (fe[:n].long() * scale + ft[:n].long()).sort().values
    return torch.equal(f_key, oe[:n].long() * scale + ot[:n].long())


def index_shuffling_cases() -> None:
    compiled = torch.compile(mk.index_shuffling, fullgraph=True)
    problems = ((3, 16, 2), (123, 32, 4), (1234, 128, 8), (4096, 320, 2), (16384, 16, 1))
    for (T, E, k), dtype, colmajor, vtc in itertools.product(
        problems, (torch.bfloat16, torch.float32), (False, True), (None, "int32", "int64")
    ):
        scores = torch.randn(2 * T if vtc else T, E, device=dev, dtype=dtype)
        if colmajor:
            scores = scores.t().contiguous().t()
        count = None if vtc is None else torch.tensor([T], device=dev, dtype=getattr(torch, vtc))
        name = f"index_shuffling T={T} E={E} k={k} {dtype} col={colmajor} vtc={vtc}"

        def fb_call(scores=scores, count=count, k=k):
            return fb.index_shuffling(scores, None, None, count, top_k=k)[:3]

        op = (
            compiled
            if (T, E, dtype, vtc) == (1234, 128, torch.bfloat16, "int32")
            else mk.index_shuffling
        )
        run(name, fb_call, lambda op=op, s=scores, c=count, k=k: op(s, None, None, c, k),
            same_buckets)  # fmt: skip


def gather_cases() -> None:
    compiled = torch.compile(mk.gather_scale_dense_tokens, fullgraph=True)
    for T, E, D, rowmajor, use_compiled in itertools.product(
        (1, 128, 4096), (2, 8), (5120,), (True, False), (False, True)
    ):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16).abs()
        expert = torch.randint(0, E, (T,), device=dev)  # int64, as in FBGEMM's tests
        token = torch.randperm(T, device=dev).to(torch.int32)
        scores = torch.rand(E, T, device=dev, dtype=torch.bfloat16).t()  # column-major
        if rowmajor:
            scores = scores.contiguous()
        if use_compiled and (T, E, D) != (128, 2, 5120):
            continue  # one compiled shape: recompiles per shape cost seconds each
        op = compiled if use_compiled else mk.gather_scale_dense_tokens
        run(
            f"gather T={T} E={E} D={D} row={rowmajor} compiled={use_compiled}",
            lambda x=x, t=token, e=expert, s=scores: fb.gather_scale_dense_tokens(x, t, e, s),
            lambda x=x, t=token, e=expert, s=scores, op=op: op(x, t, e, s),
            lambda a, b: torch.equal(a, b),
        )


def scatter_cases() -> None:
    def scatter(op, out, src, tok, vtc):
        res = out.clone()
        op(res, src, tok, vtc)
        return res

    compiled = torch.compile(mk.scatter_add_dense_tokens, fullgraph=True)
    for T, D, dtype, vtc, use_compiled in itertools.product(
        (1, 128, 16384), (5120,), (torch.bfloat16, torch.float32, torch.int32),
        (None, "partial"), (False, True),
    ):  # fmt: skip
        if dtype == torch.int32:
            src = torch.randint(-(2**20), 2**20, (T, D), device=dev, dtype=dtype)
            out = torch.randint(-(2**20), 2**20, (T, D), device=dev, dtype=dtype)
        else:
            src = torch.randn(T, D, device=dev, dtype=dtype)
            out = torch.randn(T, D, device=dev, dtype=dtype)
        tok = torch.randperm(T, device=dev).to(torch.int32)
        if dtype == torch.int32:  # integer adds are exact in any order: repeated rows too
            tok = torch.randint(0, T, (T,), device=dev, dtype=torch.int32)
        count = None if vtc is None else torch.tensor([T - T // 3], device=dev, dtype=torch.int32)
        if use_compiled and T != 128:
            continue  # one compiled shape per dtype
        op = compiled if use_compiled else mk.scatter_add_dense_tokens

        def same(a, b, dtype=dtype):
            if dtype == torch.int32 or dtype == torch.float32:
                return torch.equal(a, b)  # one add per row: exact either way
            return torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)

        run(
            f"scatter T={T} D={D} {dtype} vtc={vtc} compiled={use_compiled}",
            lambda o=out, s=src, t=tok, c=count: scatter(fb.scatter_add_dense_tokens, o, s, t, c),
            lambda o=out, s=src, t=tok, c=count, op=op: scatter(op, o, s, t, c),
            same,
        )


def first_rows(n: int, *pairs) -> bool:
    """Each (want, got) pair bitwise equal on its first ``n`` rows."""
    return all(same_bits(w[:n], g[:n]) for w, g in pairs)


def silu_cases() -> None:
    c_mul = torch.compile(mk.silu_mul, fullgraph=True)
    c_quant = torch.compile(mk.silu_mul_quant, fullgraph=True)
    for T, D, contiguous, ub, vtc, use_compiled in itertools.product(
        (1, 128, 2048, 4096, 16384), (5120, 7168), (True, False), (None, 1200.0),
        (None, "partial"), (False, True),
    ):  # fmt: skip
        if use_compiled and (T, D, vtc) != (128, 5120, None):
            continue  # one compiled shape per form
        g = torch.Generator(device=dev).manual_seed(T + D)
        x = torch.randn(T, 2 * D, device=dev, dtype=torch.bfloat16, generator=g)
        x = torch.sign(x) * x.abs().clamp(0.01, 2.0)  # FBGEMM's quant test inputs
        x0, x1 = x[:, :D], x[:, D:]
        if contiguous:
            x0, x1 = x0.contiguous(), x1.contiguous()
        n = T if vtc is None else T - T // 3
        count = None if vtc is None else torch.tensor([n], device=dev, dtype=torch.int32)
        ub_t = None if ub is None else torch.tensor([ub], device=dev, dtype=torch.float32)
        tag = f"T={T} D={D} contiguous={contiguous} vtc={vtc} compiled={use_compiled}"
        if ub is None:
            op = c_mul if use_compiled else mk.silu_mul
            run(f"silu_mul {tag}", lambda x0=x0, x1=x1, c=count: fb.silu_mul(x0, x1, c),
                lambda x0=x0, x1=x1, c=count, op=op: op(x0, x1, c),
                lambda a, b, n=n: first_rows(n, (a, b)))  # fmt: skip
        op = c_quant if use_compiled else mk.silu_mul_quant
        run(f"silu_mul_quant {tag} ub={ub}",
            lambda x0=x0, x1=x1, u=ub_t, c=count: fb.silu_mul_quant(x0, x1, u, c),
            lambda x0=x0, x1=x1, u=ub_t, c=count, op=op: op(x0, x1, u, c),
            lambda a, b, n=n: first_rows(n, (a[0], b[0]), (a[1], b[1])))  # fmt: skip


def gather_quant_cases() -> None:
    compiled = torch.compile(mk.gather_scale_quant_dense_tokens, fullgraph=True)
    for E, T, D, rowmajor, ub, use_compiled in itertools.product(
        (2, 4, 8), (1, 128, 2048, 4096, 16384), (5120, 7168), (True, False), (None, 1200.0),
        (False, True),
    ):  # fmt: skip
        if T == 16384 and (E > 2 or D > 5120):
            continue  # FBGEMM's test skips these (memory)
        if use_compiled and (E, T, D) != (4, 128, 5120):
            continue
        g = torch.Generator(device=dev).manual_seed(E * T + D)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
        expert = torch.randint(0, E, (T,), device=dev, generator=g)
        token = torch.randperm(T, device=dev, generator=g).to(torch.int32)
        scores = torch.randn(E, T, device=dev, dtype=torch.bfloat16, generator=g).t()
        if rowmajor:
            scores = scores.contiguous()
        ub_t = None if ub is None else torch.tensor([ub], device=dev, dtype=torch.float32)
        op = compiled if use_compiled else mk.gather_scale_quant_dense_tokens
        args = (x, token, expert, scores, ub_t)
        run(f"gather_scale_quant E={E} T={T} D={D} row={rowmajor} ub={ub} "
            f"compiled={use_compiled}",
            lambda a=args: fb.gather_scale_quant_dense_tokens(*a),
            lambda a=args, op=op: op(*a),
            lambda w, o, n=T: first_rows(n, (w[0], o[0]), (w[1], o[1])))  # fmt: skip


def padded_scatter_cases() -> None:
    def scatter(op, src, counts, tok, out):
        res = out.clone()
        op(src, counts, tok, res)
        return res

    compiled = torch.compile(mk.scatter_add_padded_tokens, fullgraph=True)
    for T, E, EP, balanced, use_compiled in itertools.product(
        (64, 128, 256), (16, 128), (2, 4, 8, 16), (True, False), (False, True)
    ):
        if use_compiled and (T, E, EP) != (128, 16, 4):
            continue
        if balanced and T < E:
            continue  # FBGEMM's test skips these
        g = torch.Generator(device=dev).manual_seed(T * E + EP)
        src = torch.randn(EP, T, 5120, device=dev, dtype=torch.bfloat16, generator=g)
        out = torch.randn(T, 5120, device=dev, dtype=torch.bfloat16, generator=g)
        if balanced:
            counts = torch.full((E,), T // E, device=dev, dtype=torch.int32)
        else:
            choices = torch.randint(0, E, (T,), device=dev, generator=g)
            counts = torch.bincount(choices, minlength=E)  # int64
        tok = torch.randperm(T, device=dev, generator=g).to(torch.int32)
        op = compiled if use_compiled else mk.scatter_add_padded_tokens
        run(f"scatter_add_padded T={T} E={E} EP={EP} balanced={balanced} "
            f"compiled={use_compiled}",
            lambda a=(src, counts, tok, out): scatter(fb.scatter_add_padded_tokens, *a),
            lambda a=(src, counts, tok, out), op=op: scatter(op, *a),
            same_bits)  # fmt: skip


def shuffling_cases() -> None:
    quick = "--quick" in sys.argv  # one (E, EP): FBGEMM autotunes 24 configs per (E, EP, ...)
    for n, E, EP, sparse, padded, combine in itertools.product(
        (1, 3, 123, 1234, 4567, 16384) if quick else (1, 3, 123, 128, 1234, 2048, 4567, 4096,
                                                      8192, 16384),
        (16,) if quick else (16, 128), (4,) if quick else (4, 8),
        (True, False), (False, True), (True, False),
    ):  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(n * E + EP)
        if sparse:
            n, n_local, start, end = n * EP, E, 1, 1 + E // EP
        else:
            n_local, start, end = E // EP, 0, E // EP
        if padded and n % EP:
            continue  # padded needs T % EP == 0
        tokens = torch.randn(n, 5120, device=dev, dtype=torch.bfloat16, generator=g)
        total_rows = n // EP if padded else n  # padded: every rank's rows fit in n / EP
        cuts = torch.randint(0, total_rows + 1, (n_local * EP + 1,), device=dev, generator=g,
                             dtype=torch.int32).sort().values  # fmt: skip
        cuts[0], cuts[-1] = 0, total_rows
        counts = (cuts[1:] - cuts[:-1]).reshape(EP, n_local).contiguous()
        total = int(counts[:, start:end].sum()) if combine else int(counts.sum())
        args = (tokens, counts, start, end, padded)
        tag = f"n={n} E={E} EP={EP} sparse={sparse} padded={padded}"
        if combine:

            def same(w, o, t=total):
                return first_rows(t, (w[0], o[0])) and same_bits(w[1], o[1])

            run(f"combine_shuffling {tag}", lambda a=args: fb.combine_shuffling(*a),
                lambda a=args: mk.combine_shuffling(*a), same)  # fmt: skip
        else:
            run(f"split_shuffling {tag}", lambda a=args: fb.split_shuffling(*a),
                lambda a=args: mk.split_shuffling(*a),
                lambda w, o, a=args: same_bits(*written(w, o, *a[1:])))  # fmt: skip


def written(want, got, counts, start, end, padded):
    """split_shuffling's written rows of both outputs (FBGEMM leaves the others unwritten):
    the rank-major blocks of the experts in [start, end)."""
    EP, E = counts.shape
    per_rank = want.shape[0] // EP if padded else 0
    keep = torch.zeros(want.shape[0], dtype=torch.bool, device=want.device)
    offset = 0
    for r, row in enumerate(counts.tolist()):
        offset = r * per_rank if padded else offset
        for e, c in enumerate(row):
            if start <= e < end:
                keep[offset : offset + c] = True
            offset += c
    return want[keep], got[keep]


def main() -> None:
    parts = (scatter_cases, gather_cases, index_shuffling_cases, silu_cases, gather_quant_cases,
             padded_scatter_cases, shuffling_cases)  # fmt: skip
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--parts=")), None)
    for part in parts:
        if only and part.__name__ not in only:
            continue
        part()
        print(
            f"{part.__name__}: {STATS['cases']} cases so far, we reject "
            f"{len(STATS['ours_rejects'])}, mismatches {len(STATS['mismatch'])}",
            flush=True,
        )
    torch.cuda.synchronize()
    bad = STATS["ours_rejects"] + STATS["mismatch"]
    n_ours, n_bad = len(STATS["ours_rejects"]), len(STATS["mismatch"])
    print(f"cases {STATS['cases']}: FBGEMM rejects {STATS['fbgemm_rejects']}, we reject {n_ours}")
    print(f"  that FBGEMM takes, mismatches {n_bad}")
    for line in bad[:30]:
        print("  ", line)
    print("fbgemm parity:", "pass" if not bad else "FAIL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
