"""The host time ``torch.compile`` adds to a call of each moe-kernels op on the GPU, with the op
launched by Inductor itself and as an opaque custom op (one H200 run).

PYTHONPATH=packages/moe-kernels/src:packages/moe-model/src:packages/moe-tools/src \
    python3 benchmarks/gpu/compile_gpu.py              # H200
    python3 benchmarks/gpu/compile_gpu.py --dry-run    # CPU (reference path), tiny sizes
    python3 benchmarks/gpu/compile_gpu.py --ops=route,combine --dump=DIR  # and the code

Per op, at the world model's per-pass shapes (512 tokens, E=16, top-8, D=2048, hidden 1024):
``inl`` whether the compiled function's Inductor code launches our kernels itself (no
``torch.ops.moe_kernels`` call left) and the count of ``clone`` calls in it (a kernel argument
Inductor believes written gets copied first); ``host_us``: wall time per call of the compiled
function (back-to-back calls, the GPU synchronized before each loop only), ``added`` that minus
the same for a compiled ``x + 1`` (guards and the wrapper's own cost), and ``opaque`` the same op
compiled as an opaque custom op (``torch._functorch.config.decompose_custom_triton_ops = False``,
the switch ``torch.export`` uses, which our registration honours). Host times use small
problems (the GPU's work per call under the host's). That compiled equals eager, and that the
code launches the kernels: ``tests/gpu/test_compiled_gpu.py``, ``test_cold_compile_ops.py``.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
from common import host_us

import moe_kernels as mk
from moe_kernels.testing import inductor_code

DRY = "--dry-run" in sys.argv
DEV = torch.device("cpu" if DRY else "cuda")
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--ops=")), None)
# --dump=DIR: each op's Inductor code written to DIR/<op>.py
DUMP = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--dump=")), None)
T, E, K, D, H = (16, 4, 2, 64, 32) if DRY else (512, 16, 8, 2048, 1024)
T_HOST = 8 if DRY else 64  # tokens of the host-time problems


def rand(*shape, dtype=torch.bfloat16, gen):
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def problems(t: int) -> dict[str, tuple]:
    """op name -> (function, arguments) at t tokens."""
    gen = torch.Generator(device=DEV).manual_seed(t)
    scores = torch.randn(t, E, generator=gen, device=DEV).softmax(-1)
    plan = mk.route(scores, K)
    x = rand(t, D, gen=gen)
    w1 = rand(E, H, D, gen=gen) / D**0.5
    h = rand(t * K, H, gen=gen)
    w2 = rand(E, D, H, gen=gen) / H**0.5
    ys = rand(t * K, D, gen=gen)
    w_r = torch.randn(E, D, generator=gen, device=DEV) / D**0.5
    shuf = mk.index_shuffling(scores.bfloat16(), top_k=K)
    q_data, q_scale = mk.to_mxfp8(x)
    ends = plan.offsets[1:].to(torch.int32)
    e_mx = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * (t * K // E // 32) * 32
    a_mx = rand(int(e_mx[-1]) if DRY else t * K, D, gen=gen)

    def scatter(out, ys_, tok):
        mk.scatter_add_dense_tokens(out, ys_, tok)
        return out

    return {
        "router_scores": (lambda a, b: mk.router_scores(a, b), (x, w_r)),
        "route": (lambda s: mk.route(s, K), (scores,)),
        "route_renorm_vtc": (
            lambda s, v: mk.route(s, K, renormalize=True, valid_token_count=v),
            (scores, torch.tensor([t // 2], device=DEV)),
        ),
        "index_shuffling": (lambda s: mk.index_shuffling(s, top_k=K), (scores.bfloat16(),)),
        "dispatch": (lambda a, p: mk.dispatch(a, p), (x, plan)),
        "gather_grouped_mm_silu": (
            lambda a, w, p: mk.gather_grouped_mm(
                a, w, p.offsets, p.token_indices, activation="silu"
            ),
            (x, w1, plan),
        ),
        "gather_grouped_mm_sorted": (
            lambda a, w, p: mk.gather_grouped_mm(a, w, p.offsets),
            (h, w2, plan),
        ),
        "combine": (lambda y, p: mk.combine(y, p), (ys, plan)),
        "gather_scale_dense_tokens": (
            lambda a, ti, ei, s: mk.gather_scale_dense_tokens(a, ti, ei, s),
            (x, shuf[2], shuf[1], scores),
        ),
        "scatter_add_dense_tokens": (
            scatter,
            (torch.zeros(t, D, device=DEV, dtype=torch.float32), ys, plan.token_indices),
        ),
        "to_mxfp8": (lambda a: mk.to_mxfp8(a), (x,)),
        "to_mxfp8_dim1": (lambda a: mk.to_mxfp8_dim1(a), (rand(256, D, gen=gen),)),
        "from_mxfp8": (lambda d, s: mk.from_mxfp8(d, s), (q_data, q_scale)),
        "compute_per_group_blocked_scale_offsets": (
            lambda e: mk.compute_per_group_blocked_scale_offsets(e),
            (ends,),
        ),
        "to_blocked_per_group_2d": (
            lambda s, e: mk.to_blocked_per_group_2d(s, e),
            (mk.to_mxfp8(ys)[1], ends),
        ),
        "to_blocked_per_group_3d": (
            lambda s: mk.to_blocked_per_group_3d(s),
            (mk.to_mxfp8(w1.flatten(0, 1))[1].view(E, H, D // 32),),
        ),
        "mxfp8_grouped_mm": (
            lambda a, b, e: mk.mxfp8_grouped_mm(a, b, e),
            (a_mx, w1.transpose(1, 2).contiguous(), e_mx),
        ),
    }


def fresh(args: tuple) -> tuple:
    """Tensors cloned (the in-place op gets its own output each call)."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def compiled(fn, decompose: bool = True):
    torch._dynamo.reset()
    with torch._functorch.config.patch(decompose_custom_triton_ops=decompose):
        return torch.compile(fn, fullgraph=True)


def host_times(fn, args: tuple) -> tuple[float, float]:
    """(host us a call compiled with the op inlined, the same with the op opaque)."""
    times = []
    for decompose in (True, False):
        comp = compiled(fn, decompose)
        kept = fresh(args)
        comp(*kept)
        times.append(host_us(lambda comp=comp, kept=kept: comp(*kept), dry=DRY))
    return times[0], times[1]


def measure(name: str, fn, args: tuple, small: tuple, base_us: float) -> tuple:
    _, code = inductor_code(compiled(fn), *fresh(args))
    if DUMP:
        with open(f"{DUMP}/{name}.py", "w") as f:
            f.write(code)
    inlined = "torch.ops.moe_kernels" not in code
    clones = code.count(".clone(") + code.count("clone_default")
    h, h_opaque = host_times(*small)
    return name, inlined, clones, h, h - base_us, h_opaque - base_us


def main() -> int:
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, device {DEV}, T={T} E={E} k={K} D={D} H={H}")
    probs, small = problems(T), problems(T_HOST)
    one = torch.zeros(8, device=DEV)
    base = compiled(lambda a: a + 1)
    base(one)
    base_us = host_us(lambda: base(one), dry=DRY)
    print(f"compiled x + 1: {base_us:.1f} us of host time a call")
    rows, failed = [], []
    for name, (fn, args) in probs.items():
        if ONLY and name not in ONLY:
            continue
        try:
            rows.append(measure(name, fn, args, small[name], base_us))
        except Exception as exc:
            failed.append(name)
            print(f"{name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=3)
    print(f"\nhost us a call at T={T_HOST}; added: minus the compiled x + 1 ({base_us:.1f} us)")
    head = ("op", "inl", "clones", "host_us", "added", "opaque")
    print("{:42} {:>4} {:>6} {:>8} {:>7} {:>7}".format(*head))
    for name, inl, clones, h, added, opaque in rows:
        print(f"{name:42} {inl!s:>4} {clones:6d} {h:8.1f} {added:7.1f} {opaque:7.1f}")
    print(f"not measured: {failed or 'none'}; {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
