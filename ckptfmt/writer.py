"""The streaming writer, and the commit protocol (spec/commit.md) — the only place a checkpoint becomes visible.

Memory bound: besides the caller's own arrays, the writer holds references to at most
``workers + 1`` files' worth of pending tensors (never copies, except to make a non-contiguous or
big-endian array contiguous little-endian, or a GPU tensor host-resident), one I/O slice of
``SLICE_BYTES`` per worker thread, and the manifest records. Arrays passed in must therefore not be
modified until the writer commits (or :meth:`CheckpointWriter.flush` returns).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

import numpy as np

from . import __version__, layout
from . import chunks as geometry
from .arrays import as_array, byte_view
from .canonical import config_hash, config_to_dict
from .context import encode
from .digests import DEFAULT_ALGORITHM, new_hasher
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    ChunkLayoutError,
    MissingFieldError,
    UsageError,
)
from .fields import check_standard_field
from .lock import WriterLock, read_lock
from .manifest import (
    ChunkRecord,
    FieldRecord,
    FileRecord,
    Manifest,
    TensorRecord,
    checkpoint_id,
    parse_manifest,
)
from .paths import LOCK_NAME, MANIFEST_NAME, check_field_name, tensor_name_problem
from .profiles import PROFILES
from .safetensors_io import build_header
from .storage import Store

DEFAULT_TARGET_FILE_SIZE = 1 << 30
SLICE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class _Pending:
    name: str
    key: str
    dtype: str
    array: np.ndarray[Any, Any]
    offsets: tuple[int, ...]


@dataclass(slots=True)
class _TensorState:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkRecord]
    sharded: bool


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_provenance() -> dict[str, object]:
    return {
        "writer": {"name": "ckptfmt", "version": __version__},
        "created_at": _now(),
        "host": socket.gethostname(),
    }


class CheckpointWriter:
    """Writes one checkpoint. Use as a context manager: leaving the block commits, an exception aborts."""

    def __init__(
        self,
        store: Store,
        *,
        profile: str = "training",
        overwrite: bool = False,
        target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
        digest: str = DEFAULT_ALGORITHM,
        rank: int = 0,
        workers: int = 2,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if profile not in PROFILES:
            raise UsageError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
        if target_file_size <= 0 or workers <= 0 or rank < 0:
            raise UsageError("target_file_size and workers must be positive, rank non-negative")
        new_hasher(digest)  # fail early on an unknown algorithm
        if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UsageError("metadata must map strings to strings")
        self.store = store
        self.profile = profile
        self.target_file_size = target_file_size
        self.digest = digest
        self.rank = rank
        self.metadata = dict(metadata or {})
        self._tensors: dict[str, dict[str, _TensorState]] = {}
        self._contexts: dict[str, str] = {}
        self._pending: dict[str, list[_Pending]] = {}
        self._pending_bytes: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self._files: dict[str, FileRecord] = {}
        self._written: list[str] = []  # every path this writer published, for abort
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-write")
        self._inflight: list[Future[None]] = []
        self._max_inflight = workers
        self._closed = False
        self.checkpoint_id: str | None = None
        self._old_files: dict[str, int] = {}
        self._acquire(overwrite)

    # ------------------------------------------------------------ lock and replace

    def _acquire(self, overwrite: bool) -> None:
        self._holder = WriterLock.mine()
        for attempt in range(2):
            try:
                self.store.put_exclusive(LOCK_NAME, self._holder.to_bytes())
                break
            except FileExistsError:
                current = read_lock(self.store)
                if attempt == 0 and current is not None and current.holder_is_dead():
                    self.store.delete(LOCK_NAME)  # a stale lock: its holder is known to be gone
                    continue
                self._pool.shutdown()
                holder = current.describe() if current is not None else "holder unknown"
                raise CheckpointLockedError(
                    f"another writer holds {LOCK_NAME} ({holder}); if it is dead, "
                    "remove the lock (`ckpt gc`) or wait for it",
                    path=self.store.url,
                ) from None
        if self.store.exists(MANIFEST_NAME):
            if not overwrite:
                self.store.delete(LOCK_NAME)
                self._pool.shutdown()
                raise CheckpointExistsError(
                    "a committed checkpoint is already here; pass overwrite=True to replace it",
                    path=self.store.url,
                )
            # Replace: un-commit first, so no reader ever sees the old manifest over new data files.
            self._old_files = self.store.list()
            self.store.delete(MANIFEST_NAME)

    # ------------------------------------------------------------ public API

    def write_tensor(
        self,
        field: str,
        name: str,
        array: object,
        *,
        global_shape: tuple[int, ...] | list[int] | None = None,
        offsets: tuple[int, ...] | list[int] | None = None,
    ) -> None:
        """Add one tensor, or one chunk of a sharded tensor (``global_shape`` and ``offsets`` given)."""
        self._check_open()
        self._raise_background_error()
        check_field_name(field)
        problem = tensor_name_problem(name)
        if problem:
            raise UsageError(problem, field=field, tensor=name)
        data, dtype = as_array(array)
        shape = tuple(int(d) for d in data.shape)
        if (global_shape is None) != (offsets is None):
            raise UsageError("give both global_shape and offsets for a chunk, or neither", field=field, tensor=name)
        gshape = shape if global_shape is None else tuple(int(d) for d in global_shape)
        offs = (0,) * len(shape) if offsets is None else tuple(int(o) for o in offsets)
        if len(gshape) != len(shape) or len(offs) != len(shape):
            raise UsageError(
                f"chunk of rank {len(shape)} does not match global_shape {list(gshape)} / offsets {list(offs)}",
                field=field,
                tensor=name,
            )
        for d in range(len(shape)):
            if offs[d] < 0 or offs[d] + shape[d] > gshape[d]:
                raise ChunkLayoutError(
                    f"chunk of shape {list(shape)} at {list(offs)} lies outside {list(gshape)}",
                    field=field,
                    tensor=name,
                )
        sharded = global_shape is not None
        tensors = self._tensors.setdefault(field, {})
        state = tensors.get(name)
        if state is None:
            tensors[name] = _TensorState(dtype=dtype, shape=gshape, chunks=[], sharded=sharded)
        elif not (state.sharded and sharded):
            raise UsageError("tensor was already written", field=field, tensor=name)
        elif state.dtype != dtype or state.shape != gshape:
            raise UsageError(
                f"chunk is {dtype}{list(gshape)} but earlier chunks said {state.dtype}{list(state.shape)}",
                field=field,
                tensor=name,
            )
        whole = offs == (0,) * len(shape) and shape == gshape
        key = name if whole else f"{name}@{','.join(map(str, offs))}"
        nbytes = data.nbytes
        pending = self._pending.setdefault(field, [])
        if pending and self._pending_bytes[field] + nbytes > self.target_file_size:
            self._flush_field(field)
            pending = self._pending.setdefault(field, [])
        clash = next((p for p in pending if p.key == key), None)
        if clash is not None and clash.name == name:
            raise UsageError(f"chunk at {list(offs)} was already written", field=field, tensor=name)
        if clash is not None:
            # A tensor named like another's chunk key ("t@0"): keys need only be unique within a file.
            self._flush_field(field)
            pending = self._pending.setdefault(field, [])
        pending.append(_Pending(name=name, key=key, dtype=dtype, array=data, offsets=offs))
        self._pending_bytes[field] = self._pending_bytes.get(field, 0) + nbytes

    def write_tensors(self, field: str, tensors: Mapping[str, object]) -> None:
        """Add a mapping of tensors to a field (an empty mapping declares an empty tensor field)."""
        self._check_open()
        check_field_name(field)
        self._tensors.setdefault(field, {})
        for name, array in tensors.items():
            self.write_tensor(field, name, array)

    def write_context(self, field: str, value: Mapping[str, object]) -> None:
        """Store a field's context map (alone, or beside the field's tensors)."""
        self._check_open()
        self._raise_background_error()
        check_field_name(field)
        if field in self._contexts:
            raise UsageError("context was already written", field=field)
        if not isinstance(value, Mapping):
            raise UsageError(f"a context must be a mapping, got {type(value).__name__}", field=field)
        if field == "provenance":
            value = {**default_provenance(), **value}
        check_standard_field(field, value)
        data = encode(value, where=f"field {field!r}")
        path = layout.context_path(field)
        self._publish(path, [memoryview(data)], [])
        self._contexts[field] = path

    def write_config(self, config: object) -> None:
        """Store a config (mapping or dataclass) with its canonical hash as the ``config`` field."""
        as_dict = config_to_dict(config)
        self.write_context("config", {"config": as_dict, "hash": config_hash(as_dict)})

    def flush(self) -> None:
        """Write every pending tensor and wait until its file is durable."""
        self._check_open()
        for field in list(self._pending):
            if self._pending[field]:
                self._flush_field(field)
        self._drain(0)

    def commit(self) -> str:
        """Finish the checkpoint: flush, check completeness, write the manifest. Returns the checkpoint id."""
        self._check_open()
        try:
            self.flush()
            if "provenance" not in self._contexts and "provenance" in PROFILES[self.profile]:
                self.write_context("provenance", {})
            manifest = self._build_manifest()
            data = manifest.to_bytes()
            parse_manifest(data)  # never commit what a reader would refuse
            self.store.sync_dirs(self._written)
            try:
                self.store.put_exclusive(MANIFEST_NAME, data)
            except FileExistsError:
                raise CheckpointExistsError(
                    "another writer committed a checkpoint here first", path=self.store.url
                ) from None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._pool.shutdown()
        keep = {f.path for f in manifest.files}
        for path in self._old_files:
            if path not in keep and path not in (MANIFEST_NAME, LOCK_NAME):
                self.store.delete(path)
        self.store.delete(LOCK_NAME)
        self.checkpoint_id = checkpoint_id(data)
        return self.checkpoint_id

    def abort(self) -> None:
        """Discard everything written; no manifest is left. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for future in self._inflight:
            future.exception()  # wait; errors are moot once aborting
        self._inflight.clear()
        self._pool.shutdown()
        try:
            for path in self._written:
                self.store.delete(path)
            self.store.delete(LOCK_NAME)
        except CheckpointError:
            # Storage is unreachable: stop trying (each attempt waits out retries). What is left is an
            # incomplete checkpoint that gc removes, and this process may take over its own lock.
            self._holder.abandon()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the writer is closed (committed or aborted)")

    def _raise_background_error(self) -> None:
        for future in self._inflight:
            if future.done() and future.exception() is not None:
                self._drain(0)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            future = self._inflight.pop(0)
            future.result()

    def _flush_field(self, field: str) -> None:
        pending = self._pending.pop(field)
        self._pending_bytes[field] = 0
        seq = self._seq.get(field, 0)
        self._seq[field] = seq + 1
        path = layout.data_path(field, self.rank, seq)
        self._drain(self._max_inflight - 1)
        self._inflight.append(self._pool.submit(self._write_data_file, field, path, pending))

    def _write_data_file(self, field: str, path: str, pending: list[_Pending]) -> None:
        header, starts = build_header([(p.key, p.dtype, tuple(p.array.shape), p.array.nbytes) for p in pending])
        views = [byte_view(p.array) for p in pending]
        records = self._publish(path, [memoryview(header), *views], starts, chunk_views=len(pending))
        with self._lock:
            tensors = self._tensors[field]
            for p, (begin, end, digest) in zip(pending, records, strict=True):
                tensors[p.name].chunks.append(
                    ChunkRecord(
                        path=path,
                        key=p.key,
                        offsets=p.offsets,
                        shape=tuple(p.array.shape),
                        begin=begin,
                        end=end,
                        digest=digest,
                    )
                )

    def _publish(
        self, path: str, parts: list[memoryview], starts: list[int], chunk_views: int = 0
    ) -> list[tuple[int, int, str]]:
        """Stream ``parts`` into a new file, hashing the file and each chunk part in the same pass."""
        out = self.store.create(path)
        file_hash = new_hasher(self.digest)
        chunk_records = []
        try:
            position = 0
            for index, part in enumerate(parts):
                is_chunk = index >= len(parts) - chunk_views
                chunk_hash = new_hasher(self.digest) if is_chunk else None
                for lo in range(0, len(part), SLICE_BYTES):
                    piece = part[lo : lo + SLICE_BYTES]
                    file_hash.update(piece)
                    if chunk_hash is not None:
                        chunk_hash.update(piece)
                    out.write(piece)
                if chunk_hash is not None:
                    chunk_records.append((position, position + len(part), f"{self.digest}:{chunk_hash.hexdigest()}"))
                position += len(part)
            out.commit()
        except BaseException:
            out.abort()
            raise
        with self._lock:
            self._written.append(path)
            self._files[path] = FileRecord(path=path, size=position, digest=f"{self.digest}:{file_hash.hexdigest()}")
        assert not starts or [r[0] for r in chunk_records] == starts
        return chunk_records

    def _build_manifest(self) -> Manifest:
        fields: dict[str, FieldRecord] = {}
        for name in sorted(set(self._tensors) | set(self._contexts)):
            context = self._contexts.get(name)
            if name not in self._tensors:
                fields[name] = FieldRecord(kind="context", context=context)
                continue
            tensors: dict[str, TensorRecord] = {}
            for tname, state in self._tensors[name].items():
                chunk_list = sorted(state.chunks, key=lambda c: c.offsets)
                problem = geometry.coverage_problem(state.shape, [(c.offsets, c.shape) for c in chunk_list])
                if problem:
                    raise ChunkLayoutError(
                        f"chunks do not tile shape {list(state.shape)}: {problem}", field=name, tensor=tname
                    )
                tensors[tname] = TensorRecord(dtype=state.dtype, shape=state.shape, chunks=tuple(chunk_list))
            fields[name] = FieldRecord(kind="tensors", tensors=tensors, context=context)
        for name, kind in PROFILES[self.profile].items():
            if name not in fields or fields[name].kind != kind:
                raise MissingFieldError(
                    f"profile {self.profile!r} requires field {name!r} of kind {kind!r}; nothing was committed",
                    field=name,
                )
        files = tuple(self._files[p] for p in sorted(self._files))
        return Manifest(profile=self.profile, files=files, fields=fields, metadata=self.metadata)
