"""moe-tools: benchmarks and verification for moe-kernels and moe-model."""

__version__ = "0.1.0"
