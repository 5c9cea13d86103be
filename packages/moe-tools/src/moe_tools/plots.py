"""Figures: matplotlib is optional (``moe-tools[plot]``); each command draws its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PLOT_EXTRA = "--plot needs matplotlib: pip install 'moe-tools[plot]' (or matplotlib>=3.7)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; RuntimeError naming the extra when missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(PLOT_EXTRA) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Raise the clear RuntimeError of :func:`pyplot` when the ``plot`` extra is missing."""
    pyplot()


def plot_format_error(path: str | os.PathLike[str]) -> str | None:
    """Why matplotlib cannot write ``path`` (its suffix names no format it knows), or None; a
    path without a suffix gets matplotlib's default format."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().lstrip(".")
    known = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in known:
        return f"--plot {os.fspath(path)}: unknown format {suffix!r}; use one of {', '.join(known)}"
    return None


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Write a matplotlib figure to ``path`` (folders created), close it, return the path."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
