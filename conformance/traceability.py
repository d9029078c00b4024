"""``python -m conformance check``: every spec requirement has a vector, a writer check, or a reason why not.

A requirement is covered when a vector's ``requirements`` name it (valid vectors in about.json,
invalid vectors and writer scenarios in expected.json) or a writer check decides it. The few that
no black-box test can decide are listed in conformance/coverage.json with the reference tests that
cover them; that list must be exact (no ID there that a vector covers) and its tests must exist.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import COVERAGE, SPEC, VECTORS
from .writer_checks import CHECKS, DETERMINISM

REQUIREMENT = re.compile(r"\*\*\[([A-Z]+-[0-9]+)\]\*\*")
ROOT = SPEC.parent


def spec_ids(spec: Path = SPEC) -> set[str]:
    return {m for path in sorted(spec.glob("*.md")) for m in REQUIREMENT.findall(path.read_text())}


def vector_ids(vectors: Path = VECTORS) -> dict[str, set[str]]:
    """Vector name -> every ID it names (its ``requirements``, and ``also``)."""
    out: dict[str, set[str]] = {}
    for kind, name in (("valid", "about.json"), ("invalid", "expected.json"), ("writer", "expected.json")):
        for doc_path in sorted((vectors / kind).glob(f"*/{name}")):
            doc: dict[str, Any] = json.loads(doc_path.read_bytes())
            out[f"{kind}/{doc_path.parent.name}"] = set(doc["requirements"]) | set(doc.get("also", []))
    return out


def covered_by_vectors(vectors: Path = VECTORS) -> set[str]:
    ids: set[str] = set()
    for kind, name in (("valid", "about.json"), ("invalid", "expected.json"), ("writer", "expected.json")):
        for doc_path in (vectors / kind).glob(f"*/{name}"):
            ids |= set(json.loads(doc_path.read_bytes())["requirements"])
    return ids


def check_ids() -> set[str]:
    return {rid for rid, _ in CHECKS} | {DETERMINISM}


def coverage(path: Path = COVERAGE) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    return doc


@dataclass(frozen=True)
class Traceability:
    spec: set[str]
    by_vectors: set[str]
    by_checks: set[str]
    by_tests: set[str]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _test_exists(ref: str) -> bool:
    file, _, name = ref.partition("::")
    path = ROOT / file
    return path.is_file() and re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.MULTILINE) is not None


def trace(vectors: Path = VECTORS, coverage_path: Path = COVERAGE, spec: Path = SPEC) -> Traceability:
    ids = spec_ids(spec)
    by_vectors, by_checks = covered_by_vectors(vectors), check_ids()
    listed = coverage(coverage_path)
    problems = []
    for vector, named in sorted(vector_ids(vectors).items()):
        problems += [f"{vector} names {rid}, which the spec does not have" for rid in sorted(named - ids)]
    problems += [f"writer check {rid} is not a spec requirement" for rid in sorted(by_checks - ids)]
    for rid, entry in sorted(listed.items()):
        if rid not in ids:
            problems.append(f"coverage.json lists {rid}, which the spec does not have")
        if rid in by_vectors | by_checks:
            problems.append(f"coverage.json lists {rid}, but a vector or writer check covers it")
        if not entry.get("why") or not entry.get("tests"):
            problems.append(f"coverage.json entry {rid} needs 'why' and 'tests'")
        problems += [f"coverage.json {rid}: no test {t}" for t in entry.get("tests", []) if not _test_exists(t)]
    uncovered = ids - by_vectors - by_checks - set(listed)
    problems += [f"{rid} has no vector, no writer check and no coverage.json entry" for rid in sorted(uncovered)]
    return Traceability(ids, by_vectors, by_checks, set(listed) & ids, problems)
