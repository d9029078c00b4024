"""A run directory: checkpoints named by step, a ``latest`` pointer, pins, retention and garbage collection.

    run/step-000000100/manifest.json ...
    run/latest.json        {"name": "step-000000100", "step": 100, "checkpoint_id": "sha256:..."}
    run/pins.json          {"pinned": ["step-000000050"]}

The same rules serve the trainer's CheckpointManager, ``ckpt ls`` and ``ckpt gc``.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import CheckpointError
from .lock import read_lock
from .manifest import checkpoint_id, parse_manifest
from .paths import LOCK_NAME, MANIFEST_NAME
from .storage import Store, open_store

LATEST_NAME = "latest.json"
PINS_NAME = "pins.json"
_STEP = re.compile(r"(\d+)$")
Status = Literal["committed", "incomplete", "writing", "invalid manifest"]
# A file the reference writer puts in a checkpoint: how an uncommitted one is told from any other directory.
_LAYOUT = re.compile(r"[a-z][a-z0-9_]{0,63}/(\.?r\d{5}-\d{5}\.safetensors(\.tmp-[0-9a-f]+)?|\.?context\.msgpack.*)")
# A writer lock from another host is presumed live for this long: its holder's pid cannot be checked from here.
DEFAULT_STALE_AFTER_S = 24 * 3600


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def is_checkpoint_dir(files: Iterable[str]) -> bool:
    """Whether a child of a run directory is a checkpoint or the remains of one (paths relative to it).

    It is when it has a manifest, a writer lock, or a file laid out as the writer lays them out; any
    other directory (logs, say) is not the run's to list or delete.
    """
    return any(p in (MANIFEST_NAME, LOCK_NAME) or _LAYOUT.fullmatch(p) for p in files)


def step_of(name: str) -> int | None:
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


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
        }


def _lock_is_live(store: Store, prefix: str, stale_after_s: float) -> bool:
    """Whether a writer may still be working on ``prefix``.

    As spec/commit.md: a lock is dead only when its holder is known to be gone (a pid of this host
    that no longer runs). A lock of another host counts as live until ``stale_after_s`` after its
    ``started_at``; a lock that cannot be read counts as live (an operator removes it), never as dead.
    """
    lock = read_lock(store, f"{prefix}/{LOCK_NAME}")
    if lock is None:
        return True
    if lock.holder_is_dead():
        return False
    if lock.host == socket.gethostname():
        return True
    age = lock.age_seconds()
    return age is None or age < stale_after_s


class RunDirectory:
    """The checkpoints under one run URL."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
    ) -> None:
        self.url = os.fspath(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.store = open_store(self.url, self.storage_options)
        self.stale_after_s = stale_after_s

    def child_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def entries(self) -> list[Entry]:
        """Every checkpoint directory, newest step first; status read from manifests and locks."""
        groups: dict[str, dict[str, int]] = {}
        for path, size in self.store.list().items():
            head, sep, rest = path.partition("/")
            if sep and not head.startswith("."):
                groups.setdefault(head, {})[rest] = size
        out = []
        for name, files in groups.items():
            if is_checkpoint_dir(files):
                out.append(self._entry(name, files))
        out.sort(key=lambda e: (e.step if e.step is not None else -1, e.name), reverse=True)
        return out

    def _entry(self, name: str, files: dict[str, int]) -> Entry:
        size = sum(files.values())
        common = {"name": name, "step": step_of(name), "size": size, "files": len(files)}
        if MANIFEST_NAME not in files:
            live = LOCK_NAME in files and _lock_is_live(self.store, name, self.stale_after_s)
            return Entry(status="writing" if live else "incomplete", **common)  # type: ignore[arg-type]
        from .reader import open_checkpoint

        try:
            data = self.store.read(f"{name}/{MANIFEST_NAME}")
            manifest = parse_manifest(data)  # what every reader checks before it trusts a manifest
        except CheckpointError as exc:
            return Entry(status="invalid manifest", error=exc.to_dict(), **common)  # type: ignore[arg-type]
        created, error = None, None
        try:
            with open_checkpoint(self.child_url(name), self.storage_options) as ckpt:
                value = ckpt.read_context("provenance") if "provenance" in ckpt.fields else {}
            stamp = value.get("created_at")
            created = stamp if isinstance(stamp, str) else None
            step = value.get("step")
            if type(step) is int:
                common["step"] = step
        except CheckpointError as exc:
            error = exc.to_dict()  # committed, but its provenance could not be read
        return Entry(
            status="committed",
            checkpoint_id=checkpoint_id(data),
            profile=manifest.profile,
            created=created,
            error=error,
            **common,  # type: ignore[arg-type]
        )

    # ---------------------------------------------------------------- latest and pins

    def latest(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.store.read(LATEST_NAME))
        except (CheckpointError, ValueError):
            return None
        return value if isinstance(value, dict) and isinstance(value.get("name"), str) else None

    def set_latest(self, name: str, step: int, ckpt_id: str) -> None:
        """Point ``latest`` at a committed checkpoint; one atomic replace (rename locally, one PUT remotely)."""
        self._replace(LATEST_NAME, {"name": name, "step": step, "checkpoint_id": ckpt_id})

    def pinned(self) -> set[str]:
        try:
            value = json.loads(self.store.read(PINS_NAME))
        except (CheckpointError, ValueError):
            return set()
        pins = value.get("pinned") if isinstance(value, dict) else None
        return {p for p in pins if isinstance(p, str)} if isinstance(pins, list) else set()

    def set_pinned(self, names: Iterable[str]) -> None:
        self._replace(PINS_NAME, {"pinned": sorted(set(names))})

    def _replace(self, path: str, document: Mapping[str, object]) -> None:
        """Replace a small JSON file in one atomic step (rename locally, one PUT remotely), durably."""
        out = self.store.create(path)
        try:
            out.write(json.dumps(document, sort_keys=True).encode())
            out.commit()
        except BaseException:
            out.abort()
            raise
        self.store.sync_dirs([path])

    # ---------------------------------------------------------------- retention

    def plan_gc(
        self,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        protect: Iterable[str] = (),
        entries: list[Entry] | None = None,
    ) -> list[Entry]:
        """What retention deletes: committed checkpoints outside keep_last/keep_every/pins/latest, and the
        remains of dead writers. Never a checkpoint a live writer holds, one whose manifest is invalid,
        nor one in ``protect``. ``keep_last`` counts committed checkpoints from the highest step down."""
        entries = self.entries() if entries is None else entries
        keep = set(protect) | self.pinned()
        latest = self.latest()
        if latest:
            keep.add(latest["name"])
        committed = [e for e in entries if e.status == "committed"]
        if keep_last is not None:
            keep.update(e.name for e in committed[:keep_last])
        if keep_every:
            keep.update(e.name for e in committed if e.step is not None and e.step % keep_every == 0)
        doomed = []
        for entry in entries:
            # An unreadable manifest is not a crash's remains (the manifest is written last, checked): it is
            # corrupt or from a newer format version, and deleting it is an operator's call.
            if entry.name in keep or entry.status in ("writing", "invalid manifest"):
                continue
            if entry.status == "committed" and keep_last is None:
                continue  # no retention rule given: gc removes only the remains of dead writers
            doomed.append(entry)
        return doomed

    def delete(self, name: str) -> None:
        """Remove one checkpoint: the manifest first, so it is never seen committed with files missing."""
        files = [p for p in self.store.list() if p.startswith(name + "/")]
        manifest = f"{name}/{MANIFEST_NAME}"
        if manifest in files:
            self.store.delete(manifest)
        for path in files:
            if path != manifest:
                self.store.delete(path)
        for path, upload_id in self.store.pending_uploads():
            if path.startswith(name + "/"):
                self.store.abort_upload(path, upload_id)
        self.store.remove_empty_dirs()

    def gc(
        self,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        protect: Iterable[str] = (),
        dry_run: bool = False,
    ) -> list[Entry]:
        doomed = self.plan_gc(keep_last=keep_last, keep_every=keep_every, protect=protect)
        if not dry_run:
            for entry in doomed:
                self.delete(entry.name)
            # uploads a killed writer left in a checkpoint that is otherwise gone or committed
            live = {e.name for e in self.entries() if e.status == "writing"}
            for path, upload_id in self.store.pending_uploads():
                if path.partition("/")[0] not in live:
                    self.store.abort_upload(path, upload_id)
        return doomed

    def newest_committed(self) -> list[Entry]:
        return [e for e in self.entries() if e.status == "committed"]
