"""Executing plans against a Store: the only layer that moves tensor bytes (plan / execute / commit split).

Writes run on one bounded thread pool per writer; each data file is streamed once, with the file
digest and every chunk digest computed in the same pass as the write (xxhash and file I/O release
the GIL, so the pool gives real parallelism). Reads fetch exactly the byte ranges of the chunks a
read plan names and check each chunk's digest over exactly the bytes read.

Encoded files (spec/codecs.md) are encoded on the same pool, in the worker that writes them: the
header of a safetensors file needs every entry's stored size, so such a file is built in memory
(at most ``plan.ENCODED_FILE_BYTES`` of raw data, ~that much encoded) and then streamed.

Memory bound of a write: references (never copies) to the arrays of at most ``workers + 1`` files,
plus per worker one ``SLICE_BYTES`` slice in flight, or one encoded file and one frame's byte planes,
and (local stores) one staging buffer of ``storage.direct.BUFFER_BYTES``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dtypes
from .arrays import byte_view
from .codecs import get_codec
from .digests import algorithm_of, format_digest, new_hasher
from .errors import CheckpointError, DigestMismatchError
from .manifest import ChunkRecord, Codec, FileRecord
from .plan import FilePlan, PlacedChunk
from .safetensors_io import build_header
from .storage import Store

# The unit of the write pass: each slice is hashed for the file, hashed for its chunk and handed to the store
# while it is still in the CPU's cache (1 MiB: 2.6 GB/s into a tmpfs here, against 0.84 GB/s with 16 MiB
# slices, whose second and third passes went to memory again). I/O sizes are the store's own (an 8 MiB
# staging buffer locally, 16 MiB multipart parts on object stores).
SLICE_BYTES = 1 << 20
COALESCE_MAX_CHUNK = 1 << 20  # chunks up to this size may share one ranged request
COALESCE_MAX_RUN = 16 << 20  # the staging buffer of one shared request


def stream_file(
    store: Store, path: str, parts: Sequence[memoryview], *, chunk_parts: int, algorithm: str
) -> tuple[FileRecord, list[tuple[int, int, str]]]:
    """Write ``parts`` back to back as a new file, durably; the last ``chunk_parts`` parts are chunks.

    Returns the file record and each chunk's ``(begin, end, digest)``, all hashed in the same pass.
    """
    out = store.create(path)
    file_hash = new_hasher(algorithm)
    spans: list[tuple[int, int, str]] = []
    position = 0
    try:
        for index, part in enumerate(parts):
            chunk_hash = new_hasher(algorithm) if index >= len(parts) - chunk_parts else None
            for lo in range(0, len(part), SLICE_BYTES):
                piece = part[lo : lo + SLICE_BYTES]
                file_hash.update(piece)
                if chunk_hash is not None:
                    chunk_hash.update(piece)
                out.write(piece)
            if chunk_hash is not None:
                spans.append((position, position + len(part), format_digest(algorithm, chunk_hash)))
            position += len(part)
        out.commit()
    except BaseException:
        out.abort()
        raise
    return FileRecord(path=path, size=position, digest=format_digest(algorithm, file_hash)), spans


class WriteExecutor:
    """Runs one rank's file plans on a bounded pool and collects the records of what it wrote."""

    def __init__(self, store: Store, *, algorithm: str, workers: int) -> None:
        self.store = store
        self.algorithm = algorithm
        self.files: dict[str, FileRecord] = {}
        self.chunks: list[PlacedChunk] = []
        self.written: list[str] = []  # every path published, in order, for abort
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-write")
        self._inflight: list[Future[None]] = []
        self._max_inflight = workers

    def submit(self, plan: FilePlan, arrays: Sequence[np.ndarray[Any, Any]]) -> None:
        """Queue one data file; blocks while ``workers`` files are already in flight (the memory bound)."""
        self.drain(self._max_inflight - 1)
        self._inflight.append(self._pool.submit(self._write_data_file, plan, arrays))

    def write_blob(self, path: str, data: bytes) -> FileRecord:
        """Write a small blob (a context map) synchronously."""
        record, _ = stream_file(self.store, path, [memoryview(data)], chunk_parts=0, algorithm=self.algorithm)
        self._record(record)
        return record

    def raise_background_error(self) -> None:
        """Re-raise the first failure of a finished background write, if any."""
        if any(f.done() and f.exception() is not None for f in self._inflight):
            self.drain(0)

    def drain(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` files are in flight, raising the first failure."""
        while len(self._inflight) > keep:
            self._inflight.pop(0).result()

    def shutdown(self) -> None:
        """Wait for every write (errors are moot here: the caller is committing or aborting)."""
        for future in self._inflight:
            future.exception()
        self._inflight.clear()
        self._pool.shutdown()

    def _record(self, record: FileRecord) -> None:
        with self._lock:
            self.written.append(record.path)
            self.files[record.path] = record

    def _write_data_file(self, plan: FilePlan, arrays: Sequence[np.ndarray[Any, Any]]) -> None:
        views: list[memoryview] = []
        codecs: list[Codec] = []
        header_entries: list[tuple[str, str, tuple[int, ...], int]] = []
        for e, array in zip(plan.entries, arrays, strict=True):
            view = byte_view(array)
            if not e.encoded:
                views.append(view)
                codecs.append(Codec())
                header_entries.append((e.key, e.dtype, e.shape, e.nbytes))
                continue
            # Header building follows encoding: an encoded entry is a U8 entry of its stored size (COD-3).
            encoded = get_codec(e.codec.name).encode(
                view,
                dtype=e.dtype,
                itemsize=dtypes.itemsize(e.dtype),
                level=e.codec.level,
                frame_bytes=e.codec.frame_bytes,
            )
            stored = encoded.parts[0] if len(encoded.parts) == 1 else b"".join(encoded.parts)
            views.append(memoryview(stored))
            codecs.append(Codec(name=e.codec.name, configuration=encoded.configuration))
            header_entries.append((e.key, "U8", (len(stored),), len(stored)))
        header, starts = build_header(header_entries)
        record, spans = stream_file(
            self.store, plan.path, [memoryview(header), *views], chunk_parts=len(views), algorithm=self.algorithm
        )
        assert [s[0] for s in spans] == starts
        placed = [
            PlacedChunk(
                field=e.field,
                tensor=e.tensor,
                dtype=e.dtype,
                global_shape=e.global_shape,
                chunk=ChunkRecord(
                    path=plan.path,
                    key=e.key,
                    offsets=e.offsets,
                    shape=e.shape,
                    begin=begin,
                    end=end,
                    digest=digest,
                    codec=codec,
                ),
            )
            for e, (begin, end, digest), codec in zip(plan.entries, spans, codecs, strict=True)
        ]
        self._record(record)
        with self._lock:
            self.chunks.extend(placed)


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """Fetch ``chunk``'s stored bytes (or only ``span``, absolute, of them) into ``out``, exactly that
    size; then, for an encoded chunk, ``decode`` them (on the fetching thread, so decoding runs in
    parallel). ``field`` and ``tensor`` name the chunk in errors."""

    chunk: ChunkRecord
    out: memoryview
    field: str
    tensor: str
    span: tuple[int, int] | None = None
    decode: Callable[[memoryview], None] | None = None

    @property
    def begin(self) -> int:
        return self.chunk.begin if self.span is None else self.span[0]

    @property
    def end(self) -> int:
        return self.chunk.end if self.span is None else self.span[1]

    @property
    def whole(self) -> bool:
        """The read fetches every stored byte of the chunk, so the chunk digest can be checked."""
        return self.begin == self.chunk.begin and self.end == self.chunk.end


def check_chunk(chunk: ChunkRecord, data: memoryview) -> None:
    """Raise DigestMismatchError unless ``data`` hashes to the chunk's digest."""
    algorithm = algorithm_of(chunk.digest)
    hasher = new_hasher(algorithm)
    hasher.update(data)
    actual = format_digest(algorithm, hasher)
    if actual != chunk.digest:
        raise DigestMismatchError(
            f"bytes [{chunk.begin}, {chunk.end}) hash to {actual}, manifest says {chunk.digest}", path=chunk.path
        )


def coalesce(reads: Sequence[ChunkRead]) -> list[list[ChunkRead]]:
    """Group reads of one file into runs of back-to-back small chunks, each run fetched by one request.

    Chunks larger than ``COALESCE_MAX_CHUNK`` are fetched alone, straight into their destination; small
    ones (the many little tensors of a model) share a request through a bounded staging buffer.
    """
    ordered = sorted(reads, key=lambda r: r.begin)
    runs: list[list[ChunkRead]] = []
    run_bytes = 0
    for read in ordered:
        size = read.end - read.begin
        small = size <= COALESCE_MAX_CHUNK
        if (
            runs
            and small
            and run_bytes + size <= COALESCE_MAX_RUN
            and runs[-1][-1].end == read.begin
            and runs[-1][-1].end - runs[-1][-1].begin <= COALESCE_MAX_CHUNK
        ):
            runs[-1].append(read)
            run_bytes += size
        else:
            runs.append([read])
            run_bytes = size
    return runs


def fetch_runs(
    store: Store,
    runs: Sequence[Sequence[ChunkRead]],
    *,
    verify: bool,
    prefix: Sequence[tuple[int, memoryview]] = (),
    check: Callable[[], None] | None = None,
) -> int:
    """Fetch coalesced runs of one file with one ``read_ranges`` call, then check each chunk's digest.

    A lone chunk lands straight in its destination; a run of several shares one bounded staging buffer.
    ``prefix`` ranges (a file's header) are fetched in the same call and ``check`` runs before any chunk
    is checked or decoded. Returns the number of tensor bytes fetched.
    """
    views: list[memoryview] = []
    for run in runs:
        views.append(run[0].out if len(run) == 1 else memoryview(bytearray(run[-1].end - run[0].begin)))
    try:
        requests = [(run[0].begin, v) for run, v in zip(runs, views, strict=True)]
        store.read_ranges(runs[0][0].chunk.path, [*prefix, *requests])
    except CheckpointError as exc:
        exc.locate(field=runs[0][0].field, tensor=runs[0][0].tensor)
        raise
    if check is not None:
        check()
    for run, view in zip(runs, views, strict=True):
        base = run[0].begin
        for read in run:
            part = view[read.begin - base : read.end - base]
            try:
                # A partial read of an encoded chunk is covered by its frames' checksums instead (COD-5).
                if verify and read.whole:
                    check_chunk(read.chunk, part)
                if read.decode is not None:
                    read.decode(part)
                elif len(run) > 1:
                    read.out[:] = part
            except CheckpointError as exc:
                exc.locate(path=read.chunk.path, field=read.field, tensor=read.tensor)
                raise
    return sum(len(v) for v in views)


def split_runs(runs: Sequence[list[ChunkRead]], parts: int) -> list[list[list[ChunkRead]]]:
    """Contiguous groups of a file's runs, balanced by bytes, so ``parts`` threads can share one file."""
    sizes = [run[-1].end - run[0].begin for run in runs]
    target = sum(sizes) / max(1, parts)
    groups: list[list[list[ChunkRead]]] = [[]]
    filled = 0
    for run, size in zip(runs, sizes, strict=True):
        if groups[-1] and filled + size / 2 > target and len(groups) < parts:
            groups.append([])
            filled = 0
        groups[-1].append(run)
        filled += size
    return groups


__all__ = [
    "SLICE_BYTES",
    "ChunkRead",
    "WriteExecutor",
    "check_chunk",
    "coalesce",
    "fetch_runs",
    "split_runs",
    "stream_file",
]
