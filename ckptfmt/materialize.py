"""Materialize: a self-contained copy of a checkpoint that references chunks of others (spec/references.md).

Every file is copied byte for byte, none decoded or re-encoded: the checkpoint's own under their own paths,
and each base file a referenced chunk lives in under a new name beside them, ``<field>/r<RANK>-<SEQ>.safetensors``
with a sequence number no file of the copy uses (LAY-1: ``ckpt gc`` knows the name as a writer's). A base file is
copied whole, also the chunks of it no tensor of this checkpoint uses (SAF-13 needs only this checkpoint's keys
in a header), so every chunk keeps its range, digest, codec and blocks. The manifest is the source's with the
referenced chunks pointed at their copies and no ``ckptfmt.references`` extension, committed as any save is
(:class:`~ckptfmt.commit.Committer`): lock, files, manifest create-only.

Each file is checked before it is copied (size and safetensors header against the manifest, and the base's
identity, REF-7/8, as a reader checks them) and its digest as it streams through, in buffers of
:data:`COPY_BUFFER` bytes (memory stays bounded whatever the file size); a mismatch aborts the copy.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .codecs.xor_zstd import NAME as XOR_ZSTD
from .commit import Committer
from .convert.base import Progress
from .digests import algorithm_of, format_digest
from .errors import DigestMismatchError, SizeMismatchError, UsageError
from .layout import DATA_SUFFIX, data_path
from .manifest import FieldRecord, FileRecord, Manifest, TensorRecord
from .paths import MANIFEST_NAME
from .storage import Store, open_store
from .tree_digests import file_hasher

if TYPE_CHECKING:
    from .reader import Checkpoint

COPY_BUFFER = 8 << 20  # per file in flight; a copy's memory is COPY_WORKERS of these
COPY_WORKERS = 4  # files copied at once (object stores: requests in flight; local disks: queue depth)
_DATA_NAME = re.compile(rf"r(\d{{5,}})-(\d{{5,}}){re.escape(DATA_SUFFIX)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Materialized:
    """What :func:`materialize_checkpoint` made."""

    checkpoint_id: str
    files: int  # files of the copy, manifest not counted
    bytes: int
    copied_from_bases: Mapping[str, str]  # base file (``../<name>/<path>``) -> its path in the copy
    bytes_from_bases: int

    def to_dict(self) -> dict[str, object]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "files": self.files,
            "bytes": self.bytes,
            "copied_from_bases": dict(self.copied_from_bases),
            "bytes_from_bases": self.bytes_from_bases,
        }


def plan_copies(manifest: Manifest) -> dict[str, str]:
    """Where each base file goes in the copy: virtual path (``../<name>/<path>``) -> a new own path.

    Pure. The field directory is that of the chunks referencing the file (one field a file, LAY-2), the rank
    the base file's own (rank 0 for a name not laid out by LAY-1), the sequence number the next one the copy's
    files of that field and rank leave free.
    """
    field_of = {
        c.path: fname
        for fname, record in sorted(manifest.fields.items())
        for t in record.tensors.values()
        for c in t.chunks
        if c.base is not None
    }
    taken = {f.path for f in manifest.files}
    next_seq: dict[tuple[str, int], int] = {}
    for path in taken:
        folder, _, name = path.rpartition("/")
        match = _DATA_NAME.fullmatch(name)
        if match:
            key = (folder, int(match[1]))
            next_seq[key] = max(next_seq.get(key, 0), int(match[2]) + 1)
    out: dict[str, str] = {}
    for record in manifest.referenced_files:
        if record.path not in field_of:
            continue  # a base file no chunk uses (REF-11 forbids listing one): nothing to copy
        field = field_of[record.path]
        match = _DATA_NAME.fullmatch(record.path.rpartition("/")[2])
        rank = int(match[1]) if match else 0
        seq = next_seq.get((field, rank), 0)
        while data_path(field, rank, seq) in taken:
            seq += 1
        out[record.path] = data_path(field, rank, seq)
        taken.add(out[record.path])
        next_seq[(field, rank)] = seq + 1
    return out


def self_contained(manifest: Manifest, copies: Mapping[str, str]) -> Manifest:
    """``manifest`` with each referenced chunk pointing at its file's copy (``copies``, :func:`plan_copies`),
    the copies among its files, and no bases. Pure."""
    referenced = {f.path: f for f in manifest.referenced_files}
    files = [*manifest.files, *(dataclasses.replace(referenced[v], path=p) for v, p in copies.items())]
    fields: dict[str, FieldRecord] = {}
    for fname, record in manifest.fields.items():
        tensors: dict[str, TensorRecord] = {}
        for tname, tensor in record.tensors.items():
            chunks = tuple(
                c if c.base is None else dataclasses.replace(c, path=copies[c.path], base=None) for c in tensor.chunks
            )
            tensors[tname] = dataclasses.replace(tensor, chunks=chunks)
        fields[fname] = dataclasses.replace(record, tensors=tensors)
    return dataclasses.replace(manifest, files=tuple(sorted(files, key=lambda f: f.path)), fields=fields, bases=())


def materialize(
    src_url: str | os.PathLike[str],
    dst_url: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Write at ``dst_url`` a self-contained copy of the checkpoint at ``src_url``: every chunk it references
    in another checkpoint stored in the copy, which then outlives its bases. Returns the copy's checkpoint id."""
    return materialize_checkpoint(src_url, dst_url, storage_options=storage_options, overwrite=overwrite).checkpoint_id


def materialize_checkpoint(
    src_url: str | os.PathLike[str],
    dst_url: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Materialized:
    """:func:`materialize`, reporting what it copied; ``progress`` hears the bytes to copy, then each buffer's."""
    from .reader import open_checkpoint

    with open_checkpoint(src_url, storage_options) as ckpt:
        dst = open_store(dst_url, storage_options)
        try:
            if dst.url.rstrip("/") == ckpt.url.rstrip("/"):
                raise UsageError("the copy must go elsewhere: materializing in place would replace the checkpoint")
            deltas = sorted(
                f"{fname}/{tname}"
                for fname, record in ckpt.manifest.fields.items()
                for tname, tensor in record.tensors.items()
                if any(c.codec.name == XOR_ZSTD for c in tensor.chunks)
            )
            if deltas:  # their bytes are a difference from a base's: copied byte for byte, they would need it still
                raise UsageError(
                    f"{len(deltas)} tensors are stored as deltas of a base (xor-zstd, spec/delta.md), e.g. "
                    f"{deltas[0]}: a byte-for-byte copy cannot be self-contained; `ckpt convert` the checkpoint "
                    "(decoded and written again) instead"
                )
            if overwrite:
                _check_replaceable(dst_url, dst, storage_options)
            copies = plan_copies(ckpt.manifest)
            manifest = self_contained(ckpt.manifest, copies)
            sources = {f.path: f.path for f in ckpt.manifest.files} | {p: v for v, p in copies.items()}
            advance = _serialized(progress, manifest.total_bytes)
            committer = Committer(dst, overwrite=overwrite)
            written: list[str] = []
            pool = ThreadPoolExecutor(max_workers=COPY_WORKERS, thread_name_prefix="ckptfmt-copy")
            try:
                jobs = [pool.submit(_copy, ckpt, sources[f.path], dst, f, advance, written) for f in manifest.files]
                for job in jobs:
                    job.result()
                ckpt_id = committer.commit(manifest, written)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the copies under way finish (or fail) before the clean-up
                committer.abort(written)
                raise
            finally:
                pool.shutdown()
        finally:
            dst.close()
    return Materialized(
        checkpoint_id=ckpt_id,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        copied_from_bases=copies,
        bytes_from_bases=sum(f.size for f in ckpt.manifest.referenced_files if f.path in copies),
    )


def _check_replaceable(dst_url: str | os.PathLike[str], dst: Store, options: Mapping[str, Any] | None) -> None:
    """A committed checkpoint at the destination that siblings reference stays (REF-14)."""
    from .run import check_replaceable_url

    if dst.exists(MANIFEST_NAME):
        check_replaceable_url(dst_url, options)


def _serialized(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """``progress`` started, then advanced by one copying thread at a time."""
    if progress is None:
        return None
    progress.start(total)
    lock = threading.Lock()

    def advance(amount: int) -> None:
        with lock:
            progress.advance(amount)

    return advance


def _copy(
    ckpt: Checkpoint,  # its store routes ``../<name>/`` paths to the base, checked on first use (REF-7/8)
    src_path: str,
    dst: Store,
    record: FileRecord,
    progress: Callable[[int], None] | None,
    written: list[str],
) -> None:
    """Copy one file, checked first as a reader checks it, its digest checked as it streams through."""
    if ckpt.checks.chunks_in(src_path):
        ckpt.checks.check(src_path)  # size (MAN-19), header (SAF-2..13); a base's identity first (REF-7/8)
    else:
        actual = ckpt.store.size(src_path)
        if actual != record.size:
            raise SizeMismatchError(
                f"file has {actual} bytes, manifest says {record.size}", path=src_path, requirement="MAN-19"
            )
    algorithm = algorithm_of(record.digest)
    hasher = file_hasher(algorithm)
    buffer = memoryview(bytearray(min(COPY_BUFFER, record.size)))
    out = dst.create(record.path)
    written.append(record.path)  # (list.append is atomic) aborting deletes it, whatever got written
    try:
        done = 0
        while done < record.size:
            part = buffer[: min(len(buffer), record.size - done)]
            ckpt.store.read_into(src_path, done, part)
            hasher.update(part)
            out.write(part)
            done += len(part)
            if progress is not None:
                progress(len(part))
        found = format_digest(algorithm, hasher)
        if found != record.digest:
            raise DigestMismatchError(
                f"file digest is {found}, the manifest says {record.digest}", path=src_path, requirement="DIG-4"
            )
        out.commit()
    except BaseException:
        out.abort()
        raise
