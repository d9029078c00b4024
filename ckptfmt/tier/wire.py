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

Every message is hostile input, bounded before the receiver allocates anything for it (the channel refuses a longer
announced length, naming the sender): the header at :func:`header_bound` (64 KiB, plus 4 KiB for each path the
receiver may be sent, at most 64 MiB), the manifest at ``MAX_MANIFEST_BYTES``, a piece at ``PIECE_BYTES`` plus its
9-byte head. A refused message leaves the channel out of step on that tag: the sender's side fails on its own.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from ..collective import PeerChannel
from ..digests import algorithm_of, format_digest
from ..errors import (
    CheckpointError,
    CollectiveError,
    DigestMismatchError,
    MalformedMessageError,
    MessageTooLargeError,
)
from ..jsonio import load_json
from ..manifest import MAX_MANIFEST_BYTES, FileRecord, Manifest, checkpoint_id
from ..manifest_parse import parse_manifest
from ..paths import MANIFEST_NAME, check_path
from ..storage import Store
from ..tree_digests import file_hasher

PIECE_BYTES = 8 << 20
# A header is the checkpoint id and the paths sent, in JSON. A path is at most MAX_PATH_BYTES (1 KiB) of the
# characters paths.md allows, which JSON does not escape: 4 KiB each leaves room to spare. The cap is what a receiver
# that does not know how many paths to expect accepts: 16K paths at 4 KiB, about a million of 60 bytes.
HEADER_BYTES = 64 << 10
HEADER_BYTES_PER_PATH = 4 << 10
MAX_HEADER_BYTES = 64 << 20
ABORT_TEXT_BYTES = 4096  # the sender's reason, after the head of an aborting piece


def header_bound(paths: int | None = None) -> int:
    """The most bytes a header naming at most ``paths`` paths may take (None: as many as the cap allows); also the
    bound of a list of that many paths sent on its own (a replica's have-list)."""
    if paths is None:
        return MAX_HEADER_BYTES
    return min(HEADER_BYTES + HEADER_BYTES_PER_PATH * max(paths, 0), MAX_HEADER_BYTES)


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
            channel.send(_PIECE_HEAD.pack(_DROPPED, 0) + str(gone).encode("utf-8")[:ABORT_TEXT_BYTES], dst=dst, tag=tag)
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
                channel.send(
                    _PIECE_HEAD.pack(_ABORT, 0) + str(exc).encode("utf-8")[:ABORT_TEXT_BYTES], dst=dst, tag=tag
                )
                raise
            head = _PIECE_HEAD.pack(_OK, xxhash.xxh3_64_intdigest(view))
            send_parts = getattr(channel, "send_parts", None)
            if send_parts is not None:  # a stream: the piece's two parts are written as they are, not joined first
                send_parts((head, view), dst=dst, tag=tag)
            else:
                channel.send(head + bytes(view), dst=dst, tag=tag)
            position += len(view)
            sent += len(view)
            if throttle is not None:
                throttle(time.perf_counter() - start)
            if size == 0:
                break
    return sent


def receive_files(
    channel: PeerChannel,
    *,
    src: int,
    tag: int,
    destination: Store,
    max_paths: int | None = None,
    expect_id: str | None = None,
) -> Received:
    """Receive one transfer from ``src`` into ``destination`` (files only: the caller commits a manifest when it
    wants the copy to count). Raises an :class:`~ckptfmt.errors.IntegrityError` or
    :class:`~ckptfmt.errors.CollectiveError` naming the file when anything does not check out; what was
    published before stays (each published file was verified whole), what was not is discarded.

    ``max_paths``: the most files the receiver expects (the header is bounded by :func:`header_bound` of it, and
    refused when it names more); None when it does not know. A message longer than its bound is refused before
    it is received (:class:`~ckptfmt.errors.MessageTooLargeError` naming ``src``).

    ``expect_id``: the checkpoint the receiver asked for; a manifest of another one (hashing to what its sender
    announced, but not to this) is refused: its files are read and dropped, nothing is published."""
    header = load_json(
        receive_bounded(channel, src, tag, header_bound(max_paths), "a transfer header"),
        error=MalformedMessageError,
        what=f"a transfer header from rank {src}",
    )
    manifest_bytes = receive_bounded(channel, src, tag, MAX_MANIFEST_BYTES, "a manifest")
    paths = header.get("paths") if isinstance(header, dict) else None
    announced = header.get("checkpoint_id") if isinstance(header, dict) else None
    if not isinstance(paths, list) or not isinstance(announced, str) or not all(isinstance(p, str) for p in paths):
        raise MalformedMessageError(f"rank {src} sent a malformed transfer header")
    if max_paths is not None and len(paths) > max_paths:
        raise MalformedMessageError(f"rank {src} announced {len(paths)} files; at most {max_paths} are expected")
    manifest = _checked_manifest(manifest_bytes, announced, src)
    records = {f.path: f for f in manifest.files}
    wanted: list[FileRecord] = []
    for path in paths:
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
    if expect_id is not None and announced != expect_id:
        failure = DigestMismatchError(f"rank {src} sent checkpoint {announced}, not {expect_id}", path=MANIFEST_NAME)
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


def receive_bounded(
    channel: PeerChannel, src: int, tag: int, max_size: int, what: str, path: str | None = None
) -> bytes:
    """The next message from ``src`` on ``tag``, refused unread when ``src`` announces more than ``max_size`` bytes
    (a :class:`~ckptfmt.errors.MessageTooLargeError` saying ``what`` it was and naming ``src``)."""
    try:
        data = channel.recv(src=src, tag=tag, max_size=max_size)
    except MessageTooLargeError as exc:
        raise MessageTooLargeError(f"{what}: {exc.message}", path=path) from exc
    if len(data) > max_size:  # a channel that does not bound its receives: refused all the same
        raise MessageTooLargeError(f"{what}: rank {src} sent {len(data):,} bytes; at most {max_size:,} are accepted")
    return data


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
    hasher = file_hasher(algorithm_of(record.digest))
    out = destination.create(record.path) if failure is None else None
    position = 0
    try:
        while position < record.size or (record.size == 0 and position == 0):
            message = receive_bounded(
                channel, src, tag, _PIECE_HEAD.size + max(PIECE_BYTES, ABORT_TEXT_BYTES), "a piece", record.path
            )
            if len(message) < _PIECE_HEAD.size:
                raise CollectiveError(f"rank {src} sent a truncated piece", path=record.path)
            status, expected = _PIECE_HEAD.unpack_from(message)
            payload = memoryview(message)[_PIECE_HEAD.size :]
            if status in (_ABORT, _DROPPED):
                raise (ReplicaDropped if status == _DROPPED else CollectiveError)(
                    f"rank {src} could not send it: {bytes(payload).decode('utf-8', 'replace')}", path=record.path
                )
            # The sender cuts a file into pieces of exactly this length: a piece of another length is damaged, and
            # still counts as one piece, so that the receiver reads exactly the messages the sender sends (waiting
            # for the rest of a cut piece would wait for a message that never comes).
            length = min(PIECE_BYTES, record.size - position)
            if len(payload) != length and failure is None:
                failure = DigestMismatchError(
                    f"a piece at byte {position} from rank {src} has {len(payload)} bytes, not {length}",
                    path=record.path,
                )
            if out is not None and failure is None:
                if xxhash.xxh3_64_intdigest(payload) != expected:
                    failure = DigestMismatchError(
                        f"a piece at byte {position} from rank {src} arrived damaged", path=record.path
                    )
                else:
                    hasher.update(payload)
                    out.write(payload)
            position += length
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
