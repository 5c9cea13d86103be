"""Argument parity with FBGEMM's gen_ai MoE ops (needs ``fbgemm_gpu``: skipped without it):
every call of FBGEMM's test forms that FBGEMM takes, ours takes too and gives the same result
on the rows FBGEMM writes.

The forms of FBGEMM's activation, gather-scatter and shuffling tests: ``index_shuffling`` (five
(T, E, k) problems, bf16 / fp32 scores, row- and column-major, valid counts as int32 / int64),
``gather_scale_dense_tokens``, ``scatter_add_dense_tokens`` (bf16 / fp32 / int32), ``silu_mul`` /
``silu_mul_quant`` (T 1 to 16384, D 5120 / 7168, halves or contiguous, scale_ub None / 1200,
valid counts), ``gather_scale_quant_dense_tokens``, ``scatter_add_padded_tokens`` (T 64 to 256, E
16 / 128, EP 2 to 16, balanced int32 / bincount int64 counts), ``combine_shuffling`` /
``split_shuffling`` (dense and sparse expert ranges, padded, int32 / int64 counts); eager and,
one shape a form, compiled.

Equal means: index_shuffling's counts equal and each expert's bucket the same tokens (FBGEMM's
order inside a bucket varies run to run; ours is sorted); the others bit for bit (fp8 data and
scales byte for byte) on the rows FBGEMM writes (below the valid count; the shuffles' rows below
the total count), the dense bf16 scatter-add within bf16 rounding (FBGEMM's atomics add in any
order). FBGEMM autotunes its shuffle kernel per (E, EP, ...): one (E, EP) of the shuffles' grid
by default, all of it with ``MOE_GPU_FULL=1``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_kernels as mk
from moe_kernels.testing import bits_equal, compile_fresh, full_run, gpu_test_device

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device and fbgemm_gpu"),
]
BF16, FP32, INT32 = torch.bfloat16, torch.float32, torch.int32


@pytest.fixture(scope="module")
def fb():
    return pytest.importorskip("fbgemm_gpu.experimental.gen_ai.moe")


class Parity:
    """Calls FBGEMM then ours; FBGEMM refusing a call is no case. ``check()`` asserts that we
    took and matched every call FBGEMM took."""

    def __init__(self) -> None:
        self.cases, self.fb_rejects, self.ours_rejects, self.mismatches = 0, 0, [], []

    def run(self, name: str, fb_call, our_call, same) -> None:
        self.cases += 1
        try:
            want = fb_call()
        except Exception:  # noqa: BLE001 - FBGEMM does not take this call: nothing to match
            self.fb_rejects += 1
            return
        try:
            got = our_call()
        except Exception as exc:  # noqa: BLE001
            self.ours_rejects.append(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
            return
        if not same(want, got):
            self.mismatches.append(name)

    def check(self) -> None:
        assert self.cases > self.fb_rejects, "FBGEMM took none of the calls"
        assert not self.ours_rejects, "; ".join(self.ours_rejects[:5])
        assert not self.mismatches, ", ".join(self.mismatches[:8])


def first_rows(n: int, *pairs) -> bool:
    """Each (want, got) pair bitwise equal on its first ``n`` rows."""
    return all(bits_equal(w[:n], g[:n]) for w, g in pairs)


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


def test_index_shuffling(fb):
    p, compiled = Parity(), compile_fresh(mk.index_shuffling)
    problems = ((3, 16, 2), (123, 32, 4), (1234, 128, 8), (4096, 320, 2), (16384, 16, 1))
    for (T, E, k), dtype, colmajor, vtc in itertools.product(
        problems, (BF16, FP32), (False, True), (None, "int32", "int64")
    ):
        scores = torch.randn(2 * T if vtc else T, E, device=DEV, dtype=dtype)
        if colmajor:
            scores = scores.t().contiguous().t()
        count = None if vtc is None else torch.tensor([T], device=DEV, dtype=getattr(torch, vtc))
        op = compiled if (T, E, dtype, vtc) == (1234, 128, BF16, "int32") else mk.index_shuffling
        p.run(f"T={T} E={E} k={k} {dtype} col={colmajor} vtc={vtc}",
              lambda s=scores, c=count, k=k: fb.index_shuffling(s, None, None, c, top_k=k)[:3],
              lambda s=scores, c=count, k=k, op=op: op(s, None, None, c, k),
              same_buckets)  # fmt: skip
    p.check()


def test_gather_scale_dense_tokens(fb):
    p, compiled = Parity(), compile_fresh(mk.gather_scale_dense_tokens)
    for T, E, rowmajor, use_compiled in itertools.product((1, 128, 4096), (2, 8), (True, False),
                                                          (False, True)):  # fmt: skip
        if use_compiled and (T, E) != (128, 2):
            continue  # one compiled shape: recompiles per shape cost seconds each
        x = torch.randn(T, 5120, device=DEV, dtype=BF16).abs()
        expert = torch.randint(0, E, (T,), device=DEV)  # int64, as in FBGEMM's tests
        token = torch.randperm(T, device=DEV).to(INT32)
        scores = torch.rand(E, T, device=DEV, dtype=BF16).t()  # column-major
        if rowmajor:
            scores = scores.contiguous()
        op = compiled if use_compiled else mk.gather_scale_dense_tokens
        args = (x, token, expert, scores)
        p.run(f"T={T} E={E} row={rowmajor} compiled={use_compiled}",
              lambda a=args: fb.gather_scale_dense_tokens(*a), lambda a=args, op=op: op(*a),
              torch.equal)  # fmt: skip
    p.check()


def test_scatter_add_dense_tokens(fb):
    def scatter(op, out, src, tok, vtc):
        res = out.clone()
        op(res, src, tok, vtc)
        return res

    p, compiled = Parity(), compile_fresh(mk.scatter_add_dense_tokens)
    for T, dtype, vtc, use_compiled in itertools.product(
        (1, 128, 16384), (BF16, FP32, INT32), (None, "partial"), (False, True)
    ):
        if use_compiled and T != 128:
            continue  # one compiled shape per dtype
        if dtype == INT32:
            src = torch.randint(-(2**20), 2**20, (T, 5120), device=DEV, dtype=dtype)
            out = torch.randint(-(2**20), 2**20, (T, 5120), device=DEV, dtype=dtype)
            tok = torch.randint(0, T, (T,), device=DEV, dtype=INT32)  # exact in any order
        else:
            src = torch.randn(T, 5120, device=DEV, dtype=dtype)
            out = torch.randn(T, 5120, device=DEV, dtype=dtype)
            tok = torch.randperm(T, device=DEV).to(INT32)
        count = None if vtc is None else torch.tensor([T - T // 3], device=DEV, dtype=INT32)
        op = compiled if use_compiled else mk.scatter_add_dense_tokens

        def same(a, b, dtype=dtype):
            if dtype in (INT32, FP32):
                return torch.equal(a, b)  # one add per row: exact either way
            return torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)

        args = (out, src, tok, count)
        p.run(f"T={T} {dtype} vtc={vtc} compiled={use_compiled}",
              lambda a=args: scatter(fb.scatter_add_dense_tokens, *a),
              lambda a=args, op=op: scatter(op, *a), same)  # fmt: skip
    p.check()


def test_silu_mul_and_quant(fb):
    p = Parity()
    c_mul, c_quant = compile_fresh(mk.silu_mul), compile_fresh(mk.silu_mul_quant)
    for T, D, contiguous, ub, vtc, use_compiled in itertools.product(
        (1, 128, 2048, 4096, 16384), (5120, 7168), (True, False), (None, 1200.0),
        (None, "partial"), (False, True),
    ):  # fmt: skip
        if use_compiled and (T, D, vtc) != (128, 5120, None):
            continue  # one compiled shape per form
        g = torch.Generator(device=DEV).manual_seed(T + D)
        x = torch.randn(T, 2 * D, device=DEV, dtype=BF16, generator=g)
        x = torch.sign(x) * x.abs().clamp(0.01, 2.0)  # FBGEMM's quant test inputs
        x0, x1 = x[:, :D], x[:, D:]
        if contiguous:
            x0, x1 = x0.contiguous(), x1.contiguous()
        n = T if vtc is None else T - T // 3
        count = None if vtc is None else torch.tensor([n], device=DEV, dtype=INT32)
        ub_t = None if ub is None else torch.tensor([ub], device=DEV, dtype=FP32)
        tag = f"T={T} D={D} contiguous={contiguous} vtc={vtc} compiled={use_compiled}"
        if ub is None:
            op = c_mul if use_compiled else mk.silu_mul
            p.run(f"silu_mul {tag}", lambda x0=x0, x1=x1, c=count: fb.silu_mul(x0, x1, c),
                  lambda x0=x0, x1=x1, c=count, op=op: op(x0, x1, c),
                  lambda a, b, n=n: first_rows(n, (a, b)))  # fmt: skip
        op = c_quant if use_compiled else mk.silu_mul_quant
        p.run(f"silu_mul_quant {tag} ub={ub}",
              lambda x0=x0, x1=x1, u=ub_t, c=count: fb.silu_mul_quant(x0, x1, u, c),
              lambda x0=x0, x1=x1, u=ub_t, c=count, op=op: op(x0, x1, u, c),
              lambda a, b, n=n: first_rows(n, (a[0], b[0]), (a[1], b[1])))  # fmt: skip
    p.check()


def test_gather_scale_quant_dense_tokens(fb):
    p, compiled = Parity(), compile_fresh(mk.gather_scale_quant_dense_tokens)
    for E, T, D, rowmajor, ub, use_compiled in itertools.product(
        (2, 4, 8), (1, 128, 2048, 4096, 16384), (5120, 7168), (True, False), (None, 1200.0),
        (False, True),
    ):  # fmt: skip
        if T == 16384 and (E > 2 or D > 5120):
            continue  # FBGEMM's test skips these (memory)
        if use_compiled and (E, T, D) != (4, 128, 5120):
            continue
        g = torch.Generator(device=DEV).manual_seed(E * T + D)
        x = torch.randn(T, D, device=DEV, dtype=BF16, generator=g)
        expert = torch.randint(0, E, (T,), device=DEV, generator=g)
        token = torch.randperm(T, device=DEV, generator=g).to(INT32)
        scores = torch.randn(E, T, device=DEV, dtype=BF16, generator=g).t()
        if rowmajor:
            scores = scores.contiguous()
        ub_t = None if ub is None else torch.tensor([ub], device=DEV, dtype=FP32)
        op = compiled if use_compiled else mk.gather_scale_quant_dense_tokens
        args = (x, token, expert, scores, ub_t)
        p.run(f"E={E} T={T} D={D} row={rowmajor} ub={ub} compiled={use_compiled}",
              lambda a=args: fb.gather_scale_quant_dense_tokens(*a), lambda a=args, op=op: op(*a),
              lambda w, o, n=T: first_rows(n, (w[0], o[0]), (w[1], o[1])))  # fmt: skip
    p.check()


def test_scatter_add_padded_tokens(fb):
    def scatter(op, src, counts, tok, out):
        res = out.clone()
        op(src, counts, tok, res)
        return res

    p, compiled = Parity(), compile_fresh(mk.scatter_add_padded_tokens)
    for T, E, EP, balanced, use_compiled in itertools.product(
        (64, 128, 256), (16, 128), (2, 4, 8, 16), (True, False), (False, True)
    ):
        if (use_compiled and (T, E, EP) != (128, 16, 4)) or (balanced and T < E):
            continue  # one compiled shape; FBGEMM's test skips balanced T < E
        g = torch.Generator(device=DEV).manual_seed(T * E + EP)
        src = torch.randn(EP, T, 5120, device=DEV, dtype=BF16, generator=g)
        out = torch.randn(T, 5120, device=DEV, dtype=BF16, generator=g)
        if balanced:
            counts = torch.full((E,), T // E, device=DEV, dtype=INT32)
        else:
            choices = torch.randint(0, E, (T,), device=DEV, generator=g)
            counts = torch.bincount(choices, minlength=E)  # int64
        tok = torch.randperm(T, device=DEV, generator=g).to(INT32)
        op = compiled if use_compiled else mk.scatter_add_padded_tokens
        args = (src, counts, tok, out)  # each destination gets one row: any order is exact
        p.run(f"T={T} E={E} EP={EP} balanced={balanced} compiled={use_compiled}",
              lambda a=args: scatter(fb.scatter_add_padded_tokens, *a),
              lambda a=args, op=op: scatter(op, *a), bits_equal)  # fmt: skip
    p.check()


def written(want, got, counts, start, end, padded):
    """split_shuffling's written rows of both outputs (FBGEMM leaves the others unwritten): the
    rank-major blocks of the experts in [start, end)."""
    EP = counts.shape[0]
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


def test_combine_and_split_shuffling(fb):
    full = full_run()  # FBGEMM autotunes 24 configs per (E, EP, ...)
    p = Parity()
    for n, E, EP, sparse, padded, combine, cdt in itertools.product(
        (1, 3, 123, 128, 1234, 2048, 4567, 4096, 8192, 16384) if full
        else (1, 3, 123, 1234, 4567, 16384),
        (16, 128) if full else (16,), (4, 8) if full else (4,),
        (True, False), (False, True), (True, False), (INT32, torch.int64),
    ):  # fmt: skip
        g = torch.Generator(device=DEV).manual_seed(n * E + EP)
        if sparse:
            n, n_local, start, end = n * EP, E, 1, 1 + E // EP
        else:
            n_local, start, end = E // EP, 0, E // EP
        if padded and n % EP:
            continue  # padded needs T % EP == 0
        tokens = torch.randn(n, 5120, device=DEV, dtype=BF16, generator=g)
        total_rows = n // EP if padded else n  # padded: every rank's rows fit in n / EP
        cuts = torch.randint(0, total_rows + 1, (n_local * EP + 1,), device=DEV, generator=g,
                             dtype=INT32).sort().values  # fmt: skip
        cuts[0], cuts[-1] = 0, total_rows
        counts = (cuts[1:] - cuts[:-1]).reshape(EP, n_local).contiguous().to(cdt)
        total = int(counts[:, start:end].sum()) if combine else int(counts.sum())
        args = (tokens, counts, start, end, padded)
        tag = f"n={n} E={E} EP={EP} sparse={sparse} padded={padded} {cdt}"
        if combine:

            def same(w, o, t=total):
                return first_rows(t, (w[0], o[0])) and bits_equal(w[1], o[1])

            p.run(f"combine {tag}", lambda a=args: fb.combine_shuffling(*a),
                  lambda a=args: mk.combine_shuffling(*a), same)  # fmt: skip
        else:
            p.run(f"split {tag}", lambda a=args: fb.split_shuffling(*a),
                  lambda a=args: mk.split_shuffling(*a),
                  lambda w, o, a=args: bits_equal(*written(w, o, *a[1:])))  # fmt: skip
    p.check()
