"""Files of a committed checkpoint moved between two ranks, every byte checked (spec/memory.md, MEM-10).

What travels is ckptfmt's own records and bytes, never a pickle: a header (canonical JSON: the checkpoint id
and the paths sent, with the manifest's bytes beside it), then each file in pieces of at most
``PIECE_BYTES``, each piece prefixed with a status byte and the XXH3-64 of its payload. The receiver trusts
nothing the header says that the manifest does not: the manifest must hash to the announced checkpoint id
and parse as any manifest does; each path must be a file the manifest lists, and its size and digest are the
manifest's. A file is published (under its name, in the destination store) only when all of its pieces
arrived, each piece's hash and then the whole file's digest matched; a copy directory's manifest is written
last, so a transfer cut half way leaves nothing that looks usable (a directory without a manifest).

Both sides always run a transfer to its end (a receiver that finds a bad piece reads and drops the rest), so
the next transfer between the two finds the channel in step.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from ..collective import PeerChannel
from ..digests import algorithm_of, format_digest, new_hasher
from ..errors import CheckpointError, CollectiveError, DigestMismatchError
from ..jsonio import load_json
from ..manifest import MAX_MANIFEST_BYTES, FileRecord, Manifest, checkpoint_id
from ..manifest_parse import parse_manifest
from ..paths import MANIFEST_NAME, check_path
from ..storage import Store

PIECE_BYTES = 8 << 20


class ReplicaDropped(CollectiveError):
    """A replica round gave up because its snapshot's slot was rewritten by a newer snapshot (the partner lags):
    raised by the sender's ``still_valid``, and by the receiver when the sender aborts for that reason."""

    code = "replica_dropped"


# a piece's status: its bytes follow; the sender could not read the file; the sender's source is being rewritten
# (``still_valid``), so the receiver raises ReplicaDropped: an abort's message follows
_OK, _ABORT, _DROPPED = 0, 1, 2
_PIECE_HEAD = struct.Struct("<BQ")  # status, xxh3-64 of the payload


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """What a receiver got: the checkpoint, and the files it published (each verified)."""

    checkpoint_id: str
    manifest_bytes: bytes
    files: tuple[FileRecord, ...]
    nbytes: int


def send_files(
    channel: PeerChannel,
    *,
    dst: int,
    tag: int,
    source: Store,
    manifest_bytes: bytes,
    paths: Sequence[str],
    throttle: Callable[[float], None] | None = None,
    still_valid: Callable[[], CheckpointError | None] | None = None,
) -> int:
    """Send ``paths`` of the checkpoint at ``source`` to ``dst``; returns the bytes sent. A file that cannot be read
    aborts the transfer (the receiver is told, and publishes nothing more); the error is raised here.
    ``still_valid``, asked before each file, returns why the source may no longer be read (it is being
    rewritten), which aborts the transfer the same way."""
    import time

    manifest = parse_manifest(manifest_bytes)
    records = {f.path: f for f in manifest.files}
    header = {"checkpoint_id": checkpoint_id(manifest_bytes), "paths": list(paths)}
    channel.send(json.dumps(header, sort_keys=True).encode("utf-8"), dst=dst, tag=tag)
    channel.send(manifest_bytes, dst=dst, tag=tag)
    sent = 0
    buffer = bytearray(PIECE_BYTES)
    for path in paths:
        gone = still_valid() if still_valid is not None else None
        if gone is not None:
            channel.send(_PIECE_HEAD.pack(_DROPPED, 0) + str(gone).encode("utf-8")[:4096], dst=dst, tag=tag)
            raise gone
        size = records[path].size
        position = 0
        while position < size or (size == 0 and position == 0):
            start = time.perf_counter()
            view = memoryview(buffer)[: min(PIECE_BYTES, size - position)]
            try:
                if len(view):
                    source.read_into(path, position, view)
            except CheckpointError as exc:
                channel.send(_PIECE_HEAD.pack(_ABORT, 0) + str(exc).encode("utf-8")[:4096], dst=dst, tag=tag)
                raise
            channel.send(_PIECE_HEAD.pack(_OK, xxhash.xxh3_64_intdigest(view)) + bytes(view), dst=dst, tag=tag)
            position += len(view)
            sent += len(view)
            if throttle is not None:
                throttle(time.perf_counter() - start)
            if size == 0:
                break
    return sent


def receive_files(channel: PeerChannel, *, src: int, tag: int, destination: Store) -> Received:
    """Receive one transfer from ``src`` into ``destination`` (files only: the caller commits a manifest when it
    wants the copy to count). Raises an :class:`~ckptfmt.errors.IntegrityError` or
    :class:`~ckptfmt.errors.CollectiveError` naming the file when anything does not check out; what was
    published before stays (each published file was verified whole), what was not is discarded."""
    header = load_json(channel.recv(src=src, tag=tag), error=CollectiveError, what=f"a transfer header from rank {src}")
    manifest_bytes = channel.recv(src=src, tag=tag)
    if not isinstance(header, dict) or not isinstance(header.get("paths"), list):
        raise CollectiveError(f"rank {src} sent a malformed transfer header")
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CollectiveError(f"rank {src} sent a manifest of {len(manifest_bytes)} bytes")
    announced = str(header.get("checkpoint_id"))
    manifest = _checked_manifest(manifest_bytes, announced, src)
    records = {f.path: f for f in manifest.files}
    wanted: list[FileRecord] = []
    for raw in header["paths"]:
        path = str(raw)
        record = records.get(path) if path != MANIFEST_NAME else None
        if record is None:
            # a header that names a file its manifest does not list: nothing is received (the sizes of what follows
            # are unknown); the sender's side fails on its own (its group's timeout)
            raise CollectiveError(f"rank {src} sent a file its manifest does not list", path=path)
        try:
            check_path(path)
        except CheckpointError as exc:
            raise CollectiveError(f"rank {src} sent an unsafe path: {exc}", path=path) from exc
        wanted.append(record)
    failure: CheckpointError | None = None
    published: list[FileRecord] = []
    nbytes = 0
    for record in wanted:
        got, failure = _receive_file(channel, src, tag, record, destination, failure)
        if got:
            published.append(record)
            nbytes += record.size
    if failure is not None:
        raise failure
    return Received(checkpoint_id=announced, manifest_bytes=manifest_bytes, files=tuple(published), nbytes=nbytes)


def _checked_manifest(data: bytes, announced: str, src: int) -> Manifest:
    if checkpoint_id(data) != announced:
        raise DigestMismatchError(
            f"rank {src} announced checkpoint {announced}, its manifest hashes to {checkpoint_id(data)}",
            path=MANIFEST_NAME,
        )
    return parse_manifest(data)


def _receive_file(
    channel: PeerChannel,
    src: int,
    tag: int,
    record: FileRecord,
    destination: Store,
    failure: CheckpointError | None,
) -> tuple[bool, CheckpointError | None]:
    """One file's pieces; published only when whole and verified. Returns (published, first failure)."""
    hasher = new_hasher(algorithm_of(record.digest))
    out = destination.create(record.path) if failure is None else None
    position = 0
    try:
        while position < record.size or (record.size == 0 and position == 0):
            message = channel.recv(src=src, tag=tag)
            if len(message) < _PIECE_HEAD.size:
                raise CollectiveError(f"rank {src} sent a truncated piece", path=record.path)
            status, expected = _PIECE_HEAD.unpack_from(message)
            payload = memoryview(message)[_PIECE_HEAD.size :]
            if status in (_ABORT, _DROPPED):
                raise (ReplicaDropped if status == _DROPPED else CollectiveError)(
                    f"rank {src} could not send it: {bytes(payload).decode('utf-8', 'replace')}", path=record.path
                )
            if len(payload) > record.size - position:
                raise CollectiveError(f"rank {src} sent more bytes than the manifest lists", path=record.path)
            if out is not None and failure is None:
                if xxhash.xxh3_64_intdigest(payload) != expected:
                    failure = DigestMismatchError(
                        f"a piece at byte {position} from rank {src} arrived damaged", path=record.path
                    )
                else:
                    hasher.update(payload)
                    out.write(payload)
            position += len(payload)
            if record.size == 0:
                break
        if out is None or failure is not None:
            return False, failure
        if format_digest(algorithm_of(record.digest), hasher) != record.digest:
            return False, DigestMismatchError(
                f"the copy from rank {src} does not match its manifest digest", path=record.path
            )
        out.commit()
        out = None
        return True, None
    finally:
        if out is not None:
            out.abort()
