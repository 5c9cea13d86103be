"""Text for people: table cells, aligned plain-text and markdown tables, progress bars.

Rows are plain dicts (column name -> value); every command returns a list of them. Plain-text
tables fit ``TABLE_WIDTH`` characters unless ``table_width(None)`` (``--wide``) is in effect: long
text cells but the rows' names are cut first, then columns dropped from the right (never the
first, the row's name, nor the last, its verdict), with a line naming them. JSON results keep
every column.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

Row = dict[str, Any]

TABLE_WIDTH = 120
MIN_TEXT_WIDTH = 24  # a cut text column keeps at least this many characters (or its header)
_WIDTH: ContextVar[int | None] = ContextVar("table_width", default=TABLE_WIDTH)


@contextmanager
def table_width(width: int | None) -> Iterator[None]:
    """Plain-text tables made inside fit ``width`` characters (None: every column, uncut)."""
    token = _WIDTH.set(width)
    try:
        yield
    finally:
        _WIDTH.reset(token)


def short_error(exc: BaseException, limit: int = 120) -> str:
    """One line naming the exception: 'Type: first line of the message' (clipped)."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_value(value: Any) -> str:
    """How one cell prints: '-' for missing, 3-4 significant digits, scientific for tiny errors."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "0"
        mag = abs(value)
        if mag < 1e-2 or mag >= 1e6:
            return f"{value:.2e}"
        if mag >= 100:
            return f"{value:.1f}"
        return f"{value:.3g}" if mag < 1 else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def columns_of(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> list[str]:
    """``columns``, or every key of the rows in first-seen order."""
    if columns is not None:
        return list(columns)
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def non_empty(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    """The columns that hold a value in at least one row (optional columns drop out)."""
    return [c for c in columns if any(row.get(c) is not None for row in rows)]


def _is_numeric(values: Iterable[Any]) -> bool:
    vals = [v for v in values if v is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


def _widths(cols: Sequence[str], cells: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]


def _cut(cols: list[str], cells: list[list[str]], numeric: list[bool], width: int) -> bool:
    """Cut the widest text columns' cells (to ``MIN_TEXT_WIDTH`` at most; never the first,
    the rows' names) until the table fits ``width``; False (cells unchanged) where cutting
    cannot make it fit."""
    w = _widths(cols, cells)
    floor = [wi if numeric[i] or i == 0 else min(wi, max(MIN_TEXT_WIDTH, len(cols[i])))
             for i, wi in enumerate(w)]  # fmt: skip
    if sum(floor) + 2 * (len(cols) - 1) > width:
        return False
    excess = sum(w) + 2 * (len(cols) - 1) - width
    while excess > 0:
        i = max(range(len(cols)), key=lambda j: w[j] - floor[j])
        keep = max(floor[i], w[i] - excess)
        excess -= w[i] - keep
        w[i] = keep
        for r in cells:
            if len(r[i]) > keep:
                r[i] = r[i][: keep - 3] + "..."
    return True


def _fit(cols: list[str], cells: list[list[str]], numeric: list[bool], width: int) -> list[str]:
    """Drop the fewest columns (the last but one, then the one before...) with which cutting
    text cells makes the table fit ``width``; returns the dropped columns' names (``cols``,
    ``cells`` and ``numeric`` are changed in place)."""
    dropped: list[str] = []
    while not _cut(cols, cells, numeric, width) and len(cols) > 2:
        i = len(cols) - 2
        dropped.insert(0, cols.pop(i))
        numeric.pop(i)
        for r in cells:
            r.pop(i)
    return dropped


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """An aligned plain-text table: numbers right-aligned, text left-aligned; fits the width
    ``table_width`` sets (``TABLE_WIDTH`` by default)."""
    cols = columns_of(rows, columns)
    if not cols:
        return "(no rows)"
    cells = [[format_value(row.get(c)) for c in cols] for row in rows]
    numeric = [_is_numeric(row.get(c) for row in rows) for c in cols]
    width = _WIDTH.get()
    dropped = _fit(cols, cells, numeric, width) if width is not None else []
    widths = _widths(cols, cells)

    def line(vals: Sequence[str]) -> str:
        out = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    lines = [line(cols), sep] + [line(r) for r in cells]
    if dropped:
        note = f"# {len(dropped)} more columns with --wide (and in --json): {', '.join(dropped)}"
        lines += textwrap.wrap(note, width, subsequent_indent="#   ")
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The same table as GitHub markdown."""
    cols = columns_of(rows, columns)
    if not cols:
        return "_(no rows)_"
    numeric = [_is_numeric(row.get(c) for row in rows) for c in cols]
    head = "| " + " | ".join(cols) + " |"
    align = "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"
    body = [
        "| " + " | ".join(format_value(row.get(c)).replace("|", "\\|") for c in cols) + " |"
        for row in rows
    ]
    return "\n".join([head, align, *body])


class _NoBar:
    """Stands in for a tqdm bar when tqdm is missing or progress is off."""

    def __init__(self, iterable: Iterable[Any] | None = None, **_: Any) -> None:
        self._it = iterable

    def __iter__(self) -> Any:
        return iter(self._it if self._it is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable: Iterable[Any] | None = None, *, enabled: bool = True, **kw: Any) -> Any:
    """A tqdm progress bar on stderr (``leave=False``), or a silent stand-in."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is a dependency, but keep the commands usable without it
            pass
        else:
            return tqdm(iterable, leave=False, **kw)
    return _NoBar(iterable)
