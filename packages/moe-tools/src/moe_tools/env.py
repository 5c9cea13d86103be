"""What numbers were measured on: versions, commit, GPU, OS; the header every command prints."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from collections.abc import Mapping
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

import torch

OURS = ("moe_kernels", "moe_model", "moe_tools")  # versions of the code imported (__version__)
PEERS = ("triton", "fbgemm-gpu-genai", "torchao", "numpy")  # versions of installed distributions


def _module_version(name: str) -> str | None:
    try:
        return getattr(import_module(name), "__version__", None)
    except Exception:  # not installed, or broken: the header says so
        return None


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(path: str | os.PathLike[str] | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout that tracks ``path`` (default: this file, so a clone or
    an editable install knows its commit; an installed wheel has none, even inside a checkout:
    (None, None)). ``dirty``: tracked files differ from the commit."""
    target = Path(path) if path is not None else Path(__file__).resolve()
    where = target if target.is_dir() else target.parent
    try:
        subprocess.run(
            ["git", "-C", str(where), "ls-files", "--error-unmatch", "--", str(target)],
            capture_output=True, timeout=10, check=True,
        )  # fmt: skip
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(status.strip())


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """A flat JSON-able dict: date, commit, versions (ours by ``__version__``, the peers by their
    distributions), the GPU, the OS."""
    device = torch.device(device) if device is not None else None
    commit, dirty = git_commit()
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty,
        "python": platform.python_version(),
        "os": platform.platform(),
        "machine": machine_slug(device),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device) if device is not None else None,
        "gpu": None,
        "gpu_memory_gib": None,
        "gpu_capability": None,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "MOE_KERNELS_BACKEND": os.environ.get("MOE_KERNELS_BACKEND"),
    }
    env.update({name: _module_version(name) for name in OURS})
    env.update({dist: _dist_version(dist) for dist in PEERS})
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        idx = device.index if device is not None and device.index is not None else 0
        props = torch.cuda.get_device_properties(idx)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / float(1 << 30), 1)
        env["gpu_capability"] = f"{props.major}.{props.minor}"
    return env


def machine_slug(device: torch.device | str | None = None) -> str:
    """A folder-friendly machine name: the GPU's name on CUDA ("nvidia-h200"), else "cpu-<arch>"."""
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    name = torch.cuda.get_device_name(device) if use_cuda else f"cpu-{platform.machine()}"
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "unknown"


def versions_line(env: Mapping[str, Any]) -> str:
    """'moe_kernels 0.1.0, moe_model 0.1.0, ..., numpy 2.2' of the versions that are known."""
    names = (*OURS, *PEERS, "fbgemm-gpu", "moe-kernels", "moe-model", "moe-tools")  # + old keys
    return ", ".join(f"{n} {env[n]}" for n in names if env.get(n) and n != "triton")


def format_environment(env: Mapping[str, Any]) -> str:
    """A few aligned lines: the header every command prints before its table."""
    gpu = "none"
    if env.get("gpu"):
        gpu = f"{env['gpu']} ({env['gpu_memory_gib']} GiB, sm {env['gpu_capability']})"
    commit = (env.get("commit") or "unknown")[:12]
    if commit != "unknown" and env.get("dirty"):
        commit += " (with uncommitted changes)"
    lines = [
        ("date", f"{env.get('date')}  commit {commit}"),
        ("torch", f"{env.get('torch')} (CUDA {env.get('cuda') or 'none'})"),
        ("triton", str(env.get("triton") or "not installed")),
        ("device", f"{env.get('device')}  GPU: {gpu}"),
        ("os", f"{env.get('os')}, Python {env.get('python')}, {env.get('cpu_count')} CPUs"),
        ("packages", versions_line(env) or "-"),
    ]
    flags = [f"{k}={env[k]}" for k in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND") if env.get(k)]
    if flags:
        lines.append(("env", " ".join(flags)))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"# {k.ljust(width)}  {v}" for k, v in lines)
