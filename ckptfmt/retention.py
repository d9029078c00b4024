"""Retention as a pure plan: which checkpoints of a run directory to delete, from its listing alone.

:meth:`ckptfmt.run.RunDirectory.plan_retention` reads the listing, the pins, the ``latest`` pointer and why
retention may be held, and hands them to :func:`plan_retention`; :meth:`~ckptfmt.run.RunDirectory.collect`
deletes what the plan dooms, re-reading who references whom first. Nothing here does I/O, so every rule is
testable on made-up entries.

The rules: committed checkpoints outside ``keep_last`` (counted from the highest step down), ``keep_every``,
the pins, ``latest`` and ``protect`` are doomed, and so are the remains of dead writers. Never a checkpoint a
live writer holds, one whose manifest is invalid, remains holding files no writer makes, nor a committed
checkpoint that something kept references: a kept (or live, or invalid) checkpoint's bases, as its manifest
lists them, and a live writer's, as its lock lists them (REF-13), closed transitively.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Status = Literal["committed", "incomplete", "writing", "invalid manifest"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One checkpoint (or the remains of one) in a run directory."""

    name: str
    step: int | None
    status: Status
    size: int
    files: int
    checkpoint_id: str | None = None
    profile: str | None = None
    created: str | None = None
    error: dict[str, str] | None = None  # CheckpointError.to_dict(): why the manifest or provenance is unreadable
    # Paths (relative to the checkpoint) no ckptfmt writer makes: neither listed by the manifest nor named
    # as a writer names its files, or (uncommitted, local) a symlink or special file. gc never deletes them,
    # and leaves an uncommitted checkpoint holding any alone.
    foreign: tuple[str, ...] = ()
    # The checkpoints (sibling names) it references chunks of: from its manifest when committed (read leniently
    # when the manifest is refused), from its writer lock otherwise. ``size`` counts only its own files;
    # ``referenced_bytes`` the stored bytes of the chunks it references in its bases instead of storing them.
    bases: tuple[str, ...] = ()
    referenced_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "status": self.status,
            "size": self.size,
            "files": self.files,
            "checkpoint_id": self.checkpoint_id,
            "profile": self.profile,
            "created": self.created,
            "error": self.error,
            "foreign": list(self.foreign),
            "bases": list(self.bases),
            "referenced_bytes": self.referenced_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPlan:
    """What retention deletes, and what it keeps only for references."""

    doomed: tuple[Entry, ...]
    # name -> the checkpoints whose references keep it (committed referrers and live writers; REF-13),
    # for each checkpoint that the retention rules alone would have deleted
    referenced: Mapping[str, tuple[str, ...]]
    hold: str | None = None  # why retention deletes no committed checkpoint now (see RunDirectory.retention_hold)


def plan_retention(
    entries: list[Entry],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Iterable[str] = (),
    pinned: Iterable[str] = (),
    latest: str | None = None,
    pointers_hold: str | None = None,
) -> RetentionPlan:
    """The plan for ``entries`` (newest step first, as :meth:`ckptfmt.run.RunDirectory.entries` lists them).

    ``pointers_hold``: why the run directory's pointers cannot be trusted now (retention then deletes no
    committed checkpoint, and the pins are not read); ``latest``: the name the ``latest`` pointer names.
    """
    hold = pointers_hold
    unknown = [e.name for e in entries if e.status == "writing" and e.error is not None]
    if unknown:
        why = (
            f"the writer lock of {', '.join(unknown)} cannot be read, so which checkpoints its writer "
            "references is unknown — committed checkpoints are kept until it is repaired"
        )
        hold = why if hold is None else f"{hold}; {why}"
    if hold is not None:
        log.warning("retention suspended: %s", hold)
        keep_last = None  # delete only the remains of dead writers
    keep = set(protect) | (set(pinned) if pointers_hold is None else set())
    if latest:
        keep.add(latest)
    committed = [e for e in entries if e.status == "committed"]
    if keep_last is not None:
        keep.update(e.name for e in committed[:keep_last])
    if keep_every:
        keep.update(e.name for e in committed if e.step is not None and e.step % keep_every == 0)
    doomed: dict[str, Entry] = {}
    for entry in entries:
        # An unreadable manifest is not a crash's remains (the manifest is written last, checked): it is
        # corrupt or from a newer format version, and deleting it is an operator's call.
        if entry.name in keep or entry.status in ("writing", "invalid manifest"):
            continue
        if entry.status == "committed" and keep_last is None:
            continue  # no retention rule given: gc removes only the remains of dead writers
        if entry.status != "committed" and entry.foreign:
            continue  # not provably a writer's remains: someone else's files live there
        doomed[entry.name] = entry
    referenced = _rescue(entries, doomed)
    return RetentionPlan(
        doomed=tuple(e for e in entries if e.name in doomed),
        referenced={name: tuple(sorted(users)) for name, users in sorted(referenced.items())},
        hold=hold,
    )


def _rescue(entries: list[Entry], doomed: dict[str, Entry]) -> dict[str, list[str]]:
    """Take out of ``doomed`` every committed checkpoint that a survivor references, transitively (REF-8
    makes references one level deep; a hand-made or future chain is kept whole all the same); returns
    name -> the survivors that reference it, for each checkpoint taken out."""
    rescued: dict[str, list[str]] = {}
    users = [e for e in entries if e.name not in doomed and e.status in ("committed", "writing", "invalid manifest")]
    while users:
        user = users.pop()
        for base in user.bases:
            if base in doomed and doomed[base].status == "committed":
                users.append(doomed.pop(base))
                rescued[base] = []
            if base in rescued and base != user.name:
                rescued[base].append(user.name)
    return rescued


def referrers_first(entries: Iterable[Entry]) -> list[Entry]:
    """``entries`` ordered so that each comes before those it references, otherwise as given."""
    pending = list(entries)
    out: list[Entry] = []
    while pending:
        needed = {b for e in pending for b in e.bases if b != e.name}
        ready = {e.name for e in pending if e.name not in needed} or {pending[0].name}  # a (hostile) cycle
        out += [e for e in pending if e.name in ready]
        pending = [e for e in pending if e.name not in ready]
    return out
