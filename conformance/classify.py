"""The reader protocol as a judge: what one call of a reader adapter means for one vector.

This is the only place that decides what counts as an acceptance or a refusal. The protocol is the
strict one of conformance/README.md: a refusal is exit status 1, nothing on stdout, and stderr's
first line starting with a requirement ID among the vector's ``requirements`` or ``also``; a signal
or another exit status is "crashed", a missing or other ID (or output on stdout) "refused for the
wrong reason". A reader that merely dies on what it cannot handle therefore passes no invalid vector.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from typing import Any

from ckptfmt.canonical import canonical_json
from ckptfmt.errors import CheckpointError

from .results import Kind

REFUSED_ON = re.compile(r"([A-Z]+-[0-9]+)\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    """One call of an adapter: its exit status (None: no answer in time) and its output, bounded."""

    argv: tuple[str, ...]
    status: int | None
    stdout: str
    stderr: str
    seconds: float
    timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    kind: Kind
    got: str  # one line for the table
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """The parts of a non-zero exit the strict protocol looks at."""

    status: int
    first_line: str  # of stderr
    refused_on: str | None  # the requirement ID stderr's first line starts with, if any
    stdout_empty: bool

    @classmethod
    def of(cls, ex: Exchange) -> Refusal:
        assert ex.status is not None
        first = ex.stderr.split("\n", 1)[0].rstrip("\r")  # the first line, as written: not the first non-blank
        m = REFUSED_ON.match(first)
        return cls(status=ex.status, first_line=first, refused_on=m.group(1) if m else None, stdout_empty=not ex.stdout)

    def describe(self) -> str:
        how = f"killed by {_signal_name(-self.status)}" if self.status < 0 else f"exit status {self.status}"
        return f"{how}; stderr: {self.first_line[:200]!r}" if self.first_line else f"{how}; nothing on stderr"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


REFUSAL_STATUS = 1


def judge_invalid(ex: Exchange, requirements: tuple[str, ...], also: tuple[str, ...]) -> Verdict:
    """An invalid vector: the reader must refuse it, naming a rule the vector breaks (strict protocol)."""
    if ex.status is None:
        return Verdict(kind=Kind.NO_ANSWER, got="no answer", detail=f"no answer in {ex.timeout:g} s")
    if ex.status == 0:
        return Verdict(kind=Kind.ACCEPTED_INVALID, got="accepted", detail=f"exit status 0; stdout: {ex.stdout[:200]!r}")
    refusal = Refusal.of(ex)
    detail = refusal.describe()
    if refusal.status != REFUSAL_STATUS:
        return Verdict(kind=Kind.CRASHED, got=f"crashed ({detail.split(';', 1)[0]})", detail=detail)
    if not refusal.stdout_empty:
        return Verdict(
            kind=Kind.WRONG_REASON,
            got="refused, but printed on stdout",
            detail=f"{detail}; stdout: {ex.stdout[:200]!r}",
        )
    if refusal.refused_on is None:
        return Verdict(kind=Kind.WRONG_REASON, got="refused without a requirement ID", detail=detail)
    if refusal.refused_on not in requirements and refusal.refused_on not in also:
        named = ", ".join((*requirements, *also))
        return Verdict(
            kind=Kind.WRONG_REASON,
            got=f"refused on {refusal.refused_on}, not on {named}",
            detail=detail,
        )
    return Verdict(kind=Kind.PASSED, got=f"rejected: {refusal.refused_on}", detail=detail)


def judge_valid(ex: Exchange, expected: Any) -> Verdict:
    """A valid vector: the reader must exit 0 and print a description equal to ``expected``."""
    if ex.status is None:
        return Verdict(kind=Kind.NO_ANSWER, got="no answer", detail=f"no answer in {ex.timeout:g} s")
    if ex.status != 0:
        refusal = Refusal.of(ex)
        return Verdict(kind=Kind.REFUSED_VALID, got=f"rejected: {_last_line(ex.stderr)}", detail=refusal.describe())
    try:
        got = json.loads(ex.stdout)
    except ValueError as exc:
        return Verdict(kind=Kind.NOT_A_DESCRIPTION, got=f"stdout is not JSON: {exc}", detail=ex.stdout[:500])
    if (where := _first_float(got)) is not None:
        return Verdict(
            kind=Kind.NOT_A_DESCRIPTION, got=f"stdout is not a description: a float at {where}", detail=ex.stdout[:500]
        )
    problem = mismatch(got, expected)
    if problem is None:
        return Verdict(kind=Kind.PASSED, got="same content")
    kind = Kind.NOT_A_DESCRIPTION if problem.startswith("not a description") else Kind.WRONG_CONTENT
    return Verdict(kind=kind, got=f"different content: {problem}", detail=problem)


def _first_float(value: Any, where: str = "$") -> str | None:
    """Where the first non-integer number is: a description has none (floats are tagged, ``$float``)."""
    if isinstance(value, float):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (
            found := _first_float(item, f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]")
        ) is not None:
            return found
    return None


def first_difference(got: Any, want: Any, where: str = "$") -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want)):
            if key not in got or key not in want:
                return f"{where}.{key} {'missing' if key not in got else 'unexpected'}"
            if got[key] != want[key]:
                return first_difference(got[key], want[key], f"{where}.{key}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                return first_difference(g, w, f"{where}[{i}]")
    return f"{where} differs"


def mismatch(got: Any, want: Any) -> str | None:
    """None when equal, else where they first differ (both compared as canonical JSON)."""
    try:
        if canonical_json(got) == canonical_json(want):
            return None
    except CheckpointError as exc:  # a float NaN, a non-JSON value...
        return f"not a description: {exc.message}"
    return first_difference(got, want)
