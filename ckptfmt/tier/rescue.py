"""``ckpt rescue``: persist what dead workers left in node memory, as ordinary checkpoints of their run.

Every committed slot under a memory directory that belongs to the run directory is verified whole
(every file re-hashed) and copied into it (:func:`~ckptfmt.tier.persist.persist`); a slot that fails
verification, is torn, or belongs to another run directory is reported and left alone. Nothing in
memory is deleted: the memory tier's owner reuses its slots.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsafePathError
from ..reader import verify_url
from ..run import RunDirectory
from .binding import normalize_run_url, run_dir_key
from .persist import Persisted, persist
from .ring import SLOT_PREFIX, Slot, private_dir_problem, read_slot


@dataclass(frozen=True, slots=True, kw_only=True)
class RescueOutcome:
    """One slot: what it held and what became of it."""

    slot: Slot
    status: str  # persisted | already durable | conflict | corrupt | skipped
    detail: str | None = None
    persisted: Persisted | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "slot": self.slot.to_dict(),
            "status": self.status,
            "detail": self.detail,
            "persisted": self.persisted.to_dict() if self.persisted else None,
        }


def find_slots(memory_dir: str | os.PathLike[str], run_url: str) -> list[Slot]:
    """The slots under ``memory_dir`` that belong to ``run_url``'s directory, newest step first.

    UnsafePathError when the run's directory there is a symlink, not a directory or another user's (as a
    writer refuses it, :meth:`~ckptfmt.tier.ring.MemoryTier.ensure`): its slots would be someone else's."""
    root = Path(memory_dir) / run_dir_key(run_url)
    problem = private_dir_problem(root)
    if problem == "absent":
        return []
    if problem is not None:
        raise UnsafePathError(problem, path=str(root))
    found = []
    for child in sorted(root.iterdir()):
        suffix = child.name.removeprefix(SLOT_PREFIX)
        if child.name.startswith(SLOT_PREFIX) and suffix.isdigit() and child.is_dir() and not child.is_symlink():
            found.append(read_slot(child, int(suffix)))
    found.sort(key=lambda s: (s.step if s.step is not None else -1, s.index), reverse=True)
    return found


def rescue(
    memory_dir: str | os.PathLike[str], run_url: str, storage_options: Mapping[str, Any] | None = None
) -> list[RescueOutcome]:
    """Persist every good committed slot of ``run_url`` found under ``memory_dir``; one outcome per slot."""
    run = RunDirectory(run_url, storage_options)
    wanted = normalize_run_url(run_url)
    outcomes = []
    for slot in find_slots(memory_dir, run_url):
        if slot.status != "committed" or slot.binding is None:
            outcomes.append(RescueOutcome(slot=slot, status="skipped", detail=slot.reason or slot.status))
            continue
        if normalize_run_url(slot.binding.run_dir) != wanted:
            detail = f"belongs to run directory {slot.binding.run_dir!r}"
            outcomes.append(RescueOutcome(slot=slot, status="skipped", detail=detail))
            continue
        report = verify_url(slot.path)
        if not report.ok:
            detail = "; ".join(str(p) for p in report.problems[:3])
            outcomes.append(RescueOutcome(slot=slot, status="corrupt", detail=detail))
            continue
        try:
            done = persist(slot.path, run)
        except CheckpointError as exc:  # rotted between verify and copy, or the run directory failed
            outcomes.append(RescueOutcome(slot=slot, status="corrupt", detail=str(exc)))
            continue
        outcomes.append(RescueOutcome(slot=slot, status=done.status, persisted=done))
    return outcomes
