"""Compiling the GPU launches for sm_90a on a machine without a GPU: the launch recorder
(``compile_launches``), the arguments Inductor's analysis says a kernel writes
(``written_arguments``), the PTX of an IEEE fp32 division, and the routing launch shapes the
sm_90a compile tests share. The helpers skip (``pytest.skip``) where Triton cannot compile for
CUDA here; they need pytest."""

from __future__ import annotations

import re

import torch

__all__ = [
    "IEEE_DIV_PTX",
    "ROUTING_PLANS",
    "SELECTION_PLANS",
    "compile_launches",
    "written_arguments",
]

# tl.math.div_rn: div.rn.f32 (Triton 3.6, 3.8), div.rn.ftz.f32 (3.5); the flush never changes a
# result here (448 / m and 1 / s have normal operands and results, or overflow either way)
IEEE_DIV_PTX = re.compile(r"div\.rn(\.ftz)?\.f32")

# The GPU launch plans of route / index_shuffling (tests/test_compile_sm90.py compiles the
# cooperative launches, tests/test_inductor_graph.py the separate ones as Inductor writes them):
# (T, E, top_k, start, end, scores dtype kind: 0 fp32 / 1 bf16 / 2 fp16, renormalize)
ROUTING_PLANS = [
    (4096, 16, 8, 0, 16, 1, False),  # small: ranks in A, scan in C, one cooperative launch
    (4096, 128, 8, 0, 128, 0, True),
    (65536, 128, 8, 0, 128, 1, False),  # columns
    (65536, 16, 1, 0, 16, 1, False),  # counted / prefix after a scan launch
    (1 << 20, 128, 8, 0, 128, 1, False),  # columns: scan launch and D
    (1 << 20, 256, 8, 0, 256, 2, False),  # sorted, packed weights
    (1 << 20, 32, 8, 0, 32, 1, False),  # index_shuffling: prefix sums
    (100000, 2048, 8, 0, 2048, 0, False),  # many experts
    (1 << 20, 16, 8, 0, 16, 1, False),  # counted (route), prefix sums (IS)
    (300000, 16, 4, 0, 16, 0, True),
    (300000, 64, 12, 0, 64, 0, False),  # top_k > 8: rounds of row maxima, sorted
    (300000, 128, 8, 32, 32, 1, False),  # empty expert range (L = 0)
    (300000, 128, 8, 32, 33, 1, False),  # L = 1
    (300000, 128, 8, 32, 36, 2, False),  # L = 4
    (300000, 128, 8, 32, 40, 1, True),  # L = 8
    (300000, 64, 6, 16, 48, 0, False),  # L = 32
    (300000, 64, 3, 0, 64, 2, False),  # index_shuffling: threshold top-k of 64 fp16 scores
]

# route's selection options: (T, E, top_k, start, end, kind, renormalize, bias, n_groups,
# topk_groups, scaled)
SELECTION_PLANS = [
    (4096, 256, 8, 0, 256, 0, True, True, 8, 4, True),  # DeepSeek-V3
    (1 << 20, 256, 8, 0, 256, 1, True, True, 8, 4, True),
    (65536, 256, 8, 32, 64, 0, True, True, 8, 4, True),  # an expert-parallel rank's range
    (64, 128, 8, 0, 128, 2, False, True, 1, 1, False),  # bias alone
    (300000, 16, 2, 0, 16, 0, False, False, 4, 2, True),  # counted
    (65536, 96, 6, 0, 96, 1, True, True, 3, 2, False),  # 32 experts a group, 3 groups
    (4096, 60, 4, 0, 60, 0, False, True, 12, 3, False),  # 5 experts a group (padded tile)
    (1000, 8, 2, 0, 8, 0, True, True, 8, 2, False),  # one expert a group
    (100, 2048, 8, 0, 2048, 0, False, True, 64, 8, True),  # 64 groups: the tile
    (70000, 64, 12, 0, 64, 1, True, True, 4, 2, False),  # top_k > 8: tile
]


def compile_launches(kernels, calls, monkeypatch):
    """Run ``calls`` (launcher calls on meta tensors) with ``kernels``' launches recorded instead
    of run (``monkeypatch``: pytest's fixture), then compile each distinct launch for sm_90a as
    Triton specialises it on the GPU (16-byte aligned tensors, ints divisible by 16 marked, ints
    equal to 1 constexpr). Returns [(constexprs, {argument name: value}, ptx)]."""
    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_kernels.testing.sm90 import sm90_compiler_missing

    missing = sm90_compiler_missing()  # a skip for a Triton without the compiler only
    if missing:
        pytest.skip(missing)

    recorded = []
    for fk in kernels:
        monkeypatch.setattr(fk, "launch", lambda grid, args, consts, fk=fk, **opts:
                            recorded.append((fk.fn, args, consts, opts)))  # fmt: skip
    for call in calls:
        call()
    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.float64: "fp64", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
             torch.int64: "i64"}  # fmt: skip
    done, out = set(), []
    for fn, args, consts, opts in recorded:
        sig, attrs, cx = {}, {}, dict(consts)
        for i, (name, a) in enumerate(zip(fn.arg_names, args, strict=False)):
            if isinstance(a, torch.Tensor):
                sig[name] = "*" + types[a.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif a == 1:
                sig[name], cx[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
                if a % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        sig.update(dict.fromkeys(consts, "constexpr"))
        key = (fn.__name__, tuple(sig.items()), tuple(cx.items()), tuple(attrs), opts["num_warps"])
        if key in done:
            continue
        done.add(key)
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(opts))
        out.append((cx, dict(zip(fn.arg_names, args, strict=False)), k.asm["ptx"]))
    return out


def written_arguments(kern, args, consts, monkeypatch) -> list[str]:
    """The arguments Inductor's TTIR analysis says ``kern`` writes (what decides which inputs a
    compiled graph copies before the launch), run here with a stand-in sm_90 driver."""
    import pytest
    import triton
    from triton.backends.compiler import GPUTarget

    tkw = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(tkw, "identify_accessed_tensors"):
        pytest.skip("this torch has no identify_accessed_tensors")

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90())
    kwargs = dict(zip(kern.arg_names, args, strict=False), **consts)
    accesses = tkw.identify_accessed_tensors(kern, kwargs, {})
    return sorted(d.name for d in accesses.read_writes.writes)
