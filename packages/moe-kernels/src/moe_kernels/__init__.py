"""moe-kernels: Triton kernels for Mixture-of-Experts token routing and MXFP8.

CUDA tensors run Triton kernels; CPU tensors run the pure-torch references (or the Triton kernels
in the interpreter when ``TRITON_INTERPRET=1``). Every op is a ``torch.library`` custom op with a
fake implementation: safe under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, no host
syncs, deterministic.
"""

__version__ = "0.1.0"
