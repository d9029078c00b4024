"""What one run of the suite found: a :class:`Result` per vector, each with an outcome :class:`Kind`.

Every output (the table, ``--json``, ``--junit-xml``, the markdown report) renders these records and
nothing else, so a change of protocol is a change of the judge (conformance/classify.py) only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

Direction = Literal["reader", "writer"]


class Kind(Enum):
    """How a vector ended: passed, or failed for one of these reasons (value: a stable slug for --json)."""

    PASSED = "passed"
    # reader, valid vector
    REFUSED_VALID = "refused-valid"
    WRONG_CONTENT = "wrong-content"
    NOT_A_DESCRIPTION = "not-a-description"
    # reader, invalid vector
    ACCEPTED_INVALID = "accepted-invalid"
    CRASHED = "crashed"  # strict protocol (issue 14): a signal, or an exit status other than 0 and 1
    WRONG_REASON = "refused-for-the-wrong-reason"  # strict protocol: no ID, or an ID the vector does not name
    # either direction
    NO_ANSWER = "no-answer"
    # writer, valid input
    WRITE_FAILED = "write-failed"
    UNREADABLE = "unreadable"
    CHECK_FAILED = "check-failed"
    NOT_DETERMINISTIC = "not-deterministic"
    # writer, scenario
    NOT_REFUSED = "not-refused"
    LEFT_CHANGES = "left-changes"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Kind.PASSED: "passed",
    Kind.REFUSED_VALID: "refused a valid checkpoint",
    Kind.WRONG_CONTENT: "different content",
    Kind.NOT_A_DESCRIPTION: "stdout is not a description",
    Kind.ACCEPTED_INVALID: "accepted an invalid checkpoint",
    Kind.CRASHED: "crashed",
    Kind.WRONG_REASON: "refused for the wrong reason",
    Kind.NO_ANSWER: "no answer in time",
    Kind.WRITE_FAILED: "writer failed",
    Kind.UNREADABLE: "the reference reader refuses the output",
    Kind.CHECK_FAILED: "the output breaks a writer check",
    Kind.NOT_DETERMINISTIC: "a second run gave different bytes",
    Kind.NOT_REFUSED: "wrote what it must refuse",
    Kind.LEFT_CHANGES: "refused, but changed the output directory",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One vector run through one adapter.

    ``checked`` are the requirement IDs this run is evidence about (the vector's own, plus every
    writer check for a written checkpoint); ``failed`` those it is evidence against.
    """

    vector: str  # "valid/weights", "invalid/chunks-overlap", "writer/foreign-lock"
    direction: Direction
    requirements: tuple[str, ...]
    also: tuple[str, ...] = ()
    expected: str  # accepted | rejected | written | refused
    got: str  # one line for the table
    kind: Kind
    detail: str = ""  # what went wrong (or how it refused), in full
    checked: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    exit_status: int | None = None  # None: no answer in time; negative: killed by that signal
    stdout: str = ""  # kept only for failures, bounded
    stderr: str = ""  # bounded
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind is Kind.PASSED

    @property
    def title(self) -> str:
        """The vector and its requirement IDs, as a CI test case is named."""
        ids = ", ".join(self.requirements)
        if self.also:
            ids += "; also " + ", ".join(self.also)
        return f"{self.vector} [{ids}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "vector": self.vector,
            "direction": self.direction,
            "requirements": list(self.requirements),
            "also": list(self.also),
            "expected": self.expected,
            "got": self.got,
            "outcome": "passed" if self.ok else "failed",
            "kind": self.kind.value,
            "reason": self.kind.label,
            "detail": self.detail,
            "checked": list(self.checked),
            "failed": list(self.failed),
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 3),
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Suite:
    """Which suite ran: printed first, and recorded in every output."""

    version: str  # of the suite (the ckptfmt release it ships with)
    spec_version: str  # the format version its vectors are written for
    vectors: str  # where the vector tree is
    digest: str  # sha256 of the vector tree (paths, bytes, link targets): the same digest, the same vectors

    def to_dict(self) -> dict[str, str]:
        return {
            "name": "ckptfmt-conformance",
            "version": self.version,
            "spec_version": self.spec_version,
            "vectors": self.vectors,
            "vectors_digest": self.digest,
        }

    @property
    def line(self) -> str:
        return (
            f"ckptfmt conformance suite {self.version}, for ckptfmt format versions 1.0 to {self.spec_version}; "
            f"vectors {self.digest} at {self.vectors}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """A whole run: the suite, the commands under test, every result."""

    suite: Suite
    commands: dict[str, str]  # direction -> command
    results: list[Result]
    seconds: float = 0.0
    untested: dict[str, dict[str, Any]] = field(default_factory=dict)  # coverage.json: ID -> {why, tests}
    known: frozenset[str] = frozenset()  # every ID the suite's vectors and writer checks name, run or not

    @property
    def passed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    @property
    def ok(self) -> bool:
        return bool(self.results) and self.failed == 0

    def requirements(self) -> dict[str, Status]:
        """Every requirement ID the vectors, the writer checks or coverage.json name, with its status."""
        out: dict[str, Status] = {rid: Status() for rid in self.known}
        for r in self.results:
            for rid in r.checked:
                s = out.setdefault(rid, Status())
                s.vectors.append(r.vector)
                if rid in r.failed:
                    s.failing.append(r.vector)
        for rid in self.untested:
            out.setdefault(rid, Status(untested=True))
        return dict(sorted(out.items(), key=lambda item: id_key(item[0])))

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite.to_dict(),
            "commands": self.commands,
            "summary": {"passed": self.passed, "failed": self.failed, "seconds": round(self.seconds, 3)},
            "results": [r.to_dict() for r in self.results],
            "requirements": {
                rid: {"status": s.status, "vectors": s.vectors, "failing": s.failing}
                for rid, s in self.requirements().items()
            },
        }


@dataclass(slots=True)
class Status:
    """The evidence about one requirement ID in a run."""

    vectors: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)
    untested: bool = False  # decided by no vector: process-level (conformance/coverage.json)

    @property
    def status(self) -> str:
        if self.failing:
            return "fail"
        if self.vectors:
            return "pass"
        return "untested by vectors" if self.untested else "not run"


def id_key(rid: str) -> tuple[str, int]:
    """MAN-2 before MAN-10."""
    m = re.fullmatch(r"([A-Z]+)-([0-9]+)", rid)
    return (m.group(1), int(m.group(2))) if m else (rid, 0)
