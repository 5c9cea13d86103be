"""moe-model: an MoE transformer and a frame-autoregressive world model, built on moe-kernels."""

__version__ = "0.1.0"
