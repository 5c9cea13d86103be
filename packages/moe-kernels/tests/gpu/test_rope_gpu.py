"""``qk_norm_rope`` (QK-norm + RoPE + KV ring write) on the GPU against the reference run on the
CPU (``moe_kernels.reference.rope``; the GPU's torch rsqrt is not IEEE).

The seed model's attention (N 512 tokens, H 32 query / K 16 kv heads, D 64, a cache of 4 layers x
17 slots), then fp32 / fp16, a ragged last block, D 128, D 48 (masked columns), without q, q / k
/ v as column slices of one projection, contiguous copies and a transposed layout. Outputs and
caches poisoned with NaN first:

* q_out and the written k slots within 3 ulp(r) (bf16 / fp16) or 8 ulp(r) (fp32), r the
  magnitude of the element's rotation pair of normed values (``tests/test_rope.py`` derives the
  bound); v slots bit for bit; every other cache element unchanged (NaN bits kept);
  ``k_cache._version`` bumped; a second call bitwise equal; no host sync;
* a CUDA graph replayed after the inputs and the slot tensor changed in place;
* ``torch.compile(fullgraph=True)`` of the model's denoise and commit forms: bit-equal to eager,
  Inductor's code launches the kernel itself, with no clone / copy and no buffer of the cache's
  shape (the cache is written in place).
"""

from __future__ import annotations

import pytest
import torch

import moe_kernels as mk
from moe_kernels.reference import rope as ref
from moe_kernels.testing import (
    bits_equal,
    capture,
    compile_fresh,
    forbid_host_sync,
    gpu_test_device,
    inductor_code,
    launched_by_inductor,
    poison,
)

DEV = gpu_test_device()
ON_GPU = DEV is not None and DEV.type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV is None, reason="needs a CUDA device (MOE_GPU_SMOKE=1: CPU smoke)"),
]
EPS = 1e-6
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
TOL_ULPS = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 8}
SEED = (512, 32, 16, 64, 4, 17) if ON_GPU else (16, 4, 2, 16, 2, 3)  # (N, H, K, D, L, S)
RING = 1  # the ring slot written (frame % window); the scratch slot is S - 1


class Problem:
    """q, k, v as column slices of one (N, (H + 2K) D) projection output (or a transposed copy),
    bf16 norm scales, fp32 angles, NaN-filled caches."""

    def __init__(self, N, H, K, D, L, S, dtype=torch.bfloat16, seed=0, transposed=False):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.shape, self.dtype = (N, H, K, D, L, S), dtype
        qkv = (torch.randn(N, (H + 2 * K) * D, generator=g, device=DEV) * 2 + 0.1).to(dtype)
        if transposed:
            qkv = qkv.T.contiguous().T  # column stride N
        self.qkv = qkv
        self.q, self.k, self.v = qkv[:, : H * D], qkv[:, H * D : (H + K) * D], qkv[:, (H + K) * D :]
        self.qw = (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16)
        self.kw = (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16)
        ang = torch.randn(N, D // 2, generator=g, device=DEV) * 3
        self.cos, self.sin = torch.cos(ang), torch.sin(ang)
        self.kc = torch.full((L, K, S, N, D), float("nan"), dtype=dtype, device=DEV)
        self.vc = torch.full_like(self.kc, float("nan"))

    def args(self, layer, slots, q=True, caches=None):
        kc, vc = caches or (self.kc, self.vc)
        return (self.q if q else None, self.k, self.v, self.qw if q else None, self.kw, self.cos,
                self.sin, kc, vc, layer, slots)  # fmt: skip


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    e = torch.floor(torch.log2(x.float().abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(e - MANTISSA[dtype])


def pair_norm(x_NC: torch.Tensor, w_D: torch.Tensor) -> torch.Tensor:
    """(h, N, D): the magnitude of each element's rotation pair of normed values."""
    D = w_D.shape[0]
    y = ref.rms_norm(x_NC.reshape(x_NC.shape[0], -1, D), w_D, EPS).float()
    r = y.unflatten(-1, (D // 2, 2)).norm(dim=-1, keepdim=True)
    return r.expand(*r.shape[:-1], 2).flatten(-2).transpose(0, 1)


def assert_within(got, want, r, dtype, what) -> None:
    got, want, r = got.cpu(), want.cpu(), r.cpu()
    if got.numel() == 0:
        return
    err = float(((got.float() - want.float()).abs() / ulp(r, dtype)).max())
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite"
    assert err <= TOL_ULPS[dtype], f"{what}: {err:.2f} ulp(r) from the reference"


def run_checked(p: Problem, layer: int, slots_list: list[int], q: bool = True) -> tuple:
    """One public call checked against the CPU reference: (q_out, k cache, v cache)."""
    N, H, K, D, L, S = p.shape
    slots = torch.tensor(slots_list, device=DEV)
    kc, vc = p.kc.clone(), p.vc.clone()
    poison(N * H * D * kc.element_size(), device=DEV)  # a fresh q_out starts as NaN
    version = kc._version
    with forbid_host_sync(ON_GPU):
        q_out = mk.qk_norm_rope(*p.args(layer, slots, q, (kc, vc)), eps=EPS)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in p.args(layer, slots, q)]
    cpu[7], cpu[8] = p.kc.cpu(), p.vc.cpu()
    want_q = ref.qk_norm_rope(*cpu, EPS)
    want_kc, want_vc = cpu[7], cpu[8]
    written = torch.zeros(L, K, S, dtype=torch.bool)
    written[layer, :, slots_list] = True
    kc_c, vc_c = kc.cpu(), vc.cpu()
    assert bits_equal(kc_c[~written], want_kc[~written]), "k cache changed outside the slots"
    assert bits_equal(vc_c[~written], want_vc[~written]), "v cache changed outside the slots"
    for s in slots_list:
        assert bits_equal(vc_c[layer, :, s], want_vc[layer, :, s]), "v slot not a bit copy"
        r_k = pair_norm(p.k.cpu(), p.kw.cpu())
        assert_within(kc_c[layer, :, s], want_kc[layer, :, s], r_k, p.dtype, f"k slot {s}")
    if q:
        assert_within(q_out, want_q, pair_norm(p.q.cpu(), p.qw.cpu()), p.dtype, "q")
    else:
        assert q_out.shape == (0, N, D)
    assert kc._version > version, "k_cache's version not bumped"
    return q_out, kc, vc


def test_seed_shape_and_layouts():
    L, S = SEED[4], SEED[5]
    p = Problem(*SEED, seed=1)
    a = run_checked(p, L - 2, [S - 1])
    assert bits_equal(a, run_checked(p, L - 2, [S - 1])), "a repeat call differs"
    run_checked(p, L - 2, [S - 1, RING])  # commit: the scratch and the ring slot in one call
    run_checked(p, L - 1, [RING], q=False)  # kv only
    c = Problem(*SEED, seed=1)
    c.q, c.k, c.v = c.q.contiguous(), c.k.contiguous(), c.v.contiguous()
    assert bits_equal(run_checked(c, L - 2, [S - 1])[0], a[0]), "column slices != copies"
    t = run_checked(Problem(*SEED, seed=1, transposed=True), L - 2, [S - 1])
    assert bits_equal(t[0], a[0]), "transposed layout != column slices"


OTHERS = [
    (512, 32, 16, 64, 4, 17, torch.float32),
    (512, 32, 16, 64, 4, 17, torch.float16),
    (100, 32, 16, 64, 2, 17, torch.bfloat16),  # ragged last block
    (2048, 16, 8, 128, 2, 9, torch.bfloat16),
    (300, 8, 4, 48, 2, 5, torch.bfloat16),  # D no power of two: masked columns
]


@pytest.mark.parametrize("shape", OTHERS, ids=[str(s) for s in OTHERS])
def test_other_shapes_and_dtypes(shape):
    *dims, dtype = shape
    if not ON_GPU:
        dims[0] = min(dims[0], 24)
    layer, last = dims[4] - 1, dims[5] - 1
    run_checked(Problem(*dims, dtype=dtype, seed=10), layer, [last, 0])
    run_checked(Problem(*dims, dtype=dtype, seed=11), 0, [0], q=False)


def test_graph_replay_with_new_inputs_and_slots():
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    S = SEED[5]
    p = Problem(*SEED, seed=3)
    slots = torch.tensor([S - 1, 0], device=DEV)
    graph, q_static = capture(lambda: mk.qk_norm_rope(*p.args(1, slots), eps=EPS))
    p.qkv.copy_(torch.randn_like(p.qkv.float()).to(p.dtype))
    slots.copy_(torch.tensor([S - 1, RING], device=DEV))
    kc, vc = p.kc.clone(), p.vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = mk.qk_norm_rope(*p.args(1, slots, caches=(kc, vc)), eps=EPS)
    assert bits_equal(q_static, want), "replayed q_out != eager on the new values"
    assert bits_equal(p.kc, kc) and bits_equal(p.vc, vc), "replay did not write the new slot"


def denoise(q, k, v, qw, kw, cos, sin, kc, vc, scratch):
    return mk.qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, 1, scratch, eps=EPS)


def commit(q, k, v, qw, kw, cos, sin, kc, vc, scratch, ring):
    q_out = mk.qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, 1, scratch, eps=EPS)
    mk.qk_norm_rope(None, k, v, None, kw, cos, sin, kc, vc, 1, ring, eps=EPS)
    return q_out


@pytest.mark.parametrize("fn,n_slots", [(denoise, 1), (commit, 2)], ids=["denoise", "commit"])
def test_compiled_forms_equal_eager_and_write_in_place(fn, n_slots):
    N, H, K, D, L, S = SEED
    p = Problem(*SEED, seed=4)
    slots = [torch.tensor([S - 1], device=DEV), torch.tensor([RING], device=DEV)][:n_slots]

    def args(kc, vc):
        return (p.q, p.k, p.v, p.qw, p.kw, p.cos, p.sin, kc, vc, *slots)

    ekc, evc, ckc, cvc = (p.kc.clone() for _ in range(4))
    want = fn(*args(ekc, evc))
    got, code = inductor_code(compile_fresh(fn), *args(ckc, cvc))
    assert bits_equal(got, want) and bits_equal(ckc, ekc) and bits_equal(cvc, evc)
    if not ON_GPU:  # on the CPU the op stays opaque
        return
    assert launched_by_inductor(code) and "_qk_norm_rope_kernel" in code
    copies = [ln.strip() for ln in code.splitlines() if ".clone(" in ln or "copy_(" in ln]
    assert not copies, copies[:5]
    cache_shape = f"({L}, {K}, {S}, {N}, {D})"
    allocs = [ln for ln in code.splitlines() if "empty_strided" in ln and cache_shape in ln]
    assert not allocs, allocs[:5]
