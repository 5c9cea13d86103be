"""Whether this Triton can compile kernels for sm_90a (Hopper) here, without a GPU: tests that
compile the GPU launch plans skip only where it cannot, never on a kernel's own error."""

from __future__ import annotations

import functools

__all__ = ["sm90_compiler_missing"]


@functools.cache
def sm90_compiler_missing() -> str | None:
    """None where a trivial kernel compiles to an sm_90a cubin (Triton's CUDA backend and its
    ptxas are here), else why not (no Triton, no CUDA backend, no ptxas binary)."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        return f"no Triton: {exc}"

    @triton.jit
    def _probe(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK))

    sig = {"x_ptr": "*i32", "BLOCK": "constexpr"}
    src = ASTSource(fn=_probe, signature=sig, constexprs={"BLOCK": 32}, attrs={})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    except Exception as exc:  # no CUDA backend / ptxas in this Triton build
        return f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200]
    return None
