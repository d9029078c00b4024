"""Strict, bounded JSON parsing for every JSON document ckptfmt reads.

The standard library's parser recurses once per nesting level (``RecursionError`` on hostile depth),
converts integer literals of any length (``ValueError`` past 4300 digits, quadratic time before that),
and accepts ``NaN``/``Infinity``, none of which is JSON (RFC 8259). :func:`load_json` bounds all three
before parsing and raises the caller's own :class:`~ckptfmt.errors.CheckpointError` subclass, so no
builtin exception escapes and the error names the file.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import CheckpointError

MAX_DEPTH = 64  # arrays and objects nested deeper than this are refused before parsing
MAX_INT_DIGITS = 20  # enough for any 64-bit integer, signed or unsigned
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
PRESCAN_BYTES = 4 << 20  # larger documents rely on the parser's own recursion and int-length guards
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_DIGIT_RUN = re.compile(rb"\d{%d,}" % (MAX_INT_DIGITS + 1))
# A run of digits that is a whole integer literal: not a fraction or an exponent (floats parse in linear time).
_LONG_INT = re.compile(rb"(?<![\d.eE+])(?<![eE]-)\d{%d,}(?![\d.eE])" % (MAX_INT_DIGITS + 1))
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")


def json_nesting_problem(data: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """Why ``data`` nests too deeply or holds an over-long integer literal, or None. Linear time, in C."""
    bare = _STRING.sub(b'""', data)
    long_int = _LONG_INT.search(bare) if _DIGIT_RUN.search(bare) else None
    if long_int is not None:
        return f"JSON integer literal of {len(long_int.group())} digits (at most {MAX_INT_DIGITS})"
    brackets = bare.translate(_BRACKET_STEPS, delete=_NOT_BRACKETS)
    if len(brackets) > max_depth and _depth_over(brackets, max_depth):
        return f"JSON nests deeper than {max_depth} levels"
    return None


def _depth_over(brackets: bytes, max_depth: int) -> bool:
    """Whether a string of openers (1) and closers (2) nests deeper than ``max_depth``, in at most
    ``max_depth + 1`` passes in C (no numpy: a short command's start should not import it).

    Each pass removes every innermost pair (an opener right before a closer); a pair whose children were removed
    becomes innermost in the next pass, so balanced brackets vanish in as many passes as they nest deep. What is
    left of unbalanced ones (closers, then openers) nests the parser one level deeper per opener left."""
    for passes in range(max_depth + 1):
        fewer = brackets.replace(b"\x01\x02", b"")
        if len(fewer) == len(brackets):
            return passes + fewer.count(b"\x01") > max_depth
        brackets = fewer
    return True


def load_json(
    data: bytes | str,
    *,
    error: type[CheckpointError],
    what: str,
    path: str | None = None,
    allow_float: bool = False,
    max_depth: int = MAX_DEPTH,
    duplicate_requirement: str | None = None,
) -> Any:
    """Parse ``data`` as strict JSON: UTF-8, no duplicate member names, no NaN/Infinity, bounded nesting
    and integer length; floats only where ``allow_float``. Every failure raises ``error`` naming ``what``;
    a duplicate member name carries ``duplicate_requirement`` (the rule a caller's format gives it).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    problem = json_nesting_problem(raw, max_depth) if len(raw) <= PRESCAN_BYTES else None
    if problem is not None:
        raise error(f"{what}: {problem}", path=path)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise error(f"{what}: duplicate JSON member name {key!r}", path=path, requirement=duplicate_requirement)
            out[key] = value
        return out

    def no_constant(text: str) -> Any:
        raise error(f"{what}: {text} is not JSON", path=path)

    def no_float(text: str) -> Any:
        raise error(f"{what}: floating-point number {text} is not allowed here", path=path)

    try:
        text = raw.decode("utf-8")
        return json.loads(
            text,
            object_pairs_hook=pairs,
            parse_constant=no_constant,
            parse_float=float if allow_float else no_float,
        )
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not valid UTF-8: {exc}", path=path) from exc
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise error(f"{what} is not valid JSON: {exc}", path=path) from exc
