"""Opening a committed checkpoint and reading tensors and context from it.

:func:`open_checkpoint` refuses anything incomplete, invalid or of an unknown major version before
the caller sees a single tensor. Reads fetch only the byte ranges of the chunks they need, and
verify each chunk's digest over exactly the bytes read.
"""

from __future__ import annotations

import functools
import mmap as mmap_module
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from . import chunks as geometry
from . import dtypes
from .arrays import byte_view
from .codecs import ChunkCodec, FrameSpan, get_codec
from .context import decode
from .digests import algorithm_of, digest_of
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DigestMismatchError,
    FieldNotFoundError,
    IncompleteCheckpointError,
    MissingFileError,
    SafetensorsHeaderError,
    SizeMismatchError,
    UnsafePathError,
    UsageError,
)
from .executor import ChunkRead, check_chunk, coalesce, fetch_runs, split_runs
from .fields import check_standard_field
from .manifest import (
    MAX_MANIFEST_BYTES,
    RAW,
    ChunkRecord,
    FieldRecord,
    Manifest,
    TensorRecord,
    checkpoint_id,
    parse_manifest,
)
from .paths import MANIFEST_NAME
from .plan import ReadItem, plan_region
from .safetensors_io import header_length, parse_header
from .storage import Store, open_store
from .verify import VerifyReport, verify_checkpoint


@dataclass(frozen=True, slots=True)
class Planned:
    """A chunk a region needs, and for an encoded chunk its codec and the frames the region touches."""

    item: ReadItem
    codec: ChunkCodec | None = None
    span: FrameSpan | None = None


def _plan_encoded(field: str, name: str, item: ReadItem, itemsize: int) -> Planned:
    """The frames of an encoded chunk that ``item`` touches, its frame index checked (the codec's refusals,
    a decompression bomb among them). An unknown codec refuses this tensor only (TEN-14)."""
    chunk = item.chunk
    where = {"path": chunk.path, "field": field, "tensor": name}
    codec = get_codec(chunk.codec.name, **where)
    # The raw bytes the region needs: from its first element to its last, in the chunk's C order.
    first = [s.start for s in item.source]
    last = [s.stop - 1 for s in item.source]
    raw_begin = int(np.ravel_multi_index(first, chunk.shape)) * itemsize
    raw_end = (int(np.ravel_multi_index(last, chunk.shape)) + 1) * itemsize
    raw_size = itemsize
    for d in chunk.shape:
        raw_size *= d
    try:
        span = codec.plan_frames(
            chunk.codec, stored_size=chunk.nbytes, raw_size=raw_size, raw_begin=raw_begin, raw_end=raw_end
        )
    except CheckpointError as exc:
        exc.locate(**where)
        raise
    return Planned(item, codec, span)


def _encoded_read(field: str, name: str, planned: Planned, target: memoryview, itemsize: int) -> ChunkRead:
    """A read of only the planned frames of an encoded chunk, decoded into ``target`` (the chunk's raw bytes)
    on the fetching thread."""
    chunk, codec, span = planned.item.chunk, planned.codec, planned.span
    assert codec is not None and span is not None

    def decode(stored: memoryview) -> None:
        codec.decode_into(chunk.codec, stored, span, target[span.raw_begin : span.raw_end], itemsize=itemsize)

    return ChunkRead(
        chunk=chunk,
        out=memoryview(bytearray(span.stored_end - span.stored_begin)),
        field=field,
        tensor=name,
        span=(chunk.begin + span.stored_begin, chunk.begin + span.stored_end),
        decode=decode,
    )


def _checked_plan(field: str, name: str, record: TensorRecord, region: geometry.Box, itemsize: int) -> list[Planned]:
    """The chunks a region needs, every encoded chunk's frame index planned and checked before anything is
    allocated: a chunk claiming more raw bytes than its codec can make of its stored ones (a decompression
    bomb) is refused here, not allocated for."""
    return [
        _plan_encoded(field, name, item, itemsize) if item.chunk.codec.name != RAW else Planned(item)
        for item in plan_region(record, region[0], region[1])
    ]


def read_manifest_bytes(store: Store) -> bytes:
    """The manifest's bytes, or the error that says why there is no committed checkpoint here."""
    try:
        return store.read(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES)
    except UnsafePathError as exc:  # a symlink, FIFO, directory... where manifest.json should be
        raise UnsafePathError(exc.message, path=MANIFEST_NAME, requirement="MAN-25") from exc
    except MissingFileError:
        present = [p for p in store.list() if p != MANIFEST_NAME]
        if present:
            raise IncompleteCheckpointError(
                f"{len(present)} file(s) but no manifest commits them: a writer crashed or is still running",
                path=store.url,
                requirement="COM-15",
            ) from None
        raise CheckpointNotFoundError("no checkpoint here", path=store.url) from None


class Checkpoint:
    """A committed, validated checkpoint. Obtain one with :func:`ckptfmt.open`."""

    def __init__(self, store: Store, manifest: Manifest, manifest_bytes: bytes) -> None:
        self.store = store
        self.manifest = manifest
        self.id = checkpoint_id(manifest_bytes)
        self._file_records = {f.path: f for f in manifest.files}
        self._files_checked: set[str] = set()
        self._chunks_by_file: dict[str, list[tuple[str, str, ChunkRecord]]] | None = None
        self.bytes_read = 0  # tensor bytes fetched so far (headers and context blobs not counted)

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def profile(self) -> str:
        return self.manifest.profile

    @property
    def format_version(self) -> str:
        return self.manifest.format_version

    @property
    def fields(self) -> Mapping[str, FieldRecord]:
        return self.manifest.fields

    def field(self, field: str) -> FieldRecord:
        try:
            return self.manifest.fields[field]
        except KeyError:
            raise FieldNotFoundError(
                f"no such field; the checkpoint has: {', '.join(self.manifest.fields)}", field=field
            ) from None

    def tensor_names(self, field: str) -> list[str]:
        return list(self.field(field).tensors)

    def tensor(self, field: str, name: str) -> TensorRecord:
        try:
            return self.field(field).tensors[name]
        except KeyError:
            raise FieldNotFoundError("no such tensor in this field", field=field, tensor=name) from None

    def read_tensor(self, field: str, name: str, *, verify: bool = True, mmap: bool = False) -> np.ndarray[Any, Any]:
        """The whole tensor as a writable numpy array (bf16/fp8 as ml_dtypes), assembled from its chunks.

        With ``mmap``, a tensor stored as one raw chunk on a local disk is returned as a read-only
        array mapped onto the data file (zero-copy: pages are read when touched; with ``verify`` the
        digest check touches them all now). Any other tensor is read as without ``mmap``.
        """
        record = self.tensor(field, name)
        if mmap:
            mapped = self._mapped(field, name, record, verify=verify)
            if mapped is not None:
                return mapped
        return self.read_slice(field, name, (0,) * len(record.shape), record.shape, verify=verify)

    def _mapped(self, field: str, name: str, record: TensorRecord, *, verify: bool) -> np.ndarray[Any, Any] | None:
        from .storage.local import LocalStore, open_below

        if not isinstance(self.store, LocalStore) or len(record.chunks) != 1:
            return None
        chunk = record.chunks[0]
        if chunk.codec.name != RAW or chunk.nbytes == 0:
            return None
        try:
            dtype = dtypes.to_numpy(record.dtype)
            self._check_data_file(chunk.path)
        except CheckpointError as exc:
            exc.locate(field=field, tensor=name)
            raise
        fd = open_below(self.store.root, chunk.path)
        try:
            mapping = mmap_module.mmap(fd, 0, access=mmap_module.ACCESS_READ)
        finally:
            os.close(fd)
        if len(mapping) != self._file_records[chunk.path].size:  # the file changed since it was checked
            raise SizeMismatchError(f"file has {len(mapping)} bytes now", path=chunk.path, field=field, tensor=name)
        array = np.frombuffer(mapping, dtype=dtype, count=chunk.nbytes // dtype.itemsize, offset=chunk.begin)
        if verify:
            try:
                check_chunk(chunk, memoryview(mapping)[chunk.begin : chunk.end])
            except CheckpointError as exc:
                exc.locate(field=field, tensor=name)
                raise
        self.bytes_read += chunk.nbytes
        return array.reshape(record.shape)

    def read_slice(
        self,
        field: str,
        name: str,
        offsets: Sequence[int],
        shape: Sequence[int],
        *,
        verify: bool = True,
    ) -> np.ndarray[Any, Any]:
        """The region ``[offsets, offsets + shape)`` of a tensor, reading only the chunks it touches."""
        record = self.tensor(field, name)
        region = (tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
        if (
            len(region[0]) != len(record.shape)
            or len(region[1]) != len(record.shape)
            or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(*region, record.shape, strict=True))
        ):
            raise UsageError(
                f"region {list(region[0])}+{list(region[1])} is outside shape {list(record.shape)}",
                field=field,
                tensor=name,
            )
        try:
            dtype = dtypes.to_numpy(record.dtype)
        except CheckpointError as exc:
            exc.locate(field=field, tensor=name)
            raise
        items = _checked_plan(field, name, record, region, dtype.itemsize)
        out = np.empty(region[1], dtype=dtype)
        if out.size == 0:
            return out
        reads, copies = self._plan_reads(field, name, record, region, out, items)
        self._fetch(reads, verify=verify, workers=4)  # chunks of several files (encoded ones: decoded) in parallel
        for buf, item in copies:
            out[item.target] = buf[item.source]
        return out

    def _plan_reads(
        self,
        field: str,
        name: str,
        record: TensorRecord,
        region: geometry.Box,
        out: np.ndarray[Any, Any],
        items: Sequence[Planned],
    ) -> tuple[list[ChunkRead], list[tuple[np.ndarray[Any, Any], ReadItem]]]:
        """The chunk reads that fill ``out`` with ``region``: straight into it where a chunk is exactly the
        region, else into a chunk-sized buffer that is copied from after the read."""
        reads: list[ChunkRead] = []
        copies: list[tuple[np.ndarray[Any, Any], ReadItem]] = []
        for planned in items:
            item = planned.item
            if item.direct:
                target = out
            else:
                target = np.empty(item.chunk.shape, dtype=out.dtype)
                copies.append((target, item))
            if planned.span is None:
                reads.append(ChunkRead(chunk=item.chunk, out=byte_view(target), field=field, tensor=name))
            else:
                reads.append(_encoded_read(field, name, planned, byte_view(target), out.dtype.itemsize))
        return reads, copies

    def _fetch(self, reads: list[ChunkRead], *, verify: bool, workers: int) -> None:
        """Check each data file once, then fetch the reads in coalesced runs, ``workers`` runs at a time."""
        by_file: dict[str, list[ChunkRead]] = {}
        for read in reads:
            by_file.setdefault(read.chunk.path, []).append(read)
        ahead: dict[str, bytearray] = {}
        if not self.store.capabilities.local:
            # Object stores: a file's header is fetched with its first run of chunks (the two are adjacent:
            # one request, not two) and checked before any chunk of that request is; sizes are checked
            # first, concurrently (a round trip each). Errors keep the order of the serial checks.
            unchecked = [p for p in sorted(by_file) if p not in self._files_checked]
            with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptfmt-check") as pool:
                sizes = list(pool.map(self._try_check_size, unchecked))
            for path, size in zip(unchecked, sizes, strict=True):
                if size is None:
                    break  # the serial check below raises that file's error
                ahead[path] = bytearray(self.header_span(path, size))
        for path, file_reads in sorted(by_file.items()):
            if path in ahead:
                continue
            try:
                self._check_data_file(path)
            except CheckpointError as exc:
                exc.locate(field=file_reads[0].field, tensor=file_reads[0].tensor)
                raise
        # One read_ranges call per group of runs: a file is opened once per group (local) or its ranges are
        # sent together (object stores); a large file is split into up to ``workers`` groups read in parallel.
        groups = [
            group
            for path in sorted(by_file)
            for group in split_runs(coalesce(by_file[path]), workers if len(by_file) < workers else 1)
        ]
        jobs = []
        for group in groups:
            path = group[0][0].chunk.path
            head = ahead.pop(path, None)  # the file's first group carries its header
            check = None if head is None else functools.partial(self._check_prefetched, path, head, group[0][0])
            prefix = () if head is None else ((0, memoryview(head)),)
            jobs.append(functools.partial(fetch_runs, self.store, group, verify=verify, prefix=prefix, check=check))
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                self.bytes_read += job()
            return
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-read") as pool:
            for future in [pool.submit(job) for job in jobs]:
                self.bytes_read += future.result()

    def _try_check_size(self, path: str) -> int | None:
        try:
            return self._check_size(path)
        except CheckpointError:
            return None

    def _check_prefetched(self, path: str, head: bytearray, first: ChunkRead) -> None:
        try:
            self._check_data_file(path, head)
        except CheckpointError as exc:
            exc.locate(field=first.field, tensor=first.tensor)
            raise

    def chunks_in(self, path: str) -> list[tuple[str, str, ChunkRecord]]:
        """(field, tensor, chunk) of every chunk the manifest places in data file ``path``."""
        if self._chunks_by_file is None:
            index: dict[str, list[tuple[str, str, ChunkRecord]]] = {}
            for fname, record in self.manifest.fields.items():
                for tname, tensor in record.tensors.items():
                    for chunk in tensor.chunks:
                        index.setdefault(chunk.path, []).append((fname, tname, chunk))
            self._chunks_by_file = index
        return self._chunks_by_file.get(path, [])

    def header_span(self, path: str, size: int) -> int:
        """The bytes of a data file its header should fill: up to where the manifest's first chunk begins."""
        return min(max(min((c.begin for _, _, c in self.chunks_in(path)), default=8), 8), size)

    def header_problems(self, path: str, size: int, head: bytearray | None = None) -> list[CheckpointError]:
        """Parse a data file's safetensors header (SAF-2..12) and compare it with the manifest (SAF-13).

        One ranged read (none if the caller fetched ``head``, the first :meth:`header_span` bytes, already):
        the manifest's first chunk begins where the header ends. Raises for a malformed header; returns one
        error per chunk the header contradicts.
        """
        placed = self.chunks_in(path)
        if head is None:
            head = bytearray(self.header_span(path, size))
            self.store.read_into(path, 0, memoryview(head))
        length = header_length(bytes(head[:8]), size, path)
        if len(head) < 8 + length:  # the manifest's hint was short (a file that disagrees with it)
            head = bytearray(8 + length)
            self.store.read_into(path, 0, memoryview(head))
        entries = parse_header(bytes(head[8 : 8 + length]), size, path)
        problems: list[CheckpointError] = []
        for fname, tname, chunk in placed:
            entry = entries.get(chunk.key)
            dtype = self.manifest.fields[fname].tensors[tname].dtype
            shape = chunk.shape
            if entry is not None and chunk.codec.name != RAW:
                # SAF-13 compares only the range of an encoded chunk (a U8 entry, COD-1): a codec this reader
                # does not know then refuses its tensor alone (TEN-14), never the file.
                dtype, shape = entry.dtype, entry.shape
            if entry is None:
                message = f"key {chunk.key!r} is not in the header"
            elif (entry.dtype, entry.shape, entry.begin, entry.end) != (dtype, shape, chunk.begin, chunk.end):
                message = (
                    f"header says {entry.dtype}{list(entry.shape)} at [{entry.begin}, {entry.end}), manifest says "
                    f"{dtype}{list(shape)} at [{chunk.begin}, {chunk.end})"
                )
            else:
                continue
            problems.append(SafetensorsHeaderError(message, path=path, field=fname, tensor=tname, requirement="SAF-13"))
        return problems

    def _check_data_file(self, path: str, head: bytearray | None = None) -> None:
        """Before the first read from a data file: its size (MAN-19) and header (SAF-2..13); once per open."""
        if path in self._files_checked:
            return
        actual = self._check_size(path)
        problems = self.header_problems(path, actual, head)
        if problems:
            raise problems[0]
        self._files_checked.add(path)

    def _check_size(self, path: str) -> int:
        actual = self.store.size(path)
        expected = self._file_records[path].size
        if actual != expected:
            raise SizeMismatchError(
                f"file has {actual} bytes, manifest says {expected}", path=path, requirement="MAN-19"
            )
        return actual

    def read_tensors(
        self, field: str, *, names: Sequence[str] | None = None, verify: bool = True, workers: int = 4
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Every tensor of a field (or those in ``names``). Neighbouring small chunks share one ranged
        request, and ``workers`` requests run in parallel (object stores gain most)."""
        out: dict[str, np.ndarray[Any, Any]] = {}
        reads: list[ChunkRead] = []
        copies: list[tuple[np.ndarray[Any, Any], ReadItem, np.ndarray[Any, Any]]] = []
        for name in self.tensor_names(field) if names is None else names:
            record = self.tensor(field, name)
            try:
                dtype = dtypes.to_numpy(record.dtype)
            except CheckpointError as exc:
                exc.locate(field=field, tensor=name)
                raise
            whole: geometry.Box = ((0,) * len(record.shape), record.shape)
            items = _checked_plan(field, name, record, whole, dtype.itemsize)
            array = out[name] = np.empty(record.shape, dtype=dtype)
            if array.size == 0:
                continue
            tensor_reads, tensor_copies = self._plan_reads(field, name, record, whole, array, items)
            reads.extend(tensor_reads)
            copies.extend((buf, item, array) for buf, item in tensor_copies)
        self._fetch(reads, verify=verify, workers=workers)
        for buf, item, array in copies:
            array[item.target] = buf[item.source]
        return out

    def iter_tensors(self, field: str, *, verify: bool = True) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        """One tensor at a time, so a caller can stream a field larger than memory."""
        for name in self.tensor_names(field):
            yield name, self.read_tensor(field, name, verify=verify)

    def has_context(self, field: str) -> bool:
        return self.field(field).context is not None

    def read_context(self, field: str) -> dict[str, object]:
        """A field's context map, digest-checked and (for standard fields) schema-checked."""
        path = self.field(field).context
        if path is None:
            raise FieldNotFoundError("field has no context blob", field=field)
        record = self._file_records[path]
        data = self.store.read(path, max_size=record.size)  # a larger file is refused unread (MAN-19)
        if len(data) != record.size:
            raise SizeMismatchError(f"blob has {len(data)} bytes, manifest says {record.size}", path=path, field=field)
        actual = digest_of(algorithm_of(record.digest), data)
        if actual != record.digest:
            raise DigestMismatchError(f"blob hashes to {actual}, manifest says {record.digest}", path=path, field=field)
        value = decode(data, path=path, field=field)
        try:
            check_standard_field(field, value)
        except CheckpointError as exc:
            exc.locate(path=path)
            raise
        return value

    def verify(self, *, quick: bool = False, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-read and re-hash everything; a report of every problem found, not just the first."""
        return verify_checkpoint(self, quick=quick, progress=progress)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.url} profile={self.profile} id={self.id[:19]}…>"


def open_checkpoint(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed checkpoint; refuses incomplete, invalid and unknown-major ones."""
    store = open_store(url, storage_options)
    data = read_manifest_bytes(store)
    try:
        manifest = parse_manifest(data)
    except CheckpointError as exc:
        exc.locate(path=MANIFEST_NAME)
        raise
    return Checkpoint(store, manifest, data)


def verify_url(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify whatever is at ``url``: a checkpoint that cannot even be opened is a report with that problem."""
    try:
        ckpt = open_checkpoint(url, storage_options)
    except CheckpointError as exc:
        report = VerifyReport(url=open_store(url, storage_options).url, quick=quick)
        report.add(exc)
        return report
    with ckpt:
        return verify_checkpoint(ckpt, quick=quick, progress=progress)
