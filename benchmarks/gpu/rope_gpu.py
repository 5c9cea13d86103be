"""Timing of ``qk_norm_rope`` (QK-norm + RoPE + KV ring write; one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/rope_gpu.py            # H200 (~1-2 min, most of it compiling)
    python3 benchmarks/gpu/rope_gpu.py --dry-run  # CPU, TRITON_INTERPRET=1, tiny shapes

The seed model's attention layer, N=512 tokens, H=32 query / K=16 kv heads, D=64 (q 2 MiB, k and
v 1 MiB each in bf16), a cache of 4 layers x 17 slots (window 16 + scratch).
Launch configs (``config=RopeConfig(block_n, num_warps)``, the launcher's typed override): each
checked in one line to give the default config's bits, then timed writing one slot and two.
Timings (device time in CUDA graphs: 20 calls captured, median replay / 20), per pass form:
  denoise  q + k + v, the scratch slot      (ours: one call)
  commit   the same, then the ring slot     (ours as the model runs it: the scratch call, then a
           call without q for the ring slot after SDPA; ``2slot``: one call writing both)
  kv_only  k + v into the ring slot         (ours: one call without q)
beside the torch formula it replaces (RMSNorm + apply_rope under ``torch.compile`` with the
former ``kv_write`` custom op doing ``index_copy_``) and a clone of the bytes the pass moves.
``host_us``: the host's wall time of one compiled call (the former opaque op cost ~90 us).
Correctness (against the reference, graph replay, compile): ``tests/gpu/test_rope_gpu.py``.
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
from common import clone_of, host_us  # noqa: E402
from common import graph_us as _graph_us  # noqa: E402

from moe_kernels import qk_norm_rope  # noqa: E402
from moe_kernels._triton import rope as tri  # noqa: E402
from moe_kernels.reference import rope as ref  # noqa: E402
from moe_kernels.testing import bits_equal  # noqa: E402
from moe_model.rope import apply_rope  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
EPS = 1e-6
C = tri.RopeConfig
if DRY:
    SEED = (16, 4, 2, 16, 2, 3)  # (N, H, K, D, L, S)
    CONFIGS = [C(8, 4), C(16, 2)]
    CALLS, REPLAYS = 1, 1
else:
    SEED = (512, 32, 16, 64, 4, 17)
    CONFIGS = [C(bn, w) for bn in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if bn * 64 >= 32 * w]
    CALLS, REPLAYS = 20, 7
RING = 1  # the ring slot written (frame % window); the scratch slot is S - 1


def graph_us(fn) -> float:
    return _graph_us(fn, CALLS, REPLAYS, DRY)


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


def configs() -> list[tuple]:
    print("launch configs (each checked against the default's bits, then timed)")
    p = Problem(*SEED, seed=2)
    scratch, ring = SEED[5] - 1, RING
    default = tri.pick_config(SEED[0], SEED[3])
    slots1 = torch.tensor([scratch], device=DEV)
    slots2 = torch.tensor([scratch, ring], device=DEV)
    a1, a2 = p.args(1, slots1), p.args(1, slots2)
    base = tri.qk_norm_rope(*a2, EPS, config=default)
    rows = []
    for cfg in [default, *[c for c in CONFIGS if c != default]]:
        try:
            if not bits_equal(tri.qk_norm_rope(*a2, EPS, config=cfg), base):
                print(f"config {cfg} FAILED: q_out differs from the default config's")
                continue
            us1 = graph_us(lambda a=a1, c=cfg: tri.qk_norm_rope(*a, EPS, config=c))
            us2 = graph_us(lambda a=a2, c=cfg: tri.qk_norm_rope(*a, EPS, config=c))
            rows.append((cfg, us1, us2))
        except Exception as exc:  # a config that does not compile is reported and skipped
            print(f"config {cfg} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    return rows


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
    cfg_rows, rows, failed = [], [], False
    try:
        cfg_rows = configs()
        rows = timings()
    except Exception as exc:
        failed = True
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
    print(f"{time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
