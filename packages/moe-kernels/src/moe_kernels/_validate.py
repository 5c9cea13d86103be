"""Argument checks shared by the public ops. Each raises before any kernel launch, naming the
argument and what was expected: ``TypeError`` for a wrong dtype or type, ``ValueError`` for a
wrong rank, size, device or value."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    tensor(name, t)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({_names(allowed)}), got {t.dtype}")


def rank(name: str, t: torch.Tensor, ndim: int | Sequence[int]) -> None:
    tensor(name, t)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if t.dim() not in allowed:
        want = " or ".join(f"{n}-D" for n in allowed)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")


def same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def dim_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str = "") -> None:
    if t.shape[dim] != expected:
        extra = f" ({what})" if what else ""
        raise ValueError(
            f"{name} must have size {expected} in dim {dim}{extra}, got shape {tuple(t.shape)}"
        )


def valid_token_count(vtc: torch.Tensor | None, ref_name: str, ref: torch.Tensor) -> None:
    """An optional one-element integer tensor on ``ref``'s device (read on the device)."""
    if vtc is None:
        return
    tensor("valid_token_count", vtc)
    if vtc.dtype not in INDEX_DTYPES:
        raise TypeError(f"valid_token_count must be int32 or int64, got {vtc.dtype}")
    if vtc.numel() != 1:
        raise ValueError(
            f"valid_token_count must hold exactly one element, got shape {tuple(vtc.shape)}"
        )
    same_device(ref_name, ref, valid_token_count=vtc)


def int_arg(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {value}")
    return value


def float_2d(name: str, t: object) -> torch.Tensor:
    """A 2-D float32/bf16/fp16 tensor."""
    t = tensor(name, t)
    dtype(name, t, FLOAT_DTYPES)
    rank(name, t, 2)
    return t


def index_1d(name: str, t: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``ref``'s device."""
    t = tensor(name, t)
    dtype(name, t, INDEX_DTYPES)
    rank(name, t, 1)
    same_device(ref_name, ref, **{name: t})
    return t


def dense_gather(
    x: object, token_indices: object, expert_indices: object, scores: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FBGEMM's gather arguments: x (T, D) and scores (T, E) float on one device, token and
    expert indices (N,) int32/int64 there."""
    x = float_2d("x", x)
    token_indices = index_1d("token_indices", token_indices, "x", x)
    expert_indices = index_1d("expert_indices", expert_indices, "x", x)
    scores = float_2d("scores", scores)
    same_device("x", x, scores=scores)
    dim_size("scores", scores, 0, x.shape[0], "T, the rows of x")
    dim_size("expert_indices", expert_indices, 0, token_indices.shape[0], "len(token_indices)")
    return x, token_indices, expert_indices, scores


def scale_ub(ub: object, ref_name: str, ref: torch.Tensor) -> None:
    """An optional one-element float32 tensor on ``ref``'s device (read on the device)."""
    if ub is None:
        return
    tensor("scale_ub", ub)
    if ub.dtype != torch.float32:
        raise TypeError(f"scale_ub must be a float32 tensor, got {ub.dtype}")
    if ub.numel() != 1:
        raise ValueError(f"scale_ub must hold exactly one element, got shape {tuple(ub.shape)}")
    same_device(ref_name, ref, scale_ub=ub)
