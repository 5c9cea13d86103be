"""GPU check and timing of ``qk_norm_rope`` (QK-norm + RoPE + KV ring write; one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/rope_gpu.py            # H200 (~1-2 min, most of it compiling)
    python3 benchmarks/gpu/rope_gpu.py --dry-run  # CPU, TRITON_INTERPRET=1, tiny shapes

Shapes: the seed model's attention layer, N=512 tokens, H=32 query / K=16 kv heads, D=64 (q 2 MiB,
k and v 1 MiB each in bf16), a cache of 4 layers x 17 slots (window 16 + scratch); then bf16 and
fp32 at other sizes (N=100 ragged, D=128, D=48 masked), q None, q/k/v as column slices of one
fused projection, and a transposed (column-stride N) layout.

Checks (outputs and caches poisoned with NaN first):
  * against the torch reference run on the CPU (the oracle; the GPU's torch rsqrt is not IEEE):
    q_out and the written k slots within 3 ulp(r) (bf16/fp16) / 8 ulp(r) (fp32), r the magnitude
    of the element's rotation pair of normed values (tests/test_rope.py derives the bound; the
    GPU should stay within 2.5); printed: the max error in ulp(r), in ulps of the output, and the
    share of elements bitwise equal to the reference. v slots bit for bit; every other cache
    element unchanged (NaN bits kept); ``k_cache._version`` bumped by the eager call;
  * a second call gives the same bits; every swept config stays within the bound;
  * eager calls under ``torch.cuda.set_sync_debug_mode("error")``;
  * a captured CUDA graph replayed after the inputs and the slot tensor changed in place (the
    slots are read on the device): equal to an eager call on the new values;
  * ``torch.compile(fullgraph=True)`` of the model's denoise and commit forms: bit-equal to eager,
    and Inductor's code launches ``_qk_norm_rope_kernel`` itself (no ``torch.ops.moe_kernels``
    call), with no ``.clone(`` / ``copy_`` and no buffer of the cache's shape (the cache is
    written in place).
Timings (device time in CUDA graphs: 20 calls captured, median replay / 20), per pass form:
  denoise  q + k + v, the scratch slot      (ours: one call)
  commit   the same, then the ring slot     (ours as the model runs it: the scratch call, then a
           call without q for the ring slot after SDPA; ``2slot``: one call writing both)
  kv_only  k + v into the ring slot         (ours: one call without q)
beside the torch formula it replaces (RMSNorm + apply_rope under ``torch.compile`` with the
former ``kv_write`` custom op doing ``index_copy_``) and a clone of the bytes the pass moves.
``host_us``: the host's wall time of one compiled call (the former opaque op cost ~90 us).
Variants only through the launcher's ``config=RopeConfig(block_n, num_warps)``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from common import (  # noqa: E402
    FAILS,
    capture,
    check,
    clone_of,
    forbid_host_sync,
    host_us,
    poison,
    same_bits,
)
from common import graph_us as _graph_us  # noqa: E402

from moe_kernels import qk_norm_rope  # noqa: E402
from moe_kernels._triton import rope as tri  # noqa: E402
from moe_kernels.reference import rope as ref  # noqa: E402
from moe_model.rope import apply_rope  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
EPS = 1e-6
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
TOL_ULPS = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 8}
C = tri.RopeConfig
if DRY:
    SEED = (16, 4, 2, 16, 2, 3)  # (N, H, K, D, L, S)
    OTHERS = [(9, 2, 1, 16, 1, 2, torch.float32), (5, 4, 2, 24, 2, 3, torch.bfloat16)]
    CONFIGS = [C(8, 4), C(16, 2)]
    CALLS, REPLAYS = 1, 1
else:
    SEED = (512, 32, 16, 64, 4, 17)
    OTHERS = [
        (512, 32, 16, 64, 4, 17, torch.float32),
        (512, 32, 16, 64, 4, 17, torch.float16),
        (100, 32, 16, 64, 2, 17, torch.bfloat16),  # ragged last block
        (2048, 16, 8, 128, 2, 9, torch.bfloat16),
        (300, 8, 4, 48, 2, 5, torch.bfloat16),  # D no power of two: masked columns
    ]
    CONFIGS = [C(bn, w) for bn in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if bn * 64 >= 32 * w]
    CALLS, REPLAYS = 20, 7
RING = 1  # the ring slot the checks write (frame % window); the scratch slot is S - 1


def graph_us(fn) -> float:
    return _graph_us(fn, CALLS, REPLAYS, DRY)


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


class Problem:
    """q, k, v as column slices of one (N, (H + 2K) * D) projection output (or a transposed
    copy), bf16 scales (the engine casts them), fp32 angles, NaN-poisoned caches."""

    def __init__(self, N, H, K, D, L, S, dtype=torch.bfloat16, seed=0, transposed=False):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.shape = (N, H, K, D, L, S)
        self.dtype = dtype
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


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def ulp(x, dtype):
    e = torch.floor(torch.log2(x.float().abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(e - MANTISSA[dtype])


def pair_norm(x_NC, w_D):
    D = w_D.shape[0]
    y = ref.rms_norm(x_NC.reshape(x_NC.shape[0], -1, D), w_D, EPS).float()
    r = y.unflatten(-1, (D // 2, 2)).norm(dim=-1, keepdim=True)
    return r.expand(*r.shape[:-1], 2).flatten(-2).transpose(0, 1)  # (h, N, D)


def compare(got, want, r, dtype) -> tuple[bool, str]:
    """(within TOL_ULPS ulp(r), note: max error in ulp(r) and ulps of the output, bits equal)."""
    got, want, r = got.cpu(), want.cpu(), r.cpu()
    if got.numel() == 0:
        return True, "empty"
    err = (got.float() - want.float()).abs()
    in_r = float((err / ulp(r, dtype)).max())
    in_out = float((err / ulp(want, dtype)).max())
    same = float((bits(got) == bits(want)).float().mean())
    ok = bool(torch.isfinite(got).all()) and in_r <= TOL_ULPS[dtype]
    return ok, f"max {in_r:.2f} ulp(r), {in_out:.1f} ulp(out), {100 * same:.2f}% bits equal"


def check_problem(label, p: Problem, layer, slots_list, q=True, config=None) -> tuple:
    """One call (through the launcher with ``config`` if given, else the public op) checked
    against the CPU reference; returns (q_out, k cache, v cache) for bitwise comparisons."""
    N, H, K, D, L, S = p.shape
    slots = torch.tensor(slots_list, device=DEV)
    kc, vc = p.kc.clone(), p.vc.clone()
    poison(N * H * D * kc.element_size(), device=DEV)  # a fresh q_out starts as NaN
    version = kc._version
    args = p.args(layer, slots, q, (kc, vc))
    if config is None:
        with forbid_host_sync(not DRY):
            q_out = qk_norm_rope(*args, eps=EPS)
    else:
        q_out = tri.qk_norm_rope(*args, EPS, config=config)
    sync()
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in p.args(layer, slots, q)]
    cpu[7], cpu[8] = p.kc.cpu(), p.vc.cpu()
    want_q = ref.qk_norm_rope(*cpu, EPS)
    want_kc, want_vc = cpu[7], cpu[8]
    written = torch.zeros(L, K, S, dtype=torch.bool)
    written[layer, :, slots_list] = True
    kc_c, vc_c = kc.cpu(), vc.cpu()
    untouched = same_bits(kc_c[~written], want_kc[~written]) and same_bits(
        vc_c[~written], want_vc[~written]
    )
    v_ok = all(same_bits(vc_c[layer, :, s], want_vc[layer, :, s]) for s in slots_list)
    r_k = pair_norm(p.k.cpu(), p.kw.cpu())
    k_res = [compare(kc_c[layer, :, s], want_kc[layer, :, s], r_k, p.dtype) for s in slots_list]
    k_ok = all(ok for ok, _ in k_res)
    if q:
        q_ok, q_note = compare(q_out, want_q, pair_norm(p.q.cpu(), p.qw.cpu()), p.dtype)
    else:
        q_ok, q_note = q_out.shape == (0, N, D), "no q"
    name = f"{label}: {p.dtype} N={N} H={H} K={K} D={D} slots={slots_list}" + (
        "" if config is None else f" {config}"
    )
    check(f"{name} q", q_ok, q_note)
    check(f"{name} k", k_ok, k_res[0][1])
    check(f"{name} v bit copy, rest of the cache untouched", v_ok and untouched)
    if config is None:
        check(f"{name} k_cache version bumped", kc._version > version)
    return q_out, kc, vc


def correctness() -> None:
    print("correctness (vs the torch reference on the CPU)")
    p = Problem(*SEED, seed=1)
    L, S = SEED[4], SEED[5]
    a = check_problem("seed", p, L - 2, [S - 1])
    b = check_problem("seed", p, L - 2, [S - 1])
    check("seed: repeat call bitwise", all(same_bits(x, y) for x, y in zip(a, b, strict=True)))
    check_problem("seed commit 2slot", p, L - 2, [S - 1, RING])
    check_problem("seed kv_only", p, L - 1, [RING], q=False)
    c = check_problem("seed contiguous", _contiguous(Problem(*SEED, seed=1)), L - 2, [S - 1])
    check("seed: column slices == contiguous copies (bits)", same_bits(a[0], c[0]))
    t = check_problem("seed transposed", Problem(*SEED, seed=1, transposed=True), L - 2, [S - 1])
    check("seed: transposed layout == column slices (bits)", same_bits(a[0], t[0]))
    for i, (*shape, dtype) in enumerate(OTHERS):
        layer, last = shape[4] - 1, shape[5] - 1
        check_problem("other", Problem(*shape, dtype=dtype, seed=10 + i), layer, [last, 0])
        check_problem("other kv_only", Problem(*shape, dtype=dtype, seed=10 + i), 0, [0], q=False)


def _contiguous(p: Problem) -> Problem:
    p.q, p.k, p.v = p.q.contiguous(), p.k.contiguous(), p.v.contiguous()
    return p


def configs() -> list[tuple]:
    print("launch configs (each checked, then timed)")
    p = Problem(*SEED, seed=2)
    scratch, ring = SEED[5] - 1, RING
    default = tri.pick_config(SEED[0], SEED[3])
    base = None
    rows = []
    for cfg in [default, *[c for c in CONFIGS if c != default]]:
        try:
            out = check_problem("config", p, 1, [scratch, ring], config=cfg)
            if base is None:
                base = out
            else:
                check(f"config {cfg}: bits == default's", same_bits(out[0], base[0]))
            slots1 = torch.tensor([scratch], device=DEV)
            slots2 = torch.tensor([scratch, ring], device=DEV)
            a1, a2 = p.args(1, slots1), p.args(1, slots2)
            us1 = graph_us(lambda a=a1, c=cfg: tri.qk_norm_rope(*a, EPS, config=c))
            us2 = graph_us(lambda a=a2, c=cfg: tri.qk_norm_rope(*a, EPS, config=c))
            rows.append((cfg, us1, us2))
        except Exception as exc:  # a config that does not compile is reported and skipped
            FAILS.append(f"config {cfg}")
            print(f"config {cfg} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    return rows


def graph_replay() -> None:
    print("cuda graph replay (inputs and slots changed in place)")
    p = Problem(*SEED, seed=3)
    slots = torch.tensor([SEED[5] - 1, 0], device=DEV)
    graph, q_static = capture(lambda: qk_norm_rope(*p.args(1, slots), eps=EPS))
    p.qkv.copy_(torch.randn_like(p.qkv.float()).to(p.dtype))
    slots.copy_(torch.tensor([SEED[5] - 1, RING], device=DEV))
    kc_before, vc_before = p.kc.clone(), p.vc.clone()
    graph.replay()
    sync()
    kc, vc = kc_before.clone(), vc_before.clone()
    want = qk_norm_rope(*p.args(1, slots, caches=(kc, vc)), eps=EPS)
    check("graph replay == eager on the new values (q_out, bits)", same_bits(q_static, want))
    check("graph replay wrote the new ring slot (caches, bits)",
          same_bits(p.kc, kc) and same_bits(p.vc, vc))  # fmt: skip


def denoise_fn(q, k, v, qw, kw, cos, sin, kc, vc, scratch):
    return qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, 1, scratch, eps=EPS)


def commit_fn(q, k, v, qw, kw, cos, sin, kc, vc, scratch, ring):
    q_out = qk_norm_rope(q, k, v, qw, kw, cos, sin, kc, vc, 1, scratch, eps=EPS)
    qk_norm_rope(None, k, v, None, kw, cos, sin, kc, vc, 1, ring, eps=EPS)
    return q_out


def compiled_checks() -> None:
    from torch._inductor.utils import run_and_get_code

    print("torch.compile(fullgraph=True): equal to eager, the kernel launched by Inductor")
    N, H, K, D, L, S = SEED
    for name, fn, n_slots in (("denoise", denoise_fn, 1), ("commit", commit_fn, 2)):
        torch._dynamo.reset()
        p = Problem(*SEED, seed=4)
        slot_args = [torch.tensor([S - 1], device=DEV), torch.tensor([RING], device=DEV)]
        slot_args = slot_args[:n_slots]

        def args(kc, vc, p=p, slot_args=slot_args):
            return (p.q, p.k, p.v, p.qw, p.kw, p.cos, p.sin, kc, vc, *slot_args)

        ekc, evc, ckc, cvc = (p.kc.clone() for _ in range(4))
        want = fn(*args(ekc, evc))
        got, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args(ckc, cvc))
        code = "\n".join(codes)
        check(f"{name}: compiled == eager (q_out, caches; bits)",
              same_bits(got, want) and same_bits(ckc, ekc) and same_bits(cvc, evc))  # fmt: skip
        if DRY:
            print(f"  [skip] {name}: Inductor code checks (CPU: the op stays opaque)")
            continue
        copies = [ln.strip() for ln in code.splitlines() if ".clone(" in ln or "copy_(" in ln]
        cache_shape = f"({L}, {K}, {S}, {N}, {D})"
        allocs = [ln for ln in code.splitlines() if "empty_strided" in ln and cache_shape in ln]
        check(f"{name}: Inductor launches _qk_norm_rope_kernel", "_qk_norm_rope_kernel" in code)
        check(f"{name}: no torch.ops.moe_kernels call", "torch.ops.moe_kernels" not in code)
        check(f"{name}: no clone / copy_ in the code", not copies, "; ".join(copies)[:300])
        check(f"{name}: no buffer of the cache's shape allocated", not allocs, str(allocs)[:200])


# ------------------------------------------------------------------------------- timings


def kv_write_op():
    """The former ``moe_model::kv_write``: index_copy_ of one slot, an opaque custom op."""

    @torch.library.custom_op("rope_gpu::kv_write", mutates_args=("k_cache", "v_cache"))
    def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, slot: torch.Tensor,
                 k_HND: torch.Tensor, v_HND: torch.Tensor) -> None:  # fmt: skip
        k_cache[layer].index_copy_(1, slot, k_HND.unsqueeze(1))
        v_cache[layer].index_copy_(1, slot, v_HND.unsqueeze(1))

    kv_write.register_fake(lambda *a: None)
    return kv_write


def torch_pass(kv_write, q, k, v, qw, kw, cos, sin, kc, vc, slot_list):
    """The formula ``qk_norm_rope`` replaced (moe_model.attention before it): RMSNorm +
    apply_rope on k (and q), one kv_write per slot, q folded for SDPA."""
    N, D = k.shape[0], kc.shape[-1]
    K = k.shape[1] // D
    k_KND = apply_rope(ref.rms_norm(k.view(N, K, D), kw, EPS), cos, sin).transpose(0, 1)
    v_KND = v.view(N, K, D).transpose(0, 1)
    for slot in slot_list:
        kv_write(kc, vc, 1, slot, k_KND, v_KND)
    if q is None:
        return None
    H = q.shape[1] // D
    q_NHD = apply_rope(ref.rms_norm(q.view(N, H, D), qw, EPS), cos, sin)
    return q_NHD.view(N, K, H // K, D).permute(1, 2, 0, 3).reshape(K, N * H // K, D)


def timings() -> list[tuple]:
    print("timings (CUDA graphs)")
    N, H, K, D, L, S = SEED
    p = Problem(*SEED, seed=5)
    for t in (p.kc, p.vc):
        t.zero_()
    kv_write = kv_write_op()
    scr, ring = torch.tensor([S - 1], device=DEV), torch.tensor([RING], device=DEV)
    both = torch.tensor([S - 1, RING], device=DEV)
    a = (p.q, p.k, p.v, p.qw, p.kw, p.cos, p.sin, p.kc, p.vc)
    nq = (None, p.k, p.v, None, p.kw, p.cos, p.sin, p.kc, p.vc)
    esz = p.k.element_size()
    q_bytes, kv_bytes = N * H * D * esz, N * K * D * esz
    forms = {  # name -> (ours as the model calls it, 2slot or None, torch slots, q, bytes moved)
        "denoise": (lambda: qk_norm_rope(*a, 1, scr, eps=EPS), None, [scr], True,
                    2 * q_bytes + 4 * kv_bytes),
        "commit": (lambda: (qk_norm_rope(*a, 1, scr, eps=EPS),
                            qk_norm_rope(*nq, 1, ring, eps=EPS)),
                   lambda: qk_norm_rope(*a, 1, both, eps=EPS), [scr, ring], True,
                   2 * q_bytes + 6 * kv_bytes),
        "kv_only": (lambda: qk_norm_rope(*nq, 1, ring, eps=EPS), None, [ring], False,
                    4 * kv_bytes),
    }  # fmt: skip
    rows = []
    for name, (ours, two, slots, with_q, nbytes) in forms.items():
        torch._dynamo.reset()
        qq, qw = (p.q, p.qw) if with_q else (None, None)
        args = (kv_write, qq, p.k, p.v, qw, p.kw, p.cos, p.sin, p.kc, p.vc, slots)
        tp = torch.compile(lambda args=args: torch_pass(*args), fullgraph=True)
        ours_c = torch.compile(ours, fullgraph=True)
        tp()
        ours_c()
        rows.append((name, "ours", graph_us(ours), host_us(ours_c, dry=DRY), nbytes))
        if two is not None:
            two_c = torch.compile(two, fullgraph=True)
            two_c()
            rows.append((name, "ours 2slot", graph_us(two), host_us(two_c, dry=DRY), nbytes))
        rows.append((name, "torch compiled", graph_us(tp), host_us(tp, dry=DRY), nbytes))
        rows.append((name, "clone", graph_us(clone_of(nbytes, DEV)), float("nan"), nbytes))
    return rows


def main() -> int:
    t0 = time.perf_counter()
    where = "cpu (interpreter)" if DRY else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {where}; seed shape (N, H, K, D, L, S) = {SEED}")
    cfg_rows, rows = [], []
    for step in (correctness, graph_replay, compiled_checks):
        if DRY and step is graph_replay:
            print("cuda graph replay: skipped on the CPU")
            continue
        try:
            step()
        except Exception as exc:
            FAILS.append(step.__name__)
            print(f"{step.__name__} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=4)
    try:
        cfg_rows = configs()
        rows = timings()
    except Exception as exc:
        FAILS.append("timings")
        print(f"timings FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        traceback.print_exc(limit=4)
    unit = "us (one eager call, CPU)" if DRY else "us device time in CUDA graphs"
    print(
        f"\nlaunch configs at the seed shape ({unit}); default {tri.pick_config(SEED[0], SEED[3])}"
    )
    print(f"{'block_n':>7} {'warps':>5} {'1 slot':>8} {'2 slots':>8}")
    for cfg, us1, us2 in cfg_rows:
        print(f"{cfg.block_n:7d} {cfg.num_warps:5d} {us1:8.2f} {us2:8.2f}")
    print(f"\npasses at the seed shape ({unit}; host_us: one compiled call's host time)")
    print(f"{'pass':8} {'variant':15} {'us':>8} {'GB/s':>7} {'host_us':>8}")
    for name, variant, us, h, nbytes in rows:
        print(f"{name:8} {variant:15} {us:8.2f} {nbytes / us / 1e3:7.0f} {h:8.1f}")
    print(f"failures: {FAILS or 'none'}; {time.perf_counter() - t0:.0f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
