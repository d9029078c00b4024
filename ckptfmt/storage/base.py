"""The storage interface: a checkpoint root holding named byte blobs (spec/commit.md says how they are used).

Storage knows paths and bytes, never tensors or manifests. Call sequence of a writer:
``create(path)`` -> ``OutputFile.write``... -> ``commit()`` (or ``abort()``) for each data file,
``sync_dirs()``, then ``put_exclusive(manifest)``. A reader calls ``read``, ``read_into``,
``size`` and ``list``.
"""

from __future__ import annotations

import builtins
import mmap
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import UnsafePathError

# What ``Store.read`` refuses by default: it reads whole documents (manifest, context blobs, locks),
# never data files, so a huge (say sparse) file is refused before a byte of it is read.
DEFAULT_MAX_READ = 1 << 30


def split_path(path: str) -> list[str]:
    """The components of a relative '/'-separated path; refuses '', '.', '..', absolute paths and NUL (every
    store: a local one would leave its root, an object store's key would, through a client that normalizes)."""
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or "\0" in part:
            raise UnsafePathError("is not a plain relative path below the root", path=path, requirement="PTH-2")
    return parts


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    exclusive_create: bool  # put_exclusive is atomic against concurrent writers (else: a rename dance)
    local: bool  # a POSIX filesystem (fsync, rename, symlinks exist)
    # answers for the ``../<name>/`` paths of the checkpoints it references, and opens them with ``base``
    # (a reader's view of a referencing checkpoint, spec/references.md)
    references: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class FileInfo:
    """One entry of :meth:`Store.list_detail`."""

    size: int
    mtime: float | None = None  # seconds since the epoch, where the backend records it
    kind: str | None = None  # None: a regular file; else what it is ("a symlink", "a FIFO", ...: local disks)


class OutputFile(ABC):
    """A file being written. Nothing is visible under its final name before ``commit``."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable and visible under its final name (replacing, never truncating, an old one)."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; leaves nothing under the final name. Idempotent."""


class RangeReader:
    """Reads of one file through one handle, for as long as it is open (a context manager): a stream of reads, in
    order, keeps what the backend learns from it. This one reads through its store's ``read_ranges``; a local disk
    keeps one descriptor open for the reads that drop their pages, so the kernel's readahead follows the stream
    from read to read (with a descriptor per read it starts over each time, which is slower), and opens one per
    read for those that keep them (storage/local.py says why)."""

    def __init__(self, store: Store, path: str) -> None:
        self.store = store
        self.path = path

    def read_ranges(self, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        """As :meth:`Store.read_ranges`, for this reader's file."""
        self.store.read_ranges(self.path, requests, keep_cached=keep_cached)

    def close(self) -> None:
        """Release the handle; idempotent."""

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(ABC):
    """A checkpoint root: a local directory or an object-store prefix."""

    url: str
    capabilities: Capabilities

    @abstractmethod
    def create(self, path: str) -> OutputFile: ...

    @abstractmethod
    def put_exclusive(self, path: str, data: bytes) -> None:
        """Write ``data`` under ``path`` only if nothing is there; raise FileExistsError otherwise."""

    @abstractmethod
    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file; MissingFileError if absent, SizeMismatchError (before reading anything) if it
        is larger than ``max_size``. Callers reading a small document pass that document's own bound."""

    @abstractmethod
    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``begin``; SizeMismatchError if the file is shorter."""

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        """Fill each ``(begin, out)`` with the file's bytes from ``begin``: several ranges of one file in one
        call, so a backend opens the file once and merges what it can (one ``preadv`` per run of adjacent
        ranges locally, one GET per run on object stores). This is the one place ranges are merged.
        ``keep_cached=False``: the caller reads these bytes once; a backend with a page cache drops them."""
        for begin, out in requests:
            self.read_into(path, begin, out)

    def reader(self, path: str) -> RangeReader:
        """A :class:`RangeReader` of the file, for a stream of reads; errors as :meth:`read_ranges`'."""
        return RangeReader(self, path)

    def drop_cached(self, path: str, begin: int, end: int) -> None:  # noqa: B027 - only local disks cache
        """Drop the bytes ``[begin, end)`` of the file from a page cache the backend keeps (local disks): what a
        read with ``keep_cached=True`` left there for a second read that will not come."""

    def mapping(self, path: str) -> mmap.mmap | None:
        """A read-only memory map of the file, where the backend can map files (local disks); else None."""
        return None

    def sibling(self, name: str) -> Store:
        """The store of the directory ``name`` beside this root, in the same run directory (a base checkpoint,
        spec/references.md), reached the way this one is (same filesystem, same credentials)."""
        from ..errors import UsageError

        raise UsageError(f"{type(self).__name__} cannot open a sibling of {self.url}")

    def base(self, location: str) -> Store:
        """The store of the referenced checkpoint at ``location`` (``../<name>``), where
        ``capabilities.references``; opened (and its identity checked) on first use."""
        from ..errors import UsageError

        raise UsageError(f"{type(self).__name__} does not answer for referenced checkpoints ({location})")

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def list(self) -> dict[str, int]:
        """Every file below the root (relative path -> size), hidden ones included."""

    def list_detail(self) -> dict[str, FileInfo]:
        """:meth:`list` with each entry's modification time and kind, where the backend knows them."""
        return {path: FileInfo(size=size) for path, size in self.list().items()}

    def is_directory(self) -> bool:
        """Whether the root is a directory (an object store: whether any object lies below it)."""
        return bool(self.list())

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file; a missing one is not an error."""

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        """Unfinished multipart uploads below the root: (relative path, upload id). Object stores only."""
        return []

    def abort_upload(self, path: str, upload_id: str) -> None:  # noqa: B027
        """Abort an unfinished multipart upload (left by a killed writer)."""

    def remove_empty_dirs(self, under: str = "") -> None:  # noqa: B027
        """Remove directories left empty below ``under`` (a directory below the root; the root itself
        by default), ``under`` included (local disks only). Symlinks are never followed or removed."""

    def sync_dirs(self, paths: Iterable[str]) -> None:  # noqa: B027 - only local disks need it
        """Make the directory entries of these files durable (local disks: fsync the directories)."""

    def close(self) -> None:  # noqa: B027
        """Release cached handles."""
