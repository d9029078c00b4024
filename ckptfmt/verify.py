"""Full verification of a checkpoint: every file re-read once, in bounded memory, every problem reported.

A client of the read executor (``read_executor``): one streaming scan per data file feeds the file digest,
every chunk digest and every block digest together; the file checks (``file_checks``) compare the
safetensors header with the manifest; context blobs are decoded and their standard rules (config hash
included) re-checked. Pages read are dropped from the page cache afterwards: a verification reads them once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import dtypes
from .blocks import Blocks
from .codecs import get_codec
from .context import decode
from .digest_checks import Span, SpanHasher, block_mismatch, digest_mismatch
from .digests import Hasher, algorithm_of, base_algorithm, format_digest, is_tree, new_hasher
from .errors import (
    CheckpointError,
    DigestMismatchError,
    MissingFileError,
    SizeMismatchError,
    UnsafePathError,
    UsageError,
)
from .fields import check_standard_field
from .file_checks import FileChecks
from .manifest import RAW, ChunkRecord, FieldRecord, FileRecord, Manifest
from .read_executor import ReadExecutor
from .storage import Store
from .tree_digests import LEAF_BYTES, FileTreeHasher, chunk_digest_from_pieces


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    code: str
    message: str
    path: str | None = None
    field: str | None = None
    tensor: str | None = None
    requirement: str | None = None  # the spec rule it breaks (conformance/README.md, strict protocol)

    @classmethod
    def from_error(cls, exc: CheckpointError) -> Problem:
        return cls(
            code=exc.code,
            message=exc.message,
            path=exc.path,
            field=exc.field,
            tensor=exc.tensor,
            requirement=exc.requirement,
        )

    def to_dict(self) -> dict[str, str]:
        out = {"code": self.code, "message": self.message}
        for key in ("path", "field", "tensor", "requirement"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def __str__(self) -> str:
        where = [f"{k} {v!r}" for k, v in (("file", self.path), ("field", self.field), ("tensor", self.tensor)) if v]
        return f"[{self.code}] {', '.join(where)}{': ' if where else ''}{self.message}"


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    url: str
    checkpoint_id: str | None = None
    quick: bool = False
    files_checked: int = 0
    bytes_checked: int = 0
    chunks_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, exc: CheckpointError) -> None:
        self.problems.append(Problem.from_error(exc))

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "checkpoint_id": self.checkpoint_id,
            "ok": self.ok,
            "quick": self.quick,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "chunks_checked": self.chunks_checked,
            "problems": [p.to_dict() for p in self.problems],
        }


@dataclass(frozen=True, slots=True)
class _Target:
    """What verification reads: a checkpoint's store, manifest and file checks."""

    url: str
    id: str
    store: Store
    manifest: Manifest
    checks: FileChecks
    executor: ReadExecutor

    @property
    def fields(self) -> Mapping[str, FieldRecord]:
        return self.manifest.fields


def verify_checkpoint(
    store: Store,
    manifest: Manifest,
    *,
    checkpoint_id: str,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
    workers: int = 4,
) -> VerifyReport:
    """Every problem of a checkpoint: ``workers`` data files are streamed (hashed, frames decoded) at once."""
    checks = FileChecks(store, manifest)
    executor = ReadExecutor(store, checks, keep_cached=False)
    try:
        return _verify(_Target(store.url, checkpoint_id, store, manifest, checks, executor), quick, progress, workers)
    finally:
        executor.close()


def _verify(ckpt: _Target, quick: bool, progress: Callable[[int], None] | None, workers: int) -> VerifyReport:
    report = VerifyReport(url=ckpt.url, checkpoint_id=ckpt.id, quick=quick)
    owners: dict[str, tuple[str, list[tuple[str, ChunkRecord]]]] = {}
    for fname, record in ckpt.fields.items():
        for tname, tensor in record.tensors.items():
            for chunk in tensor.chunks:
                owners.setdefault(chunk.path, (fname, []))[1].append((tname, chunk))
        if record.context is not None:
            owners.setdefault(record.context, (fname, []))
    present = ckpt.store.list()
    unusable = _add_bases(ckpt, report, present)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-verify")
    jobs: list[tuple[int, Future[VerifyReport]]] = []
    lock = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock:  # progress callbacks (a CLI bar) need not be thread-safe
                progress(n)

    for file in (*ckpt.manifest.files, *ckpt.manifest.referenced_files):
        if any(file.path.startswith(u + "/") for u in unusable):
            continue  # its base is gone or replaced: reported once, above
        fname, chunk_list = owners.get(file.path, ("", []))
        if file.path not in present or present[file.path] != file.size:
            # a symlink (PTH-3) or a special file (PTH-4) also looks missing or of another size: the
            # regular-file open of the store says which, before MAN-28 or MAN-19 is blamed
            try:
                _check_regular(ckpt, file.path)
            except CheckpointError as exc:
                report.add(exc.locate(path=file.path, field=fname or None))
                continue
        if file.path not in present:
            report.add(MissingFileError("file is missing", path=file.path, field=fname or None, requirement="MAN-28"))
            continue
        actual_size = present[file.path]
        if actual_size != file.size:
            report.add(
                SizeMismatchError(
                    f"file has {actual_size} bytes, manifest says {file.size}",
                    path=file.path,
                    field=fname or None,
                    requirement="MAN-19",
                )
            )
            if progress:
                progress(file.size)
            continue
        report.files_checked += 1
        if chunk_list:
            try:
                _check_header(ckpt, file.path, file.size, report)
            except CheckpointError as exc:  # a bad header must not hide what the digests find
                report.add(exc.locate(path=file.path, field=fname or None))
        # The streaming pass (digests, frames) of several files runs in parallel; its problems take this
        # file's place in the report, so the order is the same as a serial run's.
        jobs.append((len(report.problems), pool.submit(_check_contents, ckpt, file, chunk_list, fname, quick, tick)))
    pool.shutdown(wait=True)
    for position, job in reversed(jobs):
        sub = job.result()
        report.problems[position:position] = sub.problems
        report.bytes_checked += sub.bytes_checked
        report.chunks_checked += sub.chunks_checked
    for fname, record in ckpt.fields.items():
        if (
            record.context is None
            or record.context not in present
            or present[record.context] != ckpt.manifest.file(record.context).size
        ):
            continue
        try:
            size = ckpt.manifest.file(record.context).size
            value = decode(ckpt.store.read(record.context, max_size=size), path=record.context, field=fname)
            check_standard_field(fname, value)
        except CheckpointError as exc:
            report.add(exc.locate(path=record.context, field=fname))
    return report


def _add_bases(ckpt: _Target, report: VerifyReport, present: dict[str, int]) -> set[str]:
    """Check every base's identity (a problem naming both checkpoints if it is missing or replaced) and add
    the referenced files it holds to ``present`` under their virtual paths; returns the unusable locations."""
    unusable: set[str] = set()
    if not ckpt.manifest.bases:
        return unusable
    if not ckpt.store.capabilities.references:
        raise UsageError("a referencing checkpoint is verified through its reader (ckptfmt.open)")
    for base in ckpt.manifest.bases:
        try:
            listed = ckpt.store.base(base.location).list()
        except CheckpointError as exc:
            report.add(exc)
            unusable.add(base.location)
            continue
        present.update({base.virtual(f.path): listed[f.path] for f in base.files if f.path in listed})
    return unusable


def _check_regular(ckpt: _Target, path: str) -> None:
    """Refuse ``path`` if the store's regular-file open does: a symlink on the way (PTH-3), or not a
    regular file (PTH-4). A missing or unreadable file is left to the presence and size checks."""
    try:
        ckpt.store.size(path)
    except UnsafePathError as exc:
        if exc.requirement is not None:
            raise
        rule = {"symlink": "PTH-3", "file_kind": "PTH-4"}.get(exc.problem, "PTH-2")  # a store that names no rule
        raise UnsafePathError(exc.message, problem=exc.problem, path=path, requirement=rule) from exc
    except CheckpointError:
        pass


def _check_contents(
    ckpt: _Target,
    file: FileRecord,
    chunk_list: list[tuple[str, ChunkRecord]],
    fname: str,
    quick: bool,
    progress: Callable[[int], None],
) -> VerifyReport:
    """One data file's streaming checks: file and chunk digests in one pass (unless quick), then each
    encoded chunk's codec and frames. Runs on the verify pool; returns its own report."""
    sub = VerifyReport(url=ckpt.url, quick=quick)
    try:
        if not quick:
            _check_digests(ckpt, file.path, file.size, file.digest, chunk_list, fname, sub, progress)
            sub.bytes_checked += file.size
        else:
            progress(file.size)
    except CheckpointError as exc:
        sub.add(exc.locate(path=file.path, field=fname or None))
    for tname, chunk in chunk_list:
        if chunk.codec.name != RAW:
            try:
                _check_encoded(ckpt, fname, tname, chunk, decode_frames=not quick)
            except CheckpointError as exc:
                sub.add(exc.locate(path=file.path, field=fname or None, tensor=tname))
    return sub


def _check_encoded(ckpt: _Target, fname: str, tname: str, chunk: ChunkRecord, *, decode_frames: bool) -> None:
    """An encoded chunk: its codec is known (TEN-14) and its configuration places its frames (COD-4); unless
    quick, every frame is decoded, one at a time, as a reader would (COD-5)."""
    codec = get_codec(chunk.codec.name)
    count = 1
    for d in chunk.shape:
        count *= d
    itemsize = dtypes.itemsize(ckpt.fields[fname].tensors[tname].dtype)
    raw_size = count * itemsize
    begin = 0
    while True:
        span = codec.plan_frames(
            chunk.codec, stored_size=chunk.nbytes, raw_size=raw_size, raw_begin=begin, raw_end=min(raw_size, begin + 1)
        )
        if not decode_frames or span.raw_end <= begin:
            return
        stored = bytearray(span.stored_end - span.stored_begin)
        ckpt.store.read_into(chunk.path, chunk.begin + span.stored_begin, memoryview(stored))
        scratch = memoryview(bytearray(span.raw_end - span.raw_begin))
        codec.decode_into(chunk.codec, memoryview(stored), span, scratch, itemsize=itemsize)
        begin = span.raw_end


def _check_header(ckpt: _Target, path: str, size: int, report: VerifyReport) -> None:
    for problem in ckpt.checks.header_problems(path, size):
        report.add(problem)


def _check_digests(
    ckpt: _Target,
    path: str,
    size: int,
    digest: str,
    chunk_list: list[tuple[str, ChunkRecord]],
    fname: str,
    report: VerifyReport,
    progress: Callable[[int], None] | None,
) -> None:
    """One pass over the file feeding the file hasher and the spans of every chunk: its chunk digest, and its
    block digests (BLK-6: reported even when the chunk digest matches).

    Under a file tree digest (spec/tree-digests.md) the file hasher keeps the digests of every 64 KiB piece, and
    the chunks whose digests and blocks those give (the reference writer's, all of them) are checked from them:
    each byte is hashed once. The others get spans of their own, as under a flat file digest."""
    algorithm = algorithm_of(digest)
    tree = FileTreeHasher(algorithm, keep_pieces=True) if is_tree(algorithm) else None
    file_hasher: Hasher = tree if tree is not None else new_hasher(algorithm)
    derived = [(t, c) for t, c in chunk_list if tree is not None and _derivable(c, algorithm)]
    spans: list[Span] = []
    for tname, chunk in chunk_list:
        if tree is not None and _derivable(chunk, algorithm):
            continue
        if chunk.blocks is not None:
            spans.append(Span(chunk, first_block=0, rule="BLK-6", field=fname, tensor=tname))
        spans.append(Span(chunk, field=fname, tensor=tname))

    def done(span: Span) -> None:
        if span.first_block is None:
            report.chunks_checked += 1
        error = span.mismatch()
        if error is not None:
            report.add(error)

    chunks = SpanHasher(spans, done)

    def consume(pos: int, view: memoryview) -> None:
        file_hasher.update(view)
        chunks.update(pos, view)
        if progress:
            progress(len(view))

    ckpt.executor.scan(path, size, consume)
    chunks.close()
    for tname, chunk in derived:
        assert tree is not None
        held = tree.pieces.get(chunk.begin)
        if held is None or held[0] != chunk.end:
            # the file's header does not place the chunk (a problem the header checks report): hashed on its own
            _check_alone(ckpt, chunk, fname, tname, done)
            continue
        report.chunks_checked += 1
        found = Blocks(size=LEAF_BYTES, digests=held[1])
        actual = chunk_digest_from_pieces(algorithm_of(chunk.digest), chunk.nbytes, held[1])
        for error in (
            None if chunk.blocks is None else block_mismatch(chunk, found, 0, "BLK-6", fname, tname),
            digest_mismatch(chunk, actual, fname, tname),
        ):
            if error is not None:
                report.add(error)
    actual = format_digest(algorithm, file_hasher)
    if actual != digest:
        report.add(
            DigestMismatchError(
                f"file hashes to {actual}, manifest says {digest}", path=path, field=fname, requirement="DIG-4"
            )
        )


def _derivable(chunk: ChunkRecord, algorithm: str) -> bool:
    """Whether the pieces of a file tree under ``algorithm`` give ``chunk``'s digest and block digests."""
    own = algorithm_of(chunk.digest)
    return (
        base_algorithm(own) == base_algorithm(algorithm)
        and (is_tree(own) or chunk.nbytes <= LEAF_BYTES)
        and (chunk.blocks is None or chunk.blocks.size == LEAF_BYTES)
    )


def _check_alone(ckpt: _Target, chunk: ChunkRecord, fname: str, tname: str, done: Callable[[Span], None]) -> None:
    """A chunk's digests from its own bytes, read again: only where a broken header left its pieces unknown."""
    spans = [Span(chunk, field=fname, tensor=tname)]
    if chunk.blocks is not None:
        spans.append(Span(chunk, first_block=0, rule="BLK-6", field=fname, tensor=tname))
    buffer = memoryview(bytearray(min(max(chunk.nbytes, 1), 1 << 20)))
    for at in range(chunk.begin, chunk.end, len(buffer)):
        view = buffer[: min(len(buffer), chunk.end - at)]
        ckpt.store.read_into(chunk.path, at, view)
        for span in spans:
            span.hasher.update(view)
    for span in spans:
        done(span)
