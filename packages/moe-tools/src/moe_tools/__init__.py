"""moe-tools: ``moe-bench``, the benchmarks, verification and published results of
moe-kernels-triton (import ``moe_kernels``) and moe-model.

The public API: the op registry (one :class:`OpSpec` per public op of ``moe_kernels``), the
:class:`Result` every command returns, and :func:`main`, the CLI's entry point.
"""

__version__ = "0.1.0"

from moe_tools.ops import REGISTRY, RESULT_TYPES, OpSpec, Problem  # noqa: E402
from moe_tools.results import Result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """``moe-bench``'s entry point (``moe_tools.cli.main``): returns the exit status."""
    from moe_tools.cli import main as cli_main

    return cli_main(argv)


__all__ = ["REGISTRY", "RESULT_TYPES", "OpSpec", "Problem", "Result", "__version__", "main"]
