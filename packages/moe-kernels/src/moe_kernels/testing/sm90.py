"""Whether this Triton can compile kernels for sm_90a (Hopper) here, without a GPU: tests that
compile the GPU launch plans skip only where it cannot, never on a kernel's own error; and what a
compiled kernel's registers are (``register_use``, from Triton's own ptxas)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

__all__ = ["RegisterUse", "register_use", "sm90_compiler_missing"]


class RegisterUse(NamedTuple):
    """Registers a thread and bytes a thread spilled to local memory (stores)."""

    registers: int
    spill_bytes: int


def register_use(kernel: object, arch: str = "sm_90a") -> RegisterUse:
    """A kernel compiled by ``triton.compile`` assembled again by Triton's bundled ptxas with
    ``-v``: its registers a thread and its spill stores (no GPU needed)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", arch, src, "-o", os.path.join(tmp, "kernel.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    text = out.stdout + out.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register use: {text[-400:]}")
    return RegisterUse(int(registers.group(1)), int(spills.group(1)))


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
