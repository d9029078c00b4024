"""Persisting a memory snapshot: a copy of its bytes into the run directory, every file's digest checked.

The copy is the checkpoint itself, not a re-encoding: the same files, byte for byte, and the same
manifest, so the durable checkpoint has the snapshot's checkpoint id. Each file is streamed in
``PIECE_BYTES`` pieces, hashed as it goes and compared with the manifest's size and digest before it is
published; the manifest is written last, create-only, by the same commit protocol as every save
(:class:`~ckptfmt.commit.Committer`, spec/commit.md). A slot that changed or rotted since it was
committed fails its digest check and is not persisted.

A persist re-encoded with a codec (``persist(..., codec=)``) or re-written on a base
(:mod:`.persist_incremental`, ``incremental=True``) is a checkpoint of its own instead, whose provenance names
the snapshot (:func:`rewritten_status`, MEM-7).

A persist runs beside training, so it is throttled (:class:`Throttle`): a share of wall time, and a
lower scheduling priority for the thread that does it.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..collective import Collective
from ..collective_commit import CollectiveCommit
from ..commit import Committer
from ..decide import decide
from ..digests import algorithm_of, format_digest
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CollectiveError,
    DigestMismatchError,
    MalformedMessageError,
    MissingFileError,
    SizeMismatchError,
    UnsafePathError,
    UsageError,
)
from ..manifest import Manifest, checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..manifest_parse import parse_manifest
from ..paths import MANIFEST_NAME, MAX_PATH_BYTES
from ..reader import open_checkpoint
from ..run import RunDirectory, checkpoint_name
from ..storage import Store, open_store
from ..tree_digests import file_hasher
from .binding import SlotBinding

log = logging.getLogger("ckptfmt")

READ_BYTES = 8 << 20  # one read request of the slot at a time
PIECE_BYTES = 1 << 20  # hashed and written while in cache (as executor.SLICE_BYTES)
PersistStatus = Literal["persisted", "already durable", "conflict"]
MAX_STATUS_BYTES = 64 << 10  # a rank's checkpoint id and status in a spread persist (plus its list of files)


class Throttle:
    """Keeps a background copy to ``duty`` of wall time: after each piece that took ``t`` seconds it sleeps
    ``t * (1 - duty) / duty``. ``duty=1`` never sleeps."""

    def __init__(self, duty: float = 1.0) -> None:
        if not 0 < duty <= 1:
            raise UsageError(f"a persist duty must be in (0, 1], got {duty}")
        self.duty = duty
        self.slept = 0.0

    def after(self, seconds: float) -> None:
        if self.duty < 1 and seconds > 0:
            pause = seconds * (1 - self.duty) / self.duty
            time.sleep(pause)
            self.slept += pause


def lower_thread_priority(nice: int = 10) -> None:
    """Give the calling thread a lower CPU priority (Linux: a thread is a task with its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass  # elsewhere, or not permitted: the duty cycle still bounds it


@dataclass(frozen=True, slots=True, kw_only=True)
class Persisted:
    """What :func:`persist` did."""

    source: str
    destination: str
    name: str
    step: int
    checkpoint_id: str
    status: PersistStatus
    bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "destination": self.destination,
            "name": self.name,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "status": self.status,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
        }


def _copy_file(src: Store, dst: Store, path: str, size: int, digest: str, throttle: Throttle) -> None:
    """Stream one file, checking its size and digest before it is published under its name."""
    hasher = file_hasher(algorithm_of(digest))
    buffer = bytearray(min(READ_BYTES, max(size, 1)))
    out = dst.create(path)
    try:
        position = 0
        while position < size:
            start = time.perf_counter()
            view = memoryview(buffer)[: min(len(buffer), size - position)]
            src.read_into(path, position, view)  # one request (locally: one open) per READ_BYTES
            for lo in range(0, len(view), PIECE_BYTES):
                piece = view[lo : lo + PIECE_BYTES]
                hasher.update(piece)
                out.write(piece)
            position += len(view)
            throttle.after(time.perf_counter() - start)
        actual = src.size(path)
        if actual != size:
            raise SizeMismatchError(f"is {actual} bytes, the manifest says {size}", path=path)
        if format_digest(algorithm_of(digest), hasher) != digest:
            raise DigestMismatchError("changed since its snapshot was committed: digest differs", path=path)
        out.commit()
    except BaseException:
        out.abort()
        raise


def persist(
    source: str | os.PathLike[str] | Store,
    run: RunDirectory,
    *,
    step: int | None = None,
    throttle: Throttle | None = None,
    update_latest: bool = True,
    codec: str | None = None,
) -> Persisted:
    """Copy the committed checkpoint at ``source`` into ``run`` as ``step-<step>`` (default: the step of its
    memory binding). Already there with the same id: nothing to do. Another checkpoint there: ``conflict``,
    left alone. ``update_latest`` points ``latest.json`` at it when it is the run's newest step.

    ``codec`` (``"zstd"``, ``"zstd:LEVEL"``): the durable copy is re-encoded with it instead (memory snapshots
    stay raw: encoding every step would cost the trainer's CPU); its checkpoint id is then its own, and its
    provenance's ``converted_from`` names the snapshot.

    ``source``: a path, or a store already open (an overlay of a slot and peer copies: ``ckpt rescue``).
    """
    if codec is not None and codec != "raw":
        if isinstance(source, Store):
            raise UsageError("a persist re-encoded with a codec reads its source by path, not from an open store")
        return _persist_encoded(source, run, step=step, codec=codec, update_latest=update_latest)
    throttle = throttle or Throttle()
    started = time.perf_counter()
    src, manifest, ckpt_id, step, name = snapshot_source(source, step, run)
    dst = open_store(run.child_url(name), run.storage_options)

    def outcome(status: PersistStatus, nbytes: int = 0) -> Persisted:
        return persisted_since(started, src, dst.url, name, step, ckpt_id, status, nbytes)

    committer = claim_destination(dst, ckpt_id)
    if not isinstance(committer, Committer):
        return outcome(committer)
    written: list[str] = []
    try:
        for record in manifest.files:
            _copy_file(src, dst, record.path, record.size, record.digest, throttle)
            written.append(record.path)
        committed = committer.commit(manifest, written)
    except BaseException:
        committer.abort(written)
        raise
    if committed != ckpt_id:  # the manifest is written as parsed: a writer that is not canonical shows here
        log.warning("%s: persisted with checkpoint id %s (the snapshot's is %s)", dst.url, committed, ckpt_id)
    if update_latest:
        advance_latest(run, name, step, committed)
    return outcome("persisted", sum(f.size for f in manifest.files))


def _refuse_special_child(run: RunDirectory, name: str) -> None:
    """UnsafePathError when the run directory's ``name`` is a symlink or not a directory: a persist writes the
    checkpoint the run directory names, never through a link planted there to somewhere else."""
    if not run.store.capabilities.local:
        return  # object stores hold no links
    path = os.path.join(run.store.url, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafePathError(f"cannot be examined: {exc}", path=path) from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("is a symlink or not a directory: not persisted into", path=path)


def snapshot_source(
    source: str | os.PathLike[str] | Store, step: int | None, run: RunDirectory
) -> tuple[Store, Manifest, str, int, str]:
    """The snapshot to persist: its store, manifest, checkpoint id, step (default: its binding's) and the name
    of its durable copy, which must not be a symlink or special file in ``run``."""
    src = source if isinstance(source, Store) else open_store(source)
    data = read_manifest_bytes(src)
    manifest = parse_manifest(data)
    if step is None:
        step = SlotBinding.from_metadata(manifest.metadata).step
    name = checkpoint_name(step)
    _refuse_special_child(run, name)
    return src, manifest, checkpoint_id(data), step, name


def existing_id(store: Store) -> str | None:
    try:
        if not store.exists(MANIFEST_NAME):
            return None
        return checkpoint_id(read_manifest_bytes(store))
    except CheckpointError:
        return None


def persisted_since(
    started: float,
    src: Store,
    destination: str,
    name: str,
    step: int,
    ckpt_id: str,
    status: PersistStatus,
    nbytes: int = 0,
) -> Persisted:
    """What a persist of ``src`` into ``destination`` did, its seconds counted from ``started`` (a
    ``time.perf_counter()`` reading)."""
    return Persisted(
        source=src.url,
        destination=destination,
        name=name,
        step=step,
        checkpoint_id=ckpt_id,
        status=status,
        bytes=nbytes,
        seconds=time.perf_counter() - started,
    )


def claim_destination(dst: Store, ckpt_id: str) -> Committer | PersistStatus:
    """The committer of a copy of checkpoint ``ckpt_id`` into ``dst``; or, when a checkpoint is committed there
    (or being written by another process since the look), ``already durable`` if it is that one, else ``conflict``."""
    existing = existing_id(dst)
    if existing is None:
        try:
            return Committer(dst)
        except CheckpointExistsError:  # committed (or being written) by another process since the look above
            existing = existing_id(dst)
    return "already durable" if existing == ckpt_id else "conflict"


def advance_latest(run: RunDirectory, name: str, step: int, ckpt_id: str) -> None:
    """Point ``latest`` here unless it already names a newer step (a rescue of an older slot must not move it back)."""
    current = run.latest()
    current_step = current.get("step") if current else None
    if isinstance(current_step, int) and current_step > step:
        return
    run.set_latest(name, step, ckpt_id)


def rewritten_status(destination: str, run: RunDirectory, snapshot_id: str) -> tuple[PersistStatus, str] | None:
    """What a persist that re-writes the snapshot (a codec, references) finds at ``destination``: None when nothing
    is committed there; ``already durable`` when the checkpoint there is the snapshot or was re-written from it (its
    provenance's ``converted_from`` names the snapshot's id), else ``conflict``; with the id of what is there."""
    existing = existing_id(open_store(destination, run.storage_options))
    if existing is None:
        return None
    with open_checkpoint(destination, run.storage_options) as ckpt:
        origin = ckpt.read_context("provenance").get("converted_from") if "provenance" in ckpt.fields else None
    same = isinstance(origin, dict) and origin.get("checkpoint_id") == snapshot_id
    return ("already durable" if same or existing == snapshot_id else "conflict"), existing


def _persist_encoded(
    source: str | os.PathLike[str], run: RunDirectory, *, step: int | None, codec: str, update_latest: bool
) -> Persisted:
    from ..convert.native import reencode

    started = time.perf_counter()
    src, manifest, snapshot_id, step, name = snapshot_source(source, step, run)
    destination = run.child_url(name)
    status: PersistStatus = "persisted"
    nbytes = 0
    ckpt_id = snapshot_id
    found = rewritten_status(destination, run, snapshot_id)
    if found is not None:
        status, ckpt_id = found
    else:
        try:
            result = reencode(str(source), destination, storage_options=run.storage_options, codec=codec)
        except CheckpointExistsError:
            return _persist_encoded(source, run, step=step, codec=codec, update_latest=update_latest)
        ckpt_id = result.checkpoint_id or snapshot_id
        nbytes = sum(f.size for f in manifest.files)
        if update_latest:
            advance_latest(run, name, step, ckpt_id)
    return persisted_since(started, src, destination, name, step, ckpt_id, status, nbytes)


def persist_spread(
    source: str | os.PathLike[str],
    run: RunDirectory,
    *,
    collective: Collective,
    files: Sequence[str],
    throttle: Throttle | None = None,
) -> Persisted:
    """Persist a snapshot whose files are spread over several nodes' slots (a collective call of every rank).

    Each rank copies the files it wrote from its node's slot at ``source`` (each file's size and digest checked,
    as :func:`persist` does); the coordinator, which holds the destination's lock meanwhile, checks that every file
    the manifest lists arrived at its size and writes the snapshot's manifest last
    (:class:`~ckptfmt.collective_commit.CollectiveCommit`). The checkpoint id is the snapshot's, which every rank's
    slot must hold. Every rank returns the same outcome or raises the same error (:func:`~ckptfmt.decide.decide`:
    a rank that fails, or reports something malformed, is named at once).
    """
    throttle = throttle or Throttle()
    started = time.perf_counter()
    what = f"the persist of {os.fspath(source)}"
    commit: CollectiveCommit | None = None
    mine: object
    try:
        src, manifest, ckpt_id, step, name = snapshot_source(source, None, run)
        what = f"the persist of step {step}"
        dst = open_store(run.child_url(name), run.storage_options)
        status: PersistStatus | None = None
        committer: Committer | None = None
        if collective.rank == 0:
            claimed = claim_destination(dst, ckpt_id)
            if isinstance(claimed, Committer):
                committer = claimed
            else:
                status = claimed
        # a list of paths: at most as many as the manifest lists, each at most 1 KiB plus its quotes and comma
        commit = CollectiveCommit(
            dst,
            collective,
            committer,
            plan=lambda reports, _: (manifest, _copied(reports, dst, manifest, what)),
            what=what,
            max_size=MAX_STATUS_BYTES + len(manifest.files) * (MAX_PATH_BYTES + 3),
            after=lambda: advance_latest(run, name, step, ckpt_id),
        )
        mine = {"checkpoint_id": ckpt_id, "status": status}
    except CheckpointError as exc:
        mine = exc

    def outcome(status: PersistStatus, nbytes: int = 0) -> Persisted:
        return persisted_since(started, src, dst.url, name, step, ckpt_id, status, nbytes)

    everything = [f.path for f in manifest.files] if commit is not None else []
    try:
        found = decide(collective, mine, lambda v: _agreed_status(v, what), what=what, max_size=MAX_STATUS_BYTES)
        if found == "already durable" or found == "conflict":
            return outcome(found)
        if found is not None or commit is None:
            raise MalformedMessageError(f"{what}: rank 0 broadcast a malformed status")
        records = {f.path: f for f in manifest.files}
        written: list[str] = []
        copied: object
        try:
            for path in files:
                record = records.get(path)
                if record is None:
                    raise MissingFileError("this rank wrote a file the snapshot's manifest does not list", path=path)
                _copy_file(src, dst, path, record.size, record.digest, throttle)
                written.append(path)
            copied = written
        except CheckpointError as exc:
            copied = exc
        # what every rank may have copied is the coordinator's to delete if the persist fails: none counts
        commit.commit(copied, written=everything)
    finally:
        if commit is not None:
            commit.release(everything)  # the lock and every copy, unless committed (a failed first round)
    return outcome("persisted", sum(f.size for f in manifest.files))


def _copied(reports: Sequence[Any], dst: Store, manifest: Manifest, what: str) -> list[str]:
    """Rank 0: every rank's list of the files it copied, once every file of the snapshot is there at its size."""
    every: list[str] = []
    for rank, report in enumerate(reports):
        if not isinstance(report, list) or not all(isinstance(p, str) for p in report):
            raise MalformedMessageError(f"{what}: rank {rank} sent a malformed list of the files it copied")
        every += report
    present = dst.list()
    lacking = [f.path for f in manifest.files if present.get(f.path) != f.size]
    if lacking:
        raise MissingFileError(f"{what}: {len(lacking)} file(s) of the snapshot were not copied", path=lacking[0])
    return every


def _agreed_status(values: Sequence[Any], what: str) -> str | None:
    """Rank 0: what every rank of a spread persist does, once each found the snapshot: nothing (``already
    durable``, ``conflict``) or copy (None). Every rank's slot must hold the same checkpoint."""
    ids: list[str] = []
    for rank, value in enumerate(values):
        if not isinstance(value, dict) or not isinstance(value.get("checkpoint_id"), str):
            raise MalformedMessageError(f"{what}: rank {rank} sent a malformed status")
        ids.append(value["checkpoint_id"])
    status = values[0].get("status")
    if status not in (None, "already durable", "conflict"):
        raise MalformedMessageError(f"{what}: rank 0 sent a status {str(status)[:40]!r}")
    for rank, ckpt_id in enumerate(ids):
        if ckpt_id != ids[0]:
            raise CollectiveError(f"{what}: rank {rank}'s slot holds checkpoint {ckpt_id}, rank 0's {ids[0]}")
    return status if isinstance(status, str) else None
