"""Opening a committed checkpoint and reading tensors and context from it.

:func:`open_checkpoint` refuses anything incomplete, invalid or of an unknown major version before
the caller sees a single tensor. Reads are planned (``read_plan``: only the chunks, and of chunks with
block digests only the blocks, a region needs) and run by the read executor (``read_executor``), which
checks every byte it returns against a digest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

from . import dtypes
from .bases import open_base
from .context import decode
from .digest_checks import check_chunk
from .digests import algorithm_of
from .errors import (
    CheckpointError,
    DigestMismatchError,
    FieldNotFoundError,
    SizeMismatchError,
)
from .fields import check_standard_field
from .file_checks import FileChecks
from .manifest import (
    RAW,
    FieldRecord,
    Manifest,
    TensorRecord,
    checkpoint_id,
)
from .manifest_io import read_manifest_bytes as read_manifest_bytes  # (its old home: still importable here)
from .manifest_parse import parse_manifest
from .paths import MANIFEST_NAME
from .read_executor import ReadExecutor, default_workers
from .read_plan import ReadPlan, Target, plan_read, whole
from .storage import Store, open_store
from .storage.routed import RoutedStore
from .tree_digests import file_digest_of
from .verify import VerifyReport, verify_checkpoint


class Checkpoint:
    """A committed, validated checkpoint. Obtain one with :func:`ckptfmt.open`."""

    def __init__(self, store: Store, manifest: Manifest, manifest_bytes: bytes) -> None:
        self.manifest = manifest
        self.id = checkpoint_id(manifest_bytes)
        if manifest.bases:
            # Referenced chunks are read through the same plan and checks, their files routed to the base,
            # which is opened (and its identity checked, REF-7/8) when one of its bytes is first needed.
            def base(location: str) -> Store:
                return open_base(store, manifest, location, referrer=self.id)

            store = RoutedStore(store, base)
        self.store = store
        self._file_records = {f.path: f for f in (*manifest.files, *manifest.referenced_files)}
        self.checks = FileChecks(store, manifest)
        self._executor = ReadExecutor(store, self.checks)
        # Page cache (local disks): False (the default) drops what a read brought in once the bytes are in their
        # arrays: a checkpoint is read once, and should not evict what the training job keeps cached (its
        # dataset), nor slow the loads after it (docs/benchmarks.md, bench/multirank.py). True keeps them, for a
        # caller that reads the same bytes again soon.
        self.keep_cached = False

    @property
    def bytes_read(self) -> int:
        """Stored tensor bytes fetched so far (headers and context blobs not counted)."""
        return self._executor.bytes_read

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

        With ``mmap``, a tensor stored as one raw chunk in a store that can map files (a local disk) is returned
        as a read-only array mapped onto the data file (zero-copy: pages are read when touched; with ``verify``
        the digest check touches them all now). Any other tensor is read as without ``mmap``, and so is every
        tensor of a memory slot, whose files are rewritten in place: a map would show the next snapshot's bytes
        after their digest check, or fault (SIGBUS) once the file is cut shorter (storage/slot.py).
        """
        record = self.tensor(field, name)
        if mmap:
            mapped = self._mapped(field, name, record, verify=verify)
            if mapped is not None:
                return mapped
        return self.read_regions([whole(field, name, record)], verify=verify)[0]

    def _mapped(self, field: str, name: str, record: TensorRecord, *, verify: bool) -> np.ndarray[Any, Any] | None:
        if len(record.chunks) != 1:
            return None
        chunk = record.chunks[0]
        if chunk.codec.name != RAW or chunk.nbytes == 0:
            return None
        try:
            dtype = dtypes.to_numpy(record.dtype)
            self.checks.check(chunk.path)
            mapping = self.store.mapping(chunk.path)
        except CheckpointError as exc:
            exc.locate(field=field, tensor=name)
            raise
        if mapping is None:
            return None
        if len(mapping) != self._file_records[chunk.path].size:  # the file changed since it was checked
            raise SizeMismatchError(f"file has {len(mapping)} bytes now", path=chunk.path, field=field, tensor=name)
        array = np.frombuffer(mapping, dtype=dtype, count=chunk.nbytes // dtype.itemsize, offset=chunk.begin)
        if verify:
            try:
                check_chunk(chunk, memoryview(mapping)[chunk.begin : chunk.end])
            except CheckpointError as exc:
                exc.locate(field=field, tensor=name)
                raise
        self._executor.bytes_read += chunk.nbytes
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
        """The region ``[offsets, offsets + shape)`` of a tensor. Only the chunks it touches are read, and of a
        chunk with block digests only the blocks it touches, each checked (spec/blocks.md)."""
        record = self.tensor(field, name)
        target = Target(field, name, record.dtype, tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
        return self.read_regions([target], verify=verify)[0]

    def read_regions(
        self,
        targets: Sequence[Target],
        *,
        verify: bool = True,
        workers: int | None = None,
        into: Sequence[np.ndarray[Any, Any]] | None = None,
    ) -> list[np.ndarray[Any, Any]]:
        """Several regions of several tensors in one plan: every file's pieces read together (adjacent ranges
        merged by the store), ``workers`` reads in flight (default: the store's, see ``default_workers``), each
        piece checked before anything is returned.

        ``into``: an array per target to fill in place (C-contiguous, writable, the target's shape, its dtype or
        unsigned integers of the same width); if a check fails, they hold part of what was read. To change
        memory only when every byte is good, :meth:`check_regions` first."""
        plan = self._plan(targets, verify=verify, workers=workers)
        self._executor.keep_cached = self.keep_cached
        return self._executor.fill(plan, verify=verify, into=into)

    def check_regions(self, targets: Sequence[Target], *, workers: int | None = None) -> None:
        """Read and check every byte :meth:`read_regions` of ``targets`` would use, keeping none of it (bounded
        memory). The bytes stay in the page cache, so a ``read_regions(..., into=...)`` that follows copies them
        from memory, checking them again: together, a load in place that touches nothing unless all of it is
        good. Raw chunks only (a UsageError for an encoded one, which is checked by decoding it).

        If the check fails, what it read leaves the page cache again (unless :attr:`keep_cached`); so does what
        it read if the fill does not follow, by :meth:`forget_regions`."""
        plan = self._plan(targets, verify=True, workers=workers)
        try:
            self._executor.check(plan)
        except BaseException:
            if not self.keep_cached:
                self._executor.forget(plan)
            raise

    def forget_regions(self, targets: Sequence[Target]) -> None:
        """Drop from the page cache what :meth:`check_regions` of ``targets`` left there, when the fill it was
        for will not come (a load refused after the check): a checkpoint read once does not stay cached, as
        after a fill. Nothing if :attr:`keep_cached`, or where the store keeps no cache."""
        if not self.keep_cached and targets:
            self._executor.forget(self._plan(targets, verify=True, workers=None))

    def _plan(self, targets: Sequence[Target], *, verify: bool, workers: int | None) -> ReadPlan:
        records = {(t.field, t.tensor): self.tensor(t.field, t.tensor) for t in targets}
        self._executor.workers = default_workers(self.store) if workers is None else max(1, workers)
        return plan_read(records, targets, verify=verify)

    def read_tensors(
        self, field: str, *, names: Sequence[str] | None = None, verify: bool = True, workers: int | None = None
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Every tensor of a field (or those in ``names``), read as one plan (see :meth:`read_regions`)."""
        chosen = self.tensor_names(field) if names is None else list(names)
        targets = [whole(field, name, self.tensor(field, name)) for name in chosen]
        return dict(zip(chosen, self.read_regions(targets, verify=verify, workers=workers), strict=True))

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
        actual = file_digest_of(algorithm_of(record.digest), data)
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
        return verify_checkpoint(self.store, self.manifest, checkpoint_id=self.id, quick=quick, progress=progress)

    def close(self) -> None:
        self._executor.close()
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
    return open_store_checkpoint(open_store(url, storage_options))


def open_store_checkpoint(store: Store) -> Checkpoint:
    """:func:`open_checkpoint` of a store already open (the checkpoint owns it from here)."""
    data = read_manifest_bytes(store)
    try:
        manifest = parse_manifest(data)
    except CheckpointError as exc:
        exc.locate(path=MANIFEST_NAME)
        raise
    return Checkpoint(store, manifest, data)


def open_for_verify(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    quick: bool = False,
    raise_if: Callable[[CheckpointError], bool] | None = None,
) -> Checkpoint | VerifyReport:
    """The checkpoint at ``url`` to verify, or, when it cannot be opened, the report of why: an unopenable
    checkpoint (nothing there, incomplete, an invalid manifest or unknown major...) is a report, not an error.

    ``raise_if``: the errors the caller treats as its own instead (``ckpt verify``: nothing at the URL and
    failing storage, which exit as usage errors). A URL no store can be opened for raises as for
    :func:`open_checkpoint`.
    """
    store = open_store(url, storage_options)
    try:
        return open_store_checkpoint(store)
    except CheckpointError as exc:
        store.close()
        if raise_if is not None and raise_if(exc):
            raise
        report = VerifyReport(url=store.url, quick=quick)
        report.add(exc)
        return report


def verify_url(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify whatever is at ``url``: a checkpoint that cannot even be opened is a report with that problem
    (:func:`open_for_verify`)."""
    opened = open_for_verify(url, storage_options, quick=quick)
    if isinstance(opened, VerifyReport):
        return opened
    with opened:
        return opened.verify(quick=quick, progress=progress)
