"""Pure-torch references of every ``moe_kernels`` op, one module per op family.

Each function computes what its op's docstring specifies with plain torch (fp32 accumulation,
fixed orders), so it is the CPU path (``moe_kernels`` runs it for CPU tensors outside the
interpreter), the oracle the tests and ``moe-bench verify`` compare kernels against, and the
readable statement of an op's semantics. Called like the op's implementation: arguments are not
validated here (the public ops check them).
"""
