"""The expert-parallel token reshuffles on the GPU (``combine_shuffling``, ``split_shuffling``,
``scatter_add_padded_tokens``), bit for bit against the reference run on the CPU
(``moe_kernels.reference``): outputs poisoned with NaN first, calls under the no-sync guard,
a second call with the same bits.

* shuffles over FBGEMM's test forms (D 5120 bf16, T 1 to 4567, E 16 / 128, EP 4 / 8, dense
  (EP, E / EP) counts and sparse (EP, E) counts over experts [1, 1 + E / EP)), odd D, E 96 and
  320, int32 / int64 counts with zero experts and empty ranks, all-zero counts, padded rank
  blocks, an empty range, fp32 / fp16 / fp8 / int64 tokens, strided tokens, one rank; the
  one-element scan tiles (one rank, one local expert) Triton 3.6's compiler once failed on;
* the padded scatter-add over FBGEMM's forms (T 64 to 256, E 16 / 128, EP 2 to 16, balanced
  int32 and bincount int64 counts), top-k duplicates, odd D, indices -1 and out of range, counts
  with zeros, empty ranks and past T_K, fp32 / int32 outputs, strided inputs;
* a CUDA graph replayed after tokens, counts and indices changed in place; ``torch.compile``.

``MOE_GPU_FULL=1`` adds the big shape (T = 524288 rows, D = 2048, EP 8, E 128, reference on the
GPU). FBGEMM parity: ``test_fbgemm_parity_gpu.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import padded_tokens as ref_pt
from moe_kernels.reference import shuffling as ref_sh
from moe_kernels.testing import (
    bits_equal,
    capture,
    compile_fresh,
    ep_inputs,
    forbid_host_sync,
    full_run,
    gpu_test_device,
    poison,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
FULL = pytest.mark.skipif(not full_run(), reason="a GiB-sized shape: MOE_GPU_FULL=1")
FB_D = 5120 if ON_GPU else 64
gen, ref_shuffle = ep_inputs.gen, ep_inputs.ref_shuffle
tokens_of = functools.partial(ep_inputs.tokens_of, device=DEV)
split_counts = functools.partial(ep_inputs.split_counts, device=DEV)
scatter_problem = functools.partial(ep_inputs.scatter_problem, device=DEV)


def shuffle_cases() -> list:
    cases = []
    for rows in (1, 3, 123, 1234, 4567) if ON_GPU else (1, 3, 40):
        for experts in (16, 128):
            for ep in (4, 8):
                x = tokens_of(rows, FB_D, torch.bfloat16, rows + experts)
                dense = split_counts(rows, ep, experts // ep, rows + ep)
                cases.append((f"fb dense T={rows} E={experts} EP={ep}", x, dense, 0,
                              experts // ep, False))  # fmt: skip
                xs = tokens_of(rows * ep, FB_D, torch.bfloat16, rows + 1)
                sparse = split_counts(rows * ep, ep, experts, rows + 2)
                cases.append((f"fb sparse T={rows * ep} E={experts} EP={ep}", xs, sparse, 1,
                              1 + experts // ep, False))  # fmt: skip
    zeros = split_counts(300, 8, 12, 5, torch.int64)
    zeros[:, 3] = 0
    zeros[2] = 0  # an empty rank
    cases += [
        ("odd D=130 fp32 E=96 int64", tokens_of(300, 130, torch.float32, 6), zeros, 0, 12, False),
        ("D=7 fp16 E=320 sparse", tokens_of(999, 7, torch.float16, 7),
         split_counts(999, 8, 320, 8), 40, 80, False),
        ("all-zero counts", tokens_of(64, 256, torch.bfloat16, 9),
         torch.zeros(4, 8, dtype=torch.int32, device=DEV), 0, 8, False),
        ("empty range", tokens_of(64, 256, torch.bfloat16, 10), split_counts(64, 4, 8, 11), 3, 3,
         False),
        ("fp8 E=320 padded", tokens_of(8 * 40, 512, torch.float8_e4m3fn, 12),
         split_counts(0, 8, 320, 13, cap=40), 100, 140, True),
        ("int64 padded EP=4", tokens_of(4 * 100, 33, torch.int64, 14),
         split_counts(0, 4, 16, 15, torch.int64, cap=100), 0, 16, True),
        ("bf16 padded FBGEMM-size", tokens_of(8 * 512, FB_D, torch.bfloat16, 16),
         split_counts(0, 8, 16, 17, cap=512), 0, 16, True),
        ("strided tokens", tokens_of(500, 2 * 384, torch.bfloat16, 18)[:, ::2],
         split_counts(480, 4, 6, 19), 1, 5, False),
        ("EP=1", tokens_of(77, 96, torch.bfloat16, 20), split_counts(77, 1, 5, 21), 0, 5, False),
    ]  # fmt: skip
    return cases


def test_shuffles_match_the_reference():
    bad = []
    for name, x, counts, start, end, padded in shuffle_cases():
        poison(x.numel() * x.element_size(), device=DEV)
        with forbid_host_sync(ON_GPU):
            out, cnt = mk.combine_shuffling(x, counts, start, end, padded)
            back = mk.split_shuffling(x, counts, start, end, padded)
            again = mk.combine_shuffling(x, counts, start, end, padded)
        r_out, r_cnt = ref_shuffle(x, counts, start, end, padded, True)
        r_back, _ = ref_shuffle(x, counts, start, end, padded, False)
        ok = bits_equal(out, r_out) and bits_equal(cnt, r_cnt) and bits_equal(back, r_back)
        if not (ok and bits_equal(out, again.tokens)):
            bad.append(name)
    assert not bad


@pytest.mark.parametrize(
    "ranks,experts,start,end,rows,dim",
    [(16, 16, 15, 16, 32, 5120), (1, 4, 0, 1, 64, 256), (1, 1, 0, 1, 16, 128),
     (16, 80, 5, 6, 64, 512), (8, 16, 2, 4, 64, 512), (4, 8, 0, 2, 4096, 64)],
)  # fmt: skip
@pytest.mark.parametrize("padded", [True, False])
def test_shuffles_with_one_element_scan_tiles(ranks, experts, start, end, rows, dim, padded):
    """One rank, one or two local experts: scans over tiny tiles (one local expert of 80 at 16
    ranks, FBGEMM's padded case, and two local experts beside 4+ ranks failed Triton 3.6's
    compiler, ScanOpToLLVM)."""
    g = gen(ranks * 1000 + experts)
    per = rows // ranks
    counts = torch.zeros(ranks, experts, dtype=torch.int32)
    for r in range(ranks):  # rank r's rows over random experts, at most rows // ranks in all
        left = int(torch.randint(0, per + 1, (1,), generator=g))
        for e in torch.randint(0, experts, (left,), generator=g).tolist():
            counts[r, e] += 1
    x = torch.randn(rows, dim, generator=g).bfloat16()
    got = mk.combine_shuffling(x.to(DEV), counts.to(DEV), start, end, padded)
    want = ref_sh.combine_shuffling(x, counts, start, end, padded)
    assert bits_equal(tuple(got), tuple(want))
    back = mk.split_shuffling(got.tokens, counts.to(DEV), start, end, padded)
    assert bits_equal(back, ref_sh.split_shuffling(want[0], counts, start, end, padded))


@FULL
def test_shuffles_at_the_big_shape():
    rows, dim, ep, experts = 65536 * 8, 2048, 8, 128
    x = tokens_of(rows, dim, torch.bfloat16, 30)
    for counts, start, end, padded in (
        (split_counts(rows, ep, experts // ep, 31), 0, experts // ep, False),
        (split_counts(rows, ep, experts, 32, torch.int64), 16, 32, False),
        (split_counts(0, ep, experts // ep, 33, cap=rows // ep), 0, experts // ep, True),
    ):
        out, cnt = mk.combine_shuffling(x, counts, start, end, padded)
        back = mk.split_shuffling(x, counts, start, end, padded)
        r_out, r_cnt = ref_shuffle(x, counts, start, end, padded, True, DEV)
        r_back, _ = ref_shuffle(x, counts, start, end, padded, False, DEV)
        assert bits_equal(out, r_out) and bits_equal(cnt, r_cnt) and bits_equal(back, r_back)


# ------------------------------------------------------------------------------ padded scatter


def ref_scatter(x, cnt, idx, out, device="cpu") -> torch.Tensor:
    r = out.to(device).clone()
    ref_pt.scatter_add_padded_tokens(x.to(device), cnt.to(device), idx.to(device), r)
    return r


def scatter_cases() -> list:
    cases = []
    for rows in (64, 128, 256) if ON_GPU else (64,):
        for experts in (16, 128):
            for ep in (2, 4, 8, 16) if ON_GPU else (2, 16):
                for form in ("balanced", "bincount"):
                    if form == "balanced" and rows < experts:
                        continue
                    cases.append((f"fb T={rows} E={experts} EP={ep} {form}",
                                  scatter_problem(ep, rows, FB_D, experts, rows, rows + ep,
                                                  counts=form)))  # fmt: skip
    odd = torch.tensor([0, 5, 0, 9, 0, 0, 3, 2] * 12)  # E = 96, zero experts, EP 8: ranks of 12
    odd[:24] = 0  # two empty ranks
    past = torch.full((320,), 9)  # 2880 positions for T_K = 2048: past T_K
    cases += [
        ("top-8 dup E=96 odd D fp32<-bf16", scatter_problem(8, 8 * 200, 130, 96, 200, 1,
         out_dtype=torch.float32, counts=odd * 2, top_k=8)),
        ("E=320 past T_K", scatter_problem(8, 2048, 256, 320, 256, 2, counts=past, top_k=8)),
        ("int32 tokens", scatter_problem(4, 512, 64, 16, 128, 3, in_dtype=torch.int32,
         out_dtype=torch.int32, top_k=4)),
        ("EP=1 E=1", scatter_problem(1, 100, 48, 1, 100, 4)),
    ]  # fmt: skip
    x, cnt, idx, out = scatter_problem(4, 300, 96, 16, 300, 5)
    idx[::7] = -1
    idx[3::11] = 1000  # out of range: skipped
    cases.append(("indices -1 / out of range, strided", (x[:, :, ::2], cnt, idx, out[:, 1::2])))
    return cases


def same_sum(got, want, x, cnt, idx, out0) -> bool:
    """Bit for bit on the GPU. In the CPU smoke run the interpreter truncates each bf16 add where
    the reference rounds it to nearest: a row of n adds then differs by at most n + 1 steps of
    its largest partial sum, bounded by the sum of its terms' magnitudes."""
    if ON_GPU or got.dtype != torch.bfloat16:
        return bits_equal(got, want)
    f32 = torch.float32
    mag = ref_scatter(x.abs().to(f32), cnt, idx, out0.abs().to(f32))
    adds = ref_scatter(torch.ones_like(x, dtype=f32), cnt, idx, torch.zeros_like(out0, dtype=f32))
    bound = 2.0**-7 * (adds + 1) * mag
    return bool(((got.cpu().double() - want.cpu().double()).abs() <= bound.double()).all())


def test_padded_scatter_add_matches_the_reference():
    bad = []
    for name, (x, cnt, idx, out0) in scatter_cases():
        want = ref_scatter(x, cnt, idx, out0)
        outs = []
        for _ in range(2):
            out = out0.clone()
            with forbid_host_sync(ON_GPU):
                mk.scatter_add_padded_tokens(x, cnt, idx, out)
            outs.append(out)
        if not (same_sum(outs[0], want, x, cnt, idx, out0) and bits_equal(outs[0], outs[1])):
            bad.append(name)
    assert not bad


@FULL
def test_padded_scatter_add_at_the_big_shape():
    ep, rows, dim, experts = 8, 65536 * 8, 2048, 128
    x, cnt, idx, out = scatter_problem(ep, rows, dim, experts, rows // 8, 40, top_k=8)
    want = ref_scatter(x, cnt, idx, out, DEV)
    mk.scatter_add_padded_tokens(x, cnt, idx, out)
    assert bits_equal(out, want)


# ------------------------------------------------------------------------------ graph, compile


def test_graph_replay_and_compile():
    rows, dim, ep, cols = (4096, 1024, 8, 16) if ON_GPU else (64, 32, 4, 4)
    x = tokens_of(rows, dim, torch.bfloat16, 50)
    counts = split_counts(rows, ep, cols, 51)
    sx, scnt, sidx, sout = scatter_problem(ep, rows, dim, 2 * ep, rows // 4, 52, top_k=4)
    sout0 = sout.clone()
    if ON_GPU:

        def step():
            out, cnt = mk.combine_shuffling(x, counts, 1, cols)
            back = mk.split_shuffling(out, counts, 1, cols)
            mk.scatter_add_padded_tokens(sx, scnt, sidx, sout)
            return out, cnt, back

        graph, (g_out, g_cnt, g_back) = capture(step)
        x.copy_(tokens_of(rows, dim, torch.bfloat16, 53))
        counts.copy_(split_counts(rows, ep, cols, 54))
        sx.copy_(torch.randn_like(sx))
        scnt.copy_(scnt.flip(0))
        sidx.copy_(sidx.flip(0))
        sout.copy_(sout0)
        graph.replay()
        torch.cuda.synchronize()
        r_out, r_cnt = ref_shuffle(x, counts, 1, cols, False, True)
        r_back, _ = ref_shuffle(r_out, counts, 1, cols, False, False)
        assert bits_equal(g_out, r_out) and bits_equal(g_cnt, r_cnt) and bits_equal(g_back, r_back)
        assert bits_equal(sout, ref_scatter(sx, scnt, sidx, sout0))

    def fn(x, counts, sx, scnt, sidx, sout):
        out, cnt = mk.combine_shuffling(x * 2, counts, 1, cols, False)
        back = mk.split_shuffling(out, counts, 1, cols, is_padded=False)
        padded = mk.combine_shuffling(x, counts, is_padded=True).tokens
        mk.scatter_add_padded_tokens(sx, scnt, sidx, sout)
        return out, cnt, back + 1, padded, sout * 1

    eager = fn(x, counts, sx, scnt, sidx, sout0.clone())
    compiled = compile_fresh(fn)(x, counts, sx, scnt, sidx, sout0.clone())
    assert bits_equal(eager, compiled)
