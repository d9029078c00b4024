"""The writer's side of incremental checkpoints: which chunks to reference in the base instead of writing.

A chunk about to be written is referenced when the base has a chunk of the same tensor (same dtype and global
shape) at the same offsets and shape whose stored bytes are these (spec/references.md):

- a raw base chunk: the chunk's bytes hash to the base chunk's digest (one hash, no write);
- a tensor the caller declared ``frozen``: the base chunk is taken as it is, whatever its codec, unhashed;
- an encoded base chunk: its raw bytes' digest, when the caller knows it (``content``: the raw digests a writer
  of this process recorded when it wrote or referenced the base's chunks, ``CheckpointWriter.raw_digests``);
  else written again (its digest covers compressed bytes, which only an encode would reproduce).

A base chunk that is itself a reference is referenced where it is stored (REF-9: never through a reference).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import byte_view
from .codecs.xor_zstd import MAX_DEPTH, BaseChunk, DeltaSource
from .delta import chain_files
from .digests import algorithm_of
from .errors import UsageError
from .manifest import RAW, ChunkRecord, FileRecord
from .references import PARENT, BaseFile, BaseRecord, location_of, virtual_path
from .tree_digests import chunk_digest_of

if TYPE_CHECKING:
    from .reader import Checkpoint
    from .storage import Store

Shape = tuple[int, ...]
ChunkKey = tuple[str, str, Shape]  # (field, tensor, offsets)
RawDigests = tuple[str, Mapping[ChunkKey, str]]  # (checkpoint id, raw digest of each encoded chunk)
log = logging.getLogger("ckptfmt")


@dataclass(frozen=True, slots=True)
class _Candidate:
    dtype: str
    global_shape: Shape
    chunk: ChunkRecord  # as the new manifest records it: virtual path, ``base`` set
    base: BaseRecord  # the checkpoint that stores it, with only this chunk's file


@dataclass(slots=True)
class ReferenceStats:
    """What the writer referenced instead of writing, and what deciding cost."""

    chunks: int = 0
    bytes: int = 0
    hashed_bytes: int = 0  # bytes hashed to compare with the base (frozen tensors are not hashed)
    files: dict[tuple[str, str], BaseFile] = field(default_factory=dict)  # (location, path) -> record


def log_referenced(name: str, base: str | None, stats: ReferenceStats | None) -> None:
    """Log what the save of ``name`` referenced in ``base`` instead of writing (nothing without a base)."""
    if stats is not None:
        log.info("%s: %d bytes referenced in %s (%d chunks), not written", name, stats.bytes, base, stats.chunks)


class BaseIndex:
    """The chunks of a base checkpoint, by (field, tensor, offsets), as references from a sibling ``store``."""

    def __init__(
        self,
        base: Checkpoint,
        store: Store,
        *,
        frozen: Collection[str] = (),
        content: RawDigests | None = None,
        owned: bool = False,
    ) -> None:
        own = base.store.url.rstrip("/")
        name = own.rpartition("/")[2]
        if store.sibling(name).url.rstrip("/") != own:
            raise UsageError(
                f"the base {own} must be a checkpoint beside {store.url} (in the same run directory)",
                path=base.store.url,
            )
        if store.url.rstrip("/") == own:
            raise UsageError("a checkpoint cannot be its own base", path=own)
        self.checkpoint_id = base.id
        self._reader = base  # read for the raw bytes of the chunks a delta is taken against (xor-zstd)
        self._owned = owned
        self._read_lock = threading.Lock()
        self._stored_files: dict[str, FileRecord] = {f.path: f for f in base.manifest.files}
        self.location = location_of(name)
        self._ids = {self.location: base.id, **{b.location: b.checkpoint_id for b in base.manifest.bases}}
        self.frozen = frozenset(frozen)
        self.stats = ReferenceStats()
        # raw digests of the base's encoded chunks, trusted only for the checkpoint they were recorded for
        self.raw: dict[ChunkKey, str] = dict(content[1]) if content is not None and content[0] == base.id else {}
        self.referenced_raw: dict[ChunkKey, str] = {}  # of the encoded chunks referenced: carried to the next save
        stored: dict[str, FileRecord] = {f.path: f for f in base.manifest.files}
        grand = {b.location: b for b in base.manifest.bases}
        self._grand = grand
        self._chunks: dict[tuple[str, str, Shape], _Candidate] = {}
        for fname, record in base.manifest.fields.items():
            for tname, tensor in record.tensors.items():
                for chunk in tensor.chunks:
                    if chunk.base is None:
                        file = stored[chunk.path]
                        where = BaseRecord(
                            location=self.location,
                            checkpoint_id=base.id,
                            files=(BaseFile(path=file.path, size=file.size, digest=file.digest),),
                        )
                        as_ref = _as_reference(chunk, self.location)
                    else:  # the base references it: point where it is stored
                        holder = grand[chunk.base]
                        inner = chunk.stored_path
                        files = tuple(f for f in holder.files if f.path == inner)
                        where = BaseRecord(location=holder.location, checkpoint_id=holder.checkpoint_id, files=files)
                        as_ref = chunk
                    key = (fname, tname, chunk.offsets)
                    self._chunks[key] = _Candidate(tensor.dtype, tensor.shape, as_ref, where)

    @property
    def names(self) -> tuple[str, ...]:
        """The directory names of every checkpoint a chunk may be referenced in (the base, its bases)."""
        return tuple(sorted(loc[len(PARENT) :] for loc in self._ids))

    def id_of(self, location: str) -> str:
        """The checkpoint id of the base (or the base's base) at ``location``."""
        return self._ids[location]

    def records(self, references: Iterable[ChunkRecord]) -> tuple[BaseRecord, ...]:
        """The manifest's base records for the chunks ``references`` (referenced through this index): the
        checkpoints that store them, each with its id and the files referenced there."""
        del references  # every file a chunk uses is in stats.files: referenced, or a delta's base (at any depth)
        ids = {loc: self.id_of(loc) for loc, _ in self.stats.files}
        return merge_bases(ids, [(loc, f) for (loc, _), f in self.stats.files.items()])

    def close(self) -> None:
        """Close the base, if this index opened it."""
        if self._owned:
            self._owned = False
            self._reader.close()

    def delta(
        self, field_name: str, name: str, dtype: str, global_shape: Shape, offsets: Shape, shape: Shape
    ) -> DeltaSource | None:
        """What to encode this chunk against with ``xor-zstd`` (spec/delta.md): the base's chunk of the same tensor
        (dtype, global shape), offsets and shape, where it is stored; None when there is none, or when it is
        already ``MAX_DEPTH`` deltas deep (the chunk is then written whole: a keyframe)."""
        found = self._chunks.get((field_name, name, offsets))
        if found is None or (found.dtype, found.global_shape, found.chunk.shape) != (dtype, global_shape, shape):
            return None
        chunk = found.chunk
        levels = list(chain_files(chunk.codec))
        if len(levels) >= MAX_DEPTH:
            return None
        assert chunk.base is not None  # (as the index records every chunk: a reference to where it is stored)
        for location, path in [(chunk.base, chunk.stored_path), *levels]:
            self.stats.files[(location, path)] = self._file(location, path)
        source = BaseChunk(
            path=chunk.stored_path,
            key=chunk.key,
            begin=chunk.begin,
            end=chunk.end,
            digest=chunk.digest,
            codec=chunk.codec,
            blocks=chunk.blocks,
        )

        def read() -> memoryview:
            # read and checked by the base's own reader (its own deltas included): exactly what a reader of the
            # new chunk XORs back (one read of the base chunk per chunk encoded: its stored bytes, decoded)
            with self._read_lock:
                array = self._reader.read_slice(field_name, name, offsets, shape)
            return byte_view(np.ascontiguousarray(array))

        return DeltaSource(location=chunk.base, chunk=source, read=read)

    def _file(self, location: str, path: str) -> BaseFile:
        """The record of file ``path`` of the checkpoint at ``location`` (the base, or one of its bases)."""
        if location == self.location:
            f = self._stored_files[path]
            return BaseFile(path=f.path, size=f.size, digest=f.digest)
        return next(f for f in self._grand[location].files if f.path == path)

    def match(
        self, field_name: str, name: str, dtype: str, global_shape: Shape, offsets: Shape, data: np.ndarray[Any, Any]
    ) -> tuple[ChunkRecord, BaseRecord] | None:
        """The reference to record for this chunk (a C-contiguous little-endian array), or None to write it."""
        found = self._chunks.get((field_name, name, offsets))
        if found is None or (found.dtype, found.global_shape, found.chunk.shape) != (dtype, global_shape, data.shape):
            return None
        chunk = found.chunk
        key = (field_name, name, offsets)
        raw = chunk.digest if chunk.codec.name == RAW else self.raw.get(key)
        if name not in self.frozen:
            if raw is None:
                return None
            self.stats.hashed_bytes += data.nbytes
            if chunk_digest_of(algorithm_of(raw), byte_view(data)) != raw:
                return None
        if chunk.codec.name != RAW and raw is not None:
            self.referenced_raw[key] = raw
        self.stats.chunks += 1
        self.stats.bytes += chunk.nbytes
        for f in found.base.files:
            self.stats.files[(found.base.location, f.path)] = f
        for location, path in chain_files(chunk.codec):  # a referenced delta needs its bases listed too (DLT-6)
            self.stats.files[(location, path)] = self._file(location, path)
        return chunk, found.base


def open_base_index(
    store: Store,
    base: Checkpoint | str | os.PathLike[str] | None,
    frozen: Collection[str],
    content: RawDigests | None,
) -> BaseIndex | None:
    """The chunks of ``base`` for a writer into ``store`` (None without a base): a checkpoint open already, or one
    named by path or URL, which must be beside ``store`` (opened as its sibling, with its credentials)."""
    if base is None:
        if frozen:
            raise UsageError("frozen= names tensors unchanged since a base: give base= too")
        return None
    from .reader import Checkpoint, open_store_checkpoint

    if isinstance(base, Checkpoint):
        return BaseIndex(base, store, frozen=frozen, content=content)
    url = os.fspath(base).rstrip("/")
    sibling = store.sibling(url.rpartition("/")[2] if "/" in url else url)
    expected = os.path.abspath(url) if store.capabilities.local and "://" not in url else url
    if "/" in url and sibling.url.rstrip("/") != expected.rstrip("/"):
        raise UsageError(f"the base {url} must be a checkpoint beside {store.url} (in the same run directory)")
    opened = open_store_checkpoint(sibling)
    try:
        return BaseIndex(opened, store, frozen=frozen, content=content, owned=True)
    except BaseException:
        opened.close()
        raise


def _as_reference(chunk: ChunkRecord, location: str) -> ChunkRecord:
    from dataclasses import replace

    return replace(chunk, path=virtual_path(location, chunk.path), base=location)


def merge_bases(records: Mapping[str, str], files: Collection[tuple[str, BaseFile]]) -> tuple[BaseRecord, ...]:
    """Base records from (location -> checkpoint id) and (location, file) pairs, files sorted and unique."""
    by_location: dict[str, dict[str, BaseFile]] = {}
    for location, f in files:
        by_location.setdefault(location, {})[f.path] = f
    return tuple(
        BaseRecord(
            location=location,
            checkpoint_id=records[location],
            files=tuple(by_location[location][p] for p in sorted(by_location[location])),
        )
        for location in sorted(by_location)
    )
