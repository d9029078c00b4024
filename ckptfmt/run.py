"""A run directory: checkpoints named by step, a ``latest`` pointer, pins, retention and garbage collection.

    run/step-000000100/manifest.json ...
    run/latest.json        {"name": "step-000000100", "step": 100, "checkpoint_id": "sha256:..."}
    run/pins.json          {"pinned": ["step-000000050"]}

The same rules serve the trainer's CheckpointManager, ``ckpt ls`` and ``ckpt gc``. A checkpoint may reference
chunks of a sibling, its base (spec/references.md): retention keeps every base of what it keeps, and of what a
live writer is saving (REF-13); deleting or replacing a referenced checkpoint is refused (REF-14).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import (
    CheckpointError,
    MissingFileError,
    ReferencedCheckpointError,
    StorageError,
    UnsafePathError,
)
from .jsonio import load_json
from .layout import CONTEXT_NAME, DATA_SUFFIX
from .lock import WriterLock, read_lock
from .manifest import MAX_MANIFEST_BYTES, Manifest, checkpoint_id
from .manifest_parse import parse_manifest
from .paths import LOCK_NAME, MANIFEST_NAME, is_segment
from .references import EXTENSION as REFERENCES
from .references import PARENT
from .retention import Entry as Entry  # (its old home: still importable here)
from .retention import RetentionPlan, Status, plan_retention, referrers_first
from .storage import Store, open_store

log = logging.getLogger(__name__)

LATEST_NAME = "latest.json"
PINS_NAME = "pins.json"
PLACEMENT_NAME = "replica-placement.json"  # the job's replica count and failure domains (tier/placement_record.py)
RESTORE_NAME = "last-restore.json"  # the newest restore's report (what each tier held, moved, cost)
MAX_POINTER_BYTES = 1 << 20  # latest.json and pins.json: a name, a step, an id; a list of names
_STEP = re.compile(r"(\d+)$")
# What a ckptfmt writer makes in a checkpoint root (spec/layout.md LAY-1, ckptfmt/layout.py), matched
# exactly: manifest.json, .writer-lock, <field>/r<RANK>-<SEQ>.safetensors, <field>/context.msgpack,
# <field>/context.r<RANK>.msgpack (a rank other than 0), and the temp names ".<name>.tmp-<12 hex>" both
# LocalStore and the fsspec rename path write them under.
_FIELD = r"[a-z][a-z0-9_]{0,63}"
_FINAL = re.compile(
    rf"{re.escape(MANIFEST_NAME)}|{re.escape(LOCK_NAME)}"
    rf"|{_FIELD}/(?:r\d{{5,}}-\d{{5,}}{re.escape(DATA_SUFFIX)}|{re.escape(CONTEXT_NAME)}|context\.r\d{{5,}}\.msgpack)"
)
_TEMP = re.compile(r"(?:(?P<dir>[^/]+)/)?\.(?P<name>[^/]+)\.tmp-[0-9a-f]{12}")
# A writer lock from another host is presumed live for this long: its holder's pid cannot be checked from here.
DEFAULT_STALE_AFTER_S = 24 * 3600


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def writer_made(path: str) -> bool:
    """Whether a ckptfmt writer makes a file at ``path`` (relative to a checkpoint root): a final name or
    the temp name of one. Only such files are garbage collection's to delete."""
    temp = _TEMP.fullmatch(path)
    if temp is not None:
        path = f"{temp['dir']}/{temp['name']}" if temp["dir"] else temp["name"]
    return _FINAL.fullmatch(path) is not None


def is_checkpoint_dir(files: Iterable[str]) -> bool:
    """Whether a child of a run directory is a checkpoint or the remains of one (paths relative to it).

    It is when it holds a file a ckptfmt writer makes, named exactly so (see :func:`writer_made`); any
    other directory (logs, say, or a user's ``context.msgpack.bak``) is not the run's to list or delete.
    """
    return any(writer_made(p) for p in files)


def step_of(name: str) -> int | None:
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def _lock_state(store: Store, prefix: str, stale_after_s: float) -> tuple[bool, WriterLock | None]:
    """Whether a writer may still be working on ``prefix``, and its lock (None: unreadable).

    As spec/commit.md: a lock is dead only when its holder is known to be gone (a pid of this host
    that no longer runs). A lock of another host counts as live until ``stale_after_s`` after its
    ``started_at``; a lock that cannot be read counts as live (an operator removes it), never as dead.
    """
    lock = read_lock(store, f"{prefix}/{LOCK_NAME}")
    if lock is None:
        return True, None
    if lock.holder_is_dead():
        return False, lock
    if lock.host == socket.gethostname():
        return True, lock
    age = lock.age_seconds()
    return age is None or age < stale_after_s, lock


def referenced_names(data: bytes) -> tuple[str, ...]:
    """The base names a manifest's ``ckptfmt.references`` extension lists, read leniently.

    Counting references must not depend on the manifest passing every check: one that a reader refuses (or
    only a newer reader understands) may still reference siblings, and keeping them costs only space.
    """
    try:
        doc = load_json(data, error=CheckpointError, what="manifest", allow_float=True)
    except CheckpointError:
        return ()
    extensions = doc.get("extensions") if isinstance(doc, dict) else None
    names: list[str] = []
    for ext in extensions if isinstance(extensions, list) else ():
        if not (isinstance(ext, dict) and ext.get("name") == REFERENCES):
            continue
        config = ext.get("configuration")
        bases = config.get("bases") if isinstance(config, dict) else None
        for base in bases if isinstance(bases, list) else ():
            location = base.get("location") if isinstance(base, dict) else None
            if isinstance(location, str) and location.startswith(PARENT) and is_segment(location[len(PARENT) :]):
                names.append(location[len(PARENT) :])
    return tuple(sorted(set(names)))


def _unreadable_lock(name: str) -> dict[str, str]:
    return CheckpointError(
        "its writer lock cannot be read: the checkpoints its writer references are unknown",
        path=f"{name}/{LOCK_NAME}",
    ).to_dict()


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
        # What a committed manifest yields (listed paths, and everything of its Entry but the listing's sizes),
        # by checkpoint name and id: a manager lists its run after every save, and parsing every manifest and
        # reading every provenance again made each save O(checkpoints).
        # Keyed by the id (the digest of the manifest's bytes), so a replaced manifest is parsed afresh.
        self._committed: dict[str, tuple[str, frozenset[str], dict[str, Any]]] = {}

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
        for gone in self._committed.keys() - {e.name for e in out}:
            del self._committed[gone]  # deleted since: a run of weeks lists thousands of names over its life
        out.sort(key=lambda e: (e.step if e.step is not None else -1, e.name), reverse=True)
        return out

    def _is_plain_file(self, path: str) -> bool:
        """A regular file, not a symlink or special file (object stores hold nothing else)."""
        if not self.store.capabilities.local:
            return True
        try:
            self.store.size(path)
        except MissingFileError:
            return True  # gone meanwhile: nothing to delete either way
        except UnsafePathError:
            return False
        return True

    def _entry(self, name: str, files: dict[str, int]) -> Entry:
        size = sum(files.values())
        common: dict[str, Any] = {"name": name, "step": step_of(name), "size": size, "files": len(files)}
        if MANIFEST_NAME not in files:
            foreign = tuple(sorted(p for p in files if not (writer_made(p) and self._is_plain_file(f"{name}/{p}"))))
            live, lock = _lock_state(self.store, name, self.stale_after_s) if LOCK_NAME in files else (False, None)
            status: Status = "writing" if live else "incomplete"
            error = _unreadable_lock(name) if live and lock is None else None
            bases = lock.bases if lock is not None else ()
            return Entry(status=status, foreign=foreign, error=error, bases=bases, **common)
        data = b""
        try:
            data = self.store.read(f"{name}/{MANIFEST_NAME}", max_size=MAX_MANIFEST_BYTES)
            ckpt_id = checkpoint_id(data)
            cached = self._committed.get(name)
            if cached is not None and cached[0] == ckpt_id:
                listed, known = cached[1], cached[2]
            else:
                manifest = parse_manifest(data)  # what every reader checks before it trusts a manifest
                listed = frozenset(f.path for f in manifest.files)
                known = self._committed_fields(name, manifest, ckpt_id)
                if known["error"] is None:
                    self._committed[name] = (ckpt_id, listed, known)
        except CheckpointError as exc:
            self._committed.pop(name, None)
            bases = referenced_names(data) if data else ()
            return Entry(status="invalid manifest", error=exc.to_dict(), bases=bases, **common)
        common["foreign"] = tuple(sorted(p for p in files if p not in listed and not writer_made(p)))
        if known.get("step") is not None:
            common["step"] = known["step"]
        return Entry(status="committed", **{k: v for k, v in known.items() if k != "step"}, **common)

    def _committed_fields(self, name: str, manifest: Manifest, ckpt_id: str) -> dict[str, Any]:
        """A committed checkpoint's Entry fields from its manifest and provenance (``step``: the provenance's,
        None to keep the name's)."""
        from .reader import open_checkpoint

        created, error, step = None, None, None
        try:
            with open_checkpoint(self.child_url(name), self.storage_options) as ckpt:
                value = ckpt.read_context("provenance") if "provenance" in ckpt.fields else {}
            stamp = value.get("created_at")
            created = stamp if isinstance(stamp, str) else None
            if type(value.get("step")) is int:
                step = value["step"]
        except CheckpointError as exc:
            error = exc.to_dict()  # committed, but its provenance could not be read
        return {
            "checkpoint_id": ckpt_id,
            "profile": manifest.profile,
            "created": created,
            "error": error,
            "bases": tuple(sorted(b.name for b in manifest.bases)),
            "referenced_bytes": manifest.referenced_bytes,
            "step": step,
        }

    # ---------------------------------------------------------------- latest and pins

    def _read_pointer(self, path: str, *, allow_float: bool = False) -> object:
        """A small JSON document of the run directory; None if absent, CheckpointError if unreadable."""
        try:
            data = self.store.read(path, max_size=MAX_POINTER_BYTES)
        except MissingFileError:
            return None
        return load_json(data, error=CheckpointError, what=path, path=path, allow_float=allow_float)

    def read_latest(self) -> dict[str, Any] | None:
        """The ``latest`` pointer, None if there is none; CheckpointError naming the file if it is unreadable
        (not JSON, wrong types, a symlink or special file, too large)."""
        value = self._read_pointer(LATEST_NAME)
        if value is None:
            return None
        name = value.get("name") if isinstance(value, dict) else None
        step = value.get("step") if isinstance(value, dict) else None
        ckpt_id = value.get("checkpoint_id") if isinstance(value, dict) else None
        if not (
            isinstance(name, str)
            and (step is None or type(step) is int)
            and (ckpt_id is None or isinstance(ckpt_id, str))
        ):
            raise CheckpointError(
                'must be {"name": string, "step": integer, "checkpoint_id": string}', path=LATEST_NAME
            )
        assert isinstance(value, dict)
        return value

    def latest(self) -> dict[str, Any] | None:
        """The ``latest`` pointer, or None when there is none or it cannot be read: it is a hint.

        Listing and restoring never depend on it (``entries`` and ``restore_latest`` look at the
        checkpoints themselves); gc keeps every committed checkpoint while it cannot be read.
        """
        try:
            return self.read_latest()
        except CheckpointError:
            return None

    def set_latest(self, name: str, step: int, ckpt_id: str) -> None:
        """Point ``latest`` at a committed checkpoint; one atomic replace (rename locally, one PUT remotely)."""
        self._replace(LATEST_NAME, {"name": name, "step": step, "checkpoint_id": ckpt_id})

    def pinned(self) -> set[str]:
        """The pinned checkpoints' names; CheckpointError naming ``pins.json`` if it exists but cannot be read."""
        value = self._read_pointer(PINS_NAME)
        if value is None:
            return set()
        pins = value.get("pinned") if isinstance(value, dict) else None
        if not (isinstance(pins, list) and all(isinstance(p, str) for p in pins)):
            raise CheckpointError('must be {"pinned": [checkpoint names]}', path=PINS_NAME)
        return set(pins)

    def retention_hold(self) -> str | None:
        """Why retention must delete no committed checkpoint now, or None: ``pins.json`` or ``latest.json``
        exists but cannot be read, so which checkpoints they protect is unknown."""
        problems = []
        for read in (self.pinned, self.read_latest):
            try:
                read()
            except CheckpointError as exc:
                problems.append(str(exc))
        if not problems:
            return None
        return "; ".join(problems) + " — committed checkpoints are kept until it is repaired"

    def record_restore(self, report: Mapping[str, object]) -> None:
        """Write the report of the restore just made (``last-restore.json``): a record, never read to restore."""
        self._replace(RESTORE_NAME, report)

    def last_restore(self) -> dict[str, Any] | None:
        """The newest restore's report, or None when there is none or it cannot be read."""
        try:
            value = self._read_pointer(RESTORE_NAME, allow_float=True)  # seconds
        except CheckpointError:
            return None
        return value if isinstance(value, dict) else None

    def record_placement(self, record: Mapping[str, object]) -> None:
        """Write the job's replica placement (``replica-placement.json``, :mod:`ckptfmt.tier.placement_record`): a
        record for ``ckpt ls``, never read to restore."""
        self._replace(PLACEMENT_NAME, record)

    def placement(self) -> object:
        """The recorded replica placement as parsed JSON, or None when there is none or it cannot be read."""
        try:
            return self._read_pointer(PLACEMENT_NAME)
        except CheckpointError:
            return None

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

    # ---------------------------------------------------------------- references

    def _reference_scan(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        """Who references whom now, read afresh and cheaply (no provenance, manifests read leniently): each
        committed checkpoint -> the bases its manifest lists; each live writer -> the bases its lock lists."""
        groups: dict[str, set[str]] = {}
        for path in self.store.list():
            head, sep, rest = path.partition("/")
            if sep and not head.startswith("."):
                groups.setdefault(head, set()).add(rest)
        committed: dict[str, tuple[str, ...]] = {}
        writers: dict[str, tuple[str, ...]] = {}
        for name, files in groups.items():
            if MANIFEST_NAME in files:
                try:
                    data = self.store.read(f"{name}/{MANIFEST_NAME}", max_size=MAX_MANIFEST_BYTES)
                except StorageError:
                    raise  # unknown is not "references nothing": never delete on a guess
                except CheckpointError:
                    continue  # gone meanwhile, or a file no reader would open (symlink, too large)
                committed[name] = referenced_names(data)
            if LOCK_NAME in files:  # (beside a manifest: a writer about to replace it)
                live, lock = _lock_state(self.store, name, self.stale_after_s)
                if live and lock is not None:
                    writers[name] = lock.bases
        return committed, writers

    def referrers(self, name: str) -> list[str]:
        """The committed checkpoints of the run directory that reference chunks stored in ``name``."""
        committed, _ = self._reference_scan()
        return sorted(c for c, bases in committed.items() if c != name and name in bases)

    def _users(self, name: str, scan: tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]) -> list[str]:
        """What needs ``name`` to stay, described: committed referrers and live writers naming it (REF-13)."""
        committed, writers = scan
        users = [f"{c} (committed)" for c, bases in sorted(committed.items()) if c != name and name in bases]
        users += [f"{w} (live writer)" for w, bases in sorted(writers.items()) if w != name and name in bases]
        return users

    def check_replaceable(self, name: str) -> None:
        """Refuse to replace the committed checkpoint ``name`` while a committed sibling or a live writer
        references it (REF-14): the replacement has another checkpoint id, so every reference to the old one
        would be refused (REF-7). No-op when nothing is committed there. Call it before un-committing ``name``."""
        if not self.store.exists(f"{name}/{MANIFEST_NAME}"):
            return
        users = self._users(name, self._reference_scan())
        if users:
            raise ReferencedCheckpointError(
                f"cannot replace {name}: {', '.join(users)} reference(s) it, and would no longer be restorable",
                path=self.child_url(name),
                requirement="REF-14",
            )

    # ---------------------------------------------------------------- retention

    def plan_retention(
        self,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        protect: Iterable[str] = (),
        entries: list[Entry] | None = None,
    ) -> RetentionPlan:
        """What retention deletes now (:func:`ckptfmt.retention.plan_retention`, with this directory's
        listing, pins, ``latest`` pointer and hold)."""
        latest = self.latest()
        pointers_hold = self.retention_hold()
        return plan_retention(
            self.entries() if entries is None else entries,
            keep_last=keep_last,
            keep_every=keep_every,
            protect=protect,
            pinned=self.pinned() if pointers_hold is None else (),
            latest=latest["name"] if latest else None,
            pointers_hold=pointers_hold,
        )

    def plan_gc(
        self,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        protect: Iterable[str] = (),
        entries: list[Entry] | None = None,
    ) -> list[Entry]:
        """The entries :meth:`plan_retention` dooms."""
        plan = self.plan_retention(keep_last=keep_last, keep_every=keep_every, protect=protect, entries=entries)
        return list(plan.doomed)

    def delete(self, name: str, *, force: bool = False) -> list[str]:
        """Remove one checkpoint, file by file, and the directories so emptied; returns what was left.

        Refused (ReferencedCheckpointError naming them, REF-13) while ``name`` is committed and a committed sibling or a
        live writer references it, unless ``force``: deleting it would leave them unrestorable.

        Only files a ckptfmt writer made are deleted: those the manifest lists and those named exactly as
        a writer names them (:func:`writer_made`), regular files only. The manifest goes first, so the
        checkpoint is never seen committed with files missing; the writer lock last. Anything else (a
        user's file, a symlink, a special file) is left where it is, with the directories holding it.
        """
        prefix = name + "/"
        files = [p[len(prefix) :] for p in self.store.list() if p.startswith(prefix)]
        if not force and MANIFEST_NAME in files:
            users = self._users(name, self._reference_scan())
            if users:
                raise ReferencedCheckpointError(
                    f"{name} is referenced by {', '.join(users)}: deleting it would leave them unrestorable "
                    "(delete those first, or force it)",
                    path=self.child_url(name),
                    requirement="REF-13",
                )
        listed: set[str] = set()
        if MANIFEST_NAME in files:
            try:
                data = self.store.read(prefix + MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES)
                listed = {f.path for f in parse_manifest(data).files}
            except CheckpointError:
                listed = set()  # only names the writer uses are then ours to delete
        ours = [p for p in files if (p in listed or writer_made(p)) and self._is_plain_file(prefix + p)]
        order = {MANIFEST_NAME: 0, LOCK_NAME: 2}
        for path in sorted(ours, key=lambda p: order.get(p, 1)):
            self.store.delete(prefix + path)
            if path == MANIFEST_NAME:
                # Durably un-committed before any data file goes: else a crash could keep the manifest and
                # lose files it lists, leaving a checkpoint that opens and does not verify.
                self.store.sync_dirs([prefix + MANIFEST_NAME])
        for path, upload_id in self.store.pending_uploads():
            if path.startswith(prefix):
                self.store.abort_upload(path, upload_id)
        self.store.remove_empty_dirs(name)
        left = sorted(set(files) - set(ours))
        if left:
            log.warning("%s: left %d file(s) no ckptfmt writer made: %s", name, len(left), ", ".join(left[:5]))
        return left

    def gc(
        self,
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        protect: Iterable[str] = (),
        dry_run: bool = False,
    ) -> list[Entry]:
        """Delete what :meth:`plan_retention` dooms (:meth:`collect`); returns the deleted entries (with
        ``dry_run``, the doomed ones, nothing deleted)."""
        plan = self.plan_retention(keep_last=keep_last, keep_every=keep_every, protect=protect)
        return list(plan.doomed) if dry_run else self.collect(plan)

    def collect(self, plan: RetentionPlan) -> list[Entry]:
        """Delete what ``plan`` dooms, each checkpoint before the ones it references; returns the deleted
        entries, each with ``foreign`` set to the files its deletion left in place (not a writer's, a symlink
        or a special file).

        Who references whom is read again first: a doomed committed checkpoint that a checkpoint committed
        since the plan, or a writer started since, references is kept (and logged), not deleted.
        """
        needs_scan = any(e.status == "committed" for e in plan.doomed)
        committed, writers = self._reference_scan() if needs_scan else ({}, {})
        deleted: dict[str, Entry] = {}
        for entry in referrers_first(plan.doomed):
            if entry.status == "committed":
                users = self._users(entry.name, (committed, writers))
                if users:
                    log.warning("%s: kept, referenced by %s", entry.name, ", ".join(users))
                    continue
            left = self.delete(entry.name, force=True)
            committed.pop(entry.name, None)
            deleted[entry.name] = dataclasses.replace(entry, foreign=tuple(left))
        # uploads a killed writer left in a checkpoint that is otherwise gone or committed (object stores only:
        # the listing of writers reads every manifest, which a local run directory need not pay after each save)
        uploads = self.store.pending_uploads()
        live = {e.name for e in self.entries() if e.status == "writing"} if uploads else set()
        for path, upload_id in uploads:
            if path.partition("/")[0] not in live:
                self.store.abort_upload(path, upload_id)
        return [deleted[e.name] for e in plan.doomed if e.name in deleted]


def check_replaceable_url(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
    """:meth:`RunDirectory.check_replaceable` for the checkpoint at ``url``, in the directory that holds it."""
    text = os.fspath(url).rstrip("/")
    if "://" not in text:
        text = os.path.abspath(text)
    parent, _, name = text.rpartition("/")
    if parent and not parent.endswith(":/"):
        RunDirectory(parent, storage_options).check_replaceable(name)
