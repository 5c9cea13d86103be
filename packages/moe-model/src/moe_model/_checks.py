"""The device check of every public constructor (``MoELayer``, ``SharedExperts``,
``ExpertParallelMoE.from_config``, ``WorldEngine``): refused when built, naming the argument."""

from __future__ import annotations

import torch


def check_device(device: object, name: str = "device") -> torch.device | None:
    """None stays None (torch's default device); anything else -> its ``torch.device``.
    ValueError naming ``name`` for what torch cannot parse, or this process cannot allocate on:
    CUDA in a CPU-only build or without a GPU, an index past the last GPU, a device type not
    built in. ``meta`` passes (it holds no memory; a caller that needs memory refuses it)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"torch sees {torch.cuda.device_count()} CUDA device(s)")
        torch.empty(0, device=dev)  # raises for another device type this process cannot use
    except (RuntimeError, TypeError, AssertionError, NotImplementedError) as exc:
        raise ValueError(f"{name}={device!r} is not a device this process can use: {exc}") from None
    return dev
