"""Executing write plans against a Store: the only layer of the write side that moves tensor bytes (plan /
execute / commit split; reads have their own executor, ``read_executor``).

Writes run on one bounded thread pool per writer; each data file is streamed once, with the file
digest and every chunk digest computed in the same pass as the write (xxhash and file I/O release
the GIL, so the pool gives real parallelism).

Encoded files (spec/codecs.md) are encoded on the same pool, in the worker that writes them: the
header of a safetensors file needs every entry's stored size, so such a file is built in memory
(at most ``plan.ENCODED_FILE_BYTES`` of raw data, ~that much encoded) and then streamed.

Memory bound of a write: references (never copies) to the arrays of at most ``workers + 1`` files,
plus per worker one ``SLICE_BYTES`` slice in flight, or one encoded file and one frame's byte planes,
and (local stores) two staging buffers of ``storage.direct.BUFFER_BYTES``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from . import dtypes
from .arrays import byte_view
from .blocks import BlockHasher, Blocks
from .codecs import get_codec
from .digests import base_algorithm, digest_of, format_digest, is_tree, new_hasher
from .manifest import RAW, RAW_CODEC, ChunkRecord, Codec, FileRecord
from .plan import FilePlan, PlacedChunk
from .safetensors_io import build_header
from .storage import Store
from .thread_pools import submit_or_run
from .tree_digests import LEAF_BYTES, entry_digest, file_tree_hex

# The unit of the write pass: each slice is hashed for the file, hashed for its chunk and handed to the store
# while it is still in the CPU's cache (16 MiB slices had left it: their second and third passes went to memory
# again; docs/benchmarks.md). I/O sizes are the store's own (32 MiB
# staging buffers locally, 16 MiB multipart parts on object stores).
SLICE_BYTES = 1 << 20


def stream_file(
    store: Store,
    path: str,
    parts: Sequence[memoryview],
    *,
    chunk_parts: int,
    algorithm: str,
    block_sizes: Sequence[int | None] = (),
) -> tuple[FileRecord, list[tuple[int, int, str, Blocks | None]]]:
    """Write ``parts`` back to back as a new file, durably; the last ``chunk_parts`` parts are chunks.

    ``block_sizes`` gives, per chunk part, the block size of its block digests (None: none). Returns the file
    record and each chunk's ``(begin, end, digest, blocks)``, all hashed in the same pass, slice by slice.
    Under a tree algorithm (spec/tree-digests.md) ``parts`` are a data file, its header then every entry, and each
    byte is hashed once: into its 64 KiB piece, from which the chunk, block and file digests all derive.
    """
    out = store.create(path)
    tree = is_tree(algorithm)
    assert not tree or chunk_parts == len(parts) - 1, "a tree digest is a data file's: its header, then entries"
    file_hash = None if tree else new_hasher(algorithm)
    leaves: list[tuple[int, str]] = []  # (length, entry digest) of each non-empty part, for the file tree
    spans: list[tuple[int, int, str, Blocks | None]] = []
    position = 0
    first_chunk = len(parts) - chunk_parts
    try:
        for index, part in enumerate(parts):
            is_chunk = index >= first_chunk
            size = block_sizes[index - first_chunk] if is_chunk and block_sizes else None
            pieces = BlockHasher(algorithm, LEAF_BYTES) if tree else None
            chunk_hash = new_hasher(algorithm) if is_chunk and not tree else None
            # blocks of another size than the pieces cost a hash pass of their own (spec/tree-digests.md)
            blocks = BlockHasher(algorithm, size) if size is not None and (not tree or size != LEAF_BYTES) else None
            found_blocks = None
            digest = ""
            for lo in range(0, len(part), SLICE_BYTES):
                piece = part[lo : lo + SLICE_BYTES]
                for hasher in (file_hash, pieces, chunk_hash, blocks):
                    if hasher is not None:
                        hasher.update(piece)
                out.write(piece)
            if pieces is not None:
                found = pieces.finish()
                digest = entry_digest(algorithm, len(part), found.digests)
                if len(part):
                    leaves.append((len(part), digest))
                if blocks is None and size is not None:
                    found_blocks = found  # blocks of the pieces' size are the pieces
            elif chunk_hash is not None:
                digest = format_digest(algorithm, chunk_hash)
            if is_chunk:
                found_blocks = blocks.finish() if blocks is not None else found_blocks
                spans.append((position, position + len(part), digest, found_blocks))
            position += len(part)
        out.commit()
    except BaseException:
        out.abort()
        raise
    if file_hash is None:
        file_digest = f"{algorithm}:{file_tree_hex(algorithm, leaves)}"
    else:
        file_digest = format_digest(algorithm, file_hash)
    return FileRecord(path=path, size=position, digest=file_digest), spans


class WriteExecutor:
    """Runs one rank's file plans on a bounded pool and collects the records of what it wrote."""

    def __init__(self, store: Store, *, algorithm: str, workers: int, block_bytes: int | None = None) -> None:
        self.store = store
        self.algorithm = algorithm
        self.block_bytes = block_bytes  # raw chunks larger than this get block digests (spec/blocks.md)
        self.files: dict[str, FileRecord] = {}
        self.chunks: list[PlacedChunk] = []
        # (field, tensor, offsets) -> digest of an encoded chunk's raw bytes: what a later incremental save of
        # this process compares unchanged data with (its stored digest covers compressed bytes; ckptfmt/incremental.py)
        self.raw_digests: dict[tuple[str, str, tuple[int, ...]], str] = {}
        self.written: list[str] = []  # every path published, in order, for abort
        self.headers: dict[str, tuple[bytes, list[int]]] = {}  # raw data files' headers, for a plan cache
        self._lock = threading.Lock()
        # workers=0: each file written on the caller's thread when submitted (a caller that is a background thread
        # already, as a memory snapshot's: no thread started, no hand-off per file)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-write") if workers else None
        self._inflight: list[Future[None]] = []
        self._max_inflight = workers

    def submit(
        self, plan: FilePlan, arrays: Sequence[np.ndarray[Any, Any]], *, header: tuple[bytes, list[int]] | None = None
    ) -> None:
        """Queue one data file; blocks while ``workers`` files are already in flight (the memory bound). ``header``:
        the file's header and entry starts, when known already (a raw file of a recorded plan, plan_cache.py)."""
        if self._pool is None:
            self._write_data_file(plan, arrays, header)
            return
        self.drain(self._max_inflight - 1)
        self._inflight.append(submit_or_run(self._pool, self._write_data_file, plan, arrays, header))

    def write_blob(self, path: str, data: bytes) -> FileRecord:
        """Write a small blob (a context map) synchronously: a flat digest, as it is no data file (TRE-2)."""
        flat = base_algorithm(self.algorithm)
        record, _ = stream_file(self.store, path, [memoryview(data)], chunk_parts=0, algorithm=flat)
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
        if self._pool is not None:
            self._pool.shutdown()

    def _record(self, record: FileRecord) -> None:
        with self._lock:
            self.written.append(record.path)
            self.files[record.path] = record

    def _write_data_file(
        self, plan: FilePlan, arrays: Sequence[np.ndarray[Any, Any]], known: tuple[bytes, list[int]] | None
    ) -> None:
        views: list[memoryview] = []
        codecs: list[Codec] = []
        header_entries: list[tuple[str, str, tuple[int, ...], int]] = []
        for e, array in zip(plan.entries, arrays, strict=True):
            view = byte_view(array)
            if not e.encoded:
                views.append(view)
                codecs.append(RAW_CODEC)
                header_entries.append((e.key, e.dtype, e.shape, e.nbytes))
                continue
            # Header building follows encoding: an encoded entry is a U8 entry of its stored size (COD-3).
            encoded = get_codec(e.codec.name).encode(
                view, dtype=e.dtype, itemsize=dtypes.itemsize(e.dtype), options=e.codec.options
            )
            raw_digest = digest_of(base_algorithm(self.algorithm), view)  # a chunk's, never a file tree's
            with self._lock:
                self.raw_digests[(e.field, e.tensor, e.offsets)] = raw_digest
            stored = encoded.parts[0] if len(encoded.parts) == 1 else b"".join(encoded.parts)
            views.append(memoryview(stored))
            config = encoded.configuration
            codecs.append(Codec(name=e.codec.name, configuration=None if config is None else config.to_dict()))
            header_entries.append((e.key, "U8", (len(stored),), len(stored)))
        raw = all(c is RAW_CODEC for c in codecs)
        header, starts = known if known is not None and raw else build_header(header_entries)
        if raw:
            with self._lock:
                self.headers[plan.path] = (header, starts)
        block = self.block_bytes
        sizes = [
            block if block and c.name == RAW and len(v) > block else None for v, c in zip(views, codecs, strict=True)
        ]
        record, spans = stream_file(
            self.store,
            plan.path,
            [memoryview(header), *views],
            chunk_parts=len(views),
            algorithm=self.algorithm,
            block_sizes=sizes,
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
                    blocks=blocks,
                ),
            )
            for e, (begin, end, digest, blocks), codec in zip(plan.entries, spans, codecs, strict=True)
        ]
        self._record(record)
        with self._lock:
            self.chunks.extend(placed)


__all__ = ["SLICE_BYTES", "WriteExecutor", "stream_file"]
