"""Writing results: JSON and tables on stdout, diagnostics and the progress bar on stderr."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import click

# Python refuses str() of an int of more than 4,300 digits (ValueError; quadratic time below that), and a
# context may hold a bigint of any size (CTX-11): larger ones are shown by their size, as ckptfmt.description
# refuses to describe them past the same bound (2,467 digits).
MAX_INT_BITS = 8192


def printable_int(value: int) -> int | str:
    """``value``, or a short description of it when it is too large to print in decimal."""
    bits = value.bit_length()
    return value if bits <= MAX_INT_BITS else f"<{'negative ' if value < 0 else ''}integer of {bits} bits>"


def jsonable(value: object) -> Any:
    """A context value as JSON: arrays and bytes become short descriptions, not data; so do integers too
    large to print."""
    if isinstance(value, int) and not isinstance(value, bool):
        return printable_int(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    numpy = sys.modules.get("numpy")  # an array exists only once numpy is imported: a command never imports it here
    if numpy is not None and isinstance(value, numpy.ndarray):
        return f"<ndarray {value.dtype} {list(value.shape)}>"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def emit_json(document: object) -> None:
    # jsonable: a value straight from a checkpoint (a bigint step) must not crash the encoder
    click.echo(json.dumps(jsonable(document), indent=2, ensure_ascii=False, allow_nan=False))


def info(message: str) -> None:
    """A diagnostic line on stderr."""
    click.echo(message, err=True)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned to their widest cell, numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(jsonable(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


class ProgressBar:
    """A byte-count bar on stderr, drawn only when stderr is a terminal and --quiet was not given."""

    WIDTH = 30
    INTERVAL = 0.1

    def __init__(self, label: str, *, quiet: bool = False) -> None:
        self.label = label
        self.enabled = not quiet and sys.stderr.isatty()
        self.total = 0
        self.done = 0
        self._last = 0.0

    def start(self, total: int) -> None:
        self.total = total
        self._draw(force=True)

    def advance(self, amount: int) -> None:
        self.done += amount
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.INTERVAL and self.done < self.total:
            return
        self._last = now
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        text = f"\r{self.label} [{bar}] {fraction:4.0%} {human_bytes(self.done)}/{human_bytes(self.total)}"
        sys.stderr.write(text)
        sys.stderr.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.enabled:
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
