"""Argument parity with FBGEMM's gen_ai MoE ops (one H200 run, fbgemm-gpu-genai carried as a
wheel): every call FBGEMM accepts, ours accepts too and gives the same result. The calls follow the
shapes and argument forms of FBGEMM's own tests: T up to 16384, E in {16, 32, 128, 320}, k in
{1, 2, 4, 8} (five (T, E, k) problems), bf16 / fp32 scores in row- and column-major layouts,
partial valid counts as int32 and int64 tensors, int32 / int64 index tensors, bf16 / fp32 / int32
tokens; eager and compiled.

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/fbgemm_parity.py

Equal means: index_shuffling's counts equal and each expert's bucket holds the same tokens (FBGEMM's
order inside a bucket varies run to run; ours is sorted); gather bit-exact; scatter-add exact for
integer tokens and within bf16 rounding for float tokens (FBGEMM adds with atomics in any order).
"""

from __future__ import annotations

import itertools
import sys

import torch

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


def main() -> None:
    for part in (scatter_cases, gather_cases, index_shuffling_cases):
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
