"""Refuse a problem too large for the machine before allocating it, saying how large it is."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moe_tools.command import UsageError

GIB = float(1 << 30)


def available_bytes(device: torch.device) -> int | None:
    """Free memory now: the GPU's (``cudaMemGetInfo``) or the host's (``MemAvailable``), None
    where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(what: str, need: int, device: torch.device, detail: str, hint: str) -> None:
    """Raise :class:`UsageError` when ``need`` bytes exceed 90% of what ``device`` has free.

    ``what``: the problem ("the deepseek-v3 layer"); ``detail``: how ``need`` adds up;
    ``hint``: how to shrink it."""
    free = available_bytes(device)
    if free is None or need <= 0.9 * free:
        return
    raise UsageError(
        f"{what} needs about {need / GIB:.1f} GiB ({detail}); {device} has "
        f"{free / GIB:.1f} GiB free. {hint}"
    )


def check_top_k(sizes: Mapping[str, Any]) -> None:
    """UsageError naming the flags when a layer's ``top_k`` is more than its ``n_experts`` (the
    preset's value, or ``--top-k`` / ``--experts``)."""
    k, e = sizes["top_k"], sizes["n_experts"]
    if k > e:
        raise UsageError(f"--top-k / --experts: top_k {k} is more than the layer's {e} experts")


def meta_bytes(build: Callable[[], torch.nn.Module], what: str, hint: str) -> int:
    """:func:`module_bytes` of the module ``build()`` makes on the meta device; UsageError (with
    ``hint``, the flags that shrink it) when one of its tensors would hold more than 2**63 - 1
    bytes (torch's size arithmetic overflows)."""
    try:
        return module_bytes(build())
    except RuntimeError as exc:
        if "overflow" not in str(exc).lower():
            raise
        raise UsageError(f"{what} has a tensor too large for int64 sizes. {hint}") from None


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a module on the meta device works)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
