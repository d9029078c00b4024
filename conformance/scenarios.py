"""Writer scenarios: inputs a writer must refuse, and what it must leave behind (``run --writer``).

The runner copies ``setup/`` (if any) to the output directory, runs the writer, and expects a
non-zero exit and the output directory either byte-for-byte ``unchanged`` or holding no ``empty``
file at all (an aborted save deletes what it wrote, COM-14).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .inputs import training_base, weights_base
from .reference_writer import write


@dataclass(frozen=True)
class Scenario:
    name: str
    requirements: tuple[str, ...]
    note: str
    input: Callable[[], dict[str, Any]]
    after: str  # "unchanged" or "empty"
    setup: Callable[[Path], None] | None = None


def _existing(root: Path) -> None:
    write(weights_base(), root)


def _foreign_lock(root: Path) -> None:
    root.mkdir(parents=True)
    lock = {"host": "another-host.invalid", "nonce": "0123456789abcdef", "pid": 1, "started_at": "2025-01-01T00:00:00Z"}
    (root / ".writer-lock").write_bytes(json.dumps(lock, sort_keys=True).encode())


def _without_data() -> dict[str, Any]:
    doc = training_base()
    del doc["fields"]["data"]
    return doc


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "existing-checkpoint",
        ("COM-2", "COM-13"),
        "A committed checkpoint is already there: the writer refuses and changes nothing (its lock is gone too).",
        weights_base,
        "unchanged",
        _existing,
    ),
    Scenario(
        "foreign-lock",
        ("COM-1",),
        "Another host's writer lock is there: the writer refuses and changes nothing.",
        weights_base,
        "unchanged",
        _foreign_lock,
    ),
    Scenario(
        "missing-required-field",
        ("PRO-2", "COM-14"),
        "A training input without the data field: the writer refuses to commit and leaves no file behind.",
        _without_data,
        "empty",
    ),
)
