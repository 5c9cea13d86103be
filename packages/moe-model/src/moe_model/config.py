"""``WorldModelConfig``: sizes of the frame-autoregressive world model, and its presets."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moe_model._moe_options import check_size
from moe_model.impls import IMPL_ALIASES, MOE_IMPLS, check_impl_dims
from moe_model.moe import SCORE_FNS

_POSITIVE_FIELDS = (
    *("n_layers", "d_model", "n_heads", "n_kv_heads", "n_experts", "top_k", "moe_hidden"),
    *("dense_hidden", "latent_channels", "latent_h", "latent_w", "patch_size", "window"),
    *("n_buttons", "cond_dim", "freq_dim", "denoise_steps", "decoder_channels"),
)
_POSITIVE_FLOAT_FIELDS = ("rope_theta", "norm_eps")
_BOOL_FIELDS = ("gated", "renormalize")


@dataclass
class WorldModelConfig:
    """Sizes and options of a ``WorldEngine``.

    A frame is a latent of ``latent_channels x latent_h x latent_w``, cut in ``patch_size``^2
    patches: ``tokens_per_frame = (latent_h // patch_size) * (latent_w // patch_size)``. The
    decoder upsamples the latent 8x to an RGB image of ``(8 * latent_h, 8 * latent_w, 3)``.
    ``window`` is the number of past frames kept in the KV ring buffer: a frame attends to at most
    ``window`` earlier frames plus itself. Each frame runs ``denoise_steps`` rectified-flow steps
    (cache read-only), then one cache pass on the clean latent that writes its keys and values.
    """

    n_layers: int = 8
    d_model: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 16
    mlp: str = "moe"  # "moe" or "dense"
    n_experts: int = 16
    top_k: int = 8
    moe_hidden: int = 1024
    gated: bool = False
    score_fn: str = "softmax"
    renormalize: bool = False
    moe_impl: str = "triton_bf16"
    dense_hidden: int = 8192
    latent_channels: int = 16
    latent_h: int = 32
    latent_w: int = 64
    patch_size: int = 2
    window: int = 16
    n_buttons: int = 32
    cond_dim: int = 616
    freq_dim: int = 256
    denoise_steps: int = 1
    rope_theta: float = 10000.0
    decoder_channels: int = 320
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def grid_h(self) -> int:
        return self.latent_h // self.patch_size

    @property
    def grid_w(self) -> int:
        return self.latent_w // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def patch_dim(self) -> int:
        return self.latent_channels * self.patch_size**2

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        for name in _POSITIVE_FIELDS:
            check_size(name, getattr(self, name))
        for name in _POSITIVE_FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2 or self.head_dim < 8:
            raise ValueError(f"head_dim={self.head_dim} must be even and >= 8 (3-axis RoPE)")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
        if self.mlp not in ("moe", "dense"):
            raise ValueError(f"mlp must be 'moe' or 'dense', got {self.mlp!r}")
        impl = self.moe_impl
        if not isinstance(impl, str) or IMPL_ALIASES.get(impl, impl) not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
        if self.mlp == "moe":
            names = ("moe_impl", "d_model", "moe_hidden")
            check_impl_dims(impl, self.d_model, self.moe_hidden, names=names)
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {self.score_fn!r}")
        if self.latent_h % self.patch_size or self.latent_w % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} must divide latent_h={self.latent_h} and "
                f"latent_w={self.latent_w}"
            )
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even, got {self.freq_dim}")

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> WorldModelConfig:
        """A copy of ``PRESETS[name]`` with ``overrides`` applied (validated)."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        cls._check_field_names(overrides)
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> WorldModelConfig:
        """The config of ``to_dict()`` output (validated); missing fields take their defaults."""
        if not isinstance(d, Mapping):
            raise TypeError(f"d must be a mapping of config fields, got {type(d).__name__}")
        cls._check_field_names(d)
        return cls(**d)

    @classmethod
    def _check_field_names(cls, names: Iterable[str]) -> None:
        bad = sorted(set(names) - {f.name for f in dataclasses.fields(cls)}, key=str)
        if bad:
            raise ValueError(f"unknown config field(s) {bad}")


PRESETS: dict[str, WorldModelConfig] = {
    # The reference sizes: 8 layers, d 2048, 32/16 heads of 64, 16 experts x 1024, top-8, not gated;
    # a 16-channel 32x64 latent (256x512 RGB) in 2x2 patches = 16x32 = 512 tokens per frame.
    "seed-moe": WorldModelConfig(),
    # Same, dense MLP with the active hidden size of the MoE (top_k x moe_hidden).
    "seed-dense": WorldModelConfig(mlp="dense", dense_hidden=8192),
    # Runs on a CPU in seconds: 16 tokens per frame, 3-frame window, 2 denoising steps.
    "tiny": WorldModelConfig(
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_experts=4,
        top_k=2,
        moe_hidden=32,
        moe_impl="torch",
        dense_hidden=64,
        latent_channels=4,
        latent_h=8,
        latent_w=8,
        patch_size=2,
        window=3,
        n_buttons=4,
        cond_dim=32,
        freq_dim=32,
        denoise_steps=2,
        decoder_channels=16,
    ),
}
