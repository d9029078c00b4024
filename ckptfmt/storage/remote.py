"""Any fsspec filesystem (memory://, gcs://, ...). Object stores publish a file in one step on close.

S3's own ways (multipart uploads with parts in flight, checked ranged GETs, HTTP 412 read as a lost race,
unfinished uploads) are :class:`~ckptfmt.storage.s3.S3Store`'s, a subclass chosen for ``s3://`` URLs.
"""

from __future__ import annotations

import builtins
import itertools
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from ..errors import CheckpointError, MissingFileError, SizeMismatchError, StorageError
from .base import DEFAULT_MAX_READ, Capabilities, FileInfo, OutputFile, Store, split_path

# Filesystems whose writes become visible only when complete (multipart upload), so a failed write
# can be discarded without ever appearing under the final name.
_ATOMIC_PUT = {"s3", "s3a", "gcs", "gs", "abfs", "az"}
PART_SIZE = 16 << 20  # block size of a streamed upload (S3: storage/s3.py PART_SIZE)
READ_PIECE = 64 << 20  # the largest ranged GET: longer runs of neighbouring ranges are split, fetched together
# The object an exclusive-create probe writes and deletes (FsspecStore._probe_create_only): the temp name of a
# manifest, so `ckpt gc` recognises one a killed process leaves behind as a writer's (ckptfmt/run.py).
PROBE_NAME = ".manifest.json.tmp-{token}"
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "created")  # what fsspec backends call it


def caused_by(exc: BaseException, test: Callable[[BaseException], bool]) -> bool:
    """Whether ``test`` holds for ``exc`` or any exception in its cause/context chain (cycles and very long
    chains cut short): the type of an error, never its text, says what happened."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 32:
        seen.add(id(current))
        if test(current):
            return True
        current = current.__cause__ or current.__context__
    return False


class _FsspecOutput(OutputFile):
    """A file of an fsspec filesystem opened for writing at ``opened`` (for ``rel``); a write that fails aborts."""

    def __init__(self, fs: Any, opened: str, rel: str, **open_options: Any) -> None:
        self._rel = rel
        try:
            self._file: Any = fs.open(opened, "wb", **open_options)
        except Exception as exc:
            raise StorageError(f"cannot create: {exc}", path=rel) from exc

    def write(self, data: bytes | memoryview) -> None:
        assert self._file is not None, "write after commit/abort"
        try:
            self._file.write(data)
        except Exception as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc


class DirectOutput(_FsspecOutput):
    """Streams into the final name; the object store publishes it on close, discards on abort."""

    def __init__(self, fs: Any, full: str, rel: str) -> None:
        super().__init__(fs, full, rel, block_size=PART_SIZE)

    def commit(self) -> None:
        assert self._file is not None, "commit after commit/abort"
        try:
            self._file.close()
        except Exception as exc:
            self.abort()
            raise StorageError(f"upload failed: {exc}", path=self._rel) from exc
        self._file = None

    def abort(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.discard()  # aborts the multipart upload instead of publishing a truncated object
        except Exception:
            pass
        file.closed = True  # never let close() (or the finalizer) publish what was written


class RenameOutput(_FsspecOutput):
    """Writes under a hidden temp name, renames into place on commit."""

    def __init__(self, fs: Any, full: str, rel: str) -> None:
        self._fs = fs
        self._full = full
        head, _, name = full.rpartition("/")
        self._tmp = f"{head}/.{name}.tmp-{secrets.token_hex(6)}"
        super().__init__(fs, self._tmp, rel)

    def commit(self) -> None:
        assert self._file is not None, "commit after commit/abort"
        try:
            self._file.close()
            self._file = None
            self._fs.mv(self._tmp, self._full)
        except Exception as exc:
            self.abort()
            raise StorageError(f"could not publish: {exc}", path=self._rel) from exc

    def abort(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:
                pass
            self._file = None
        try:
            self._fs.rm_file(self._tmp)
        except Exception:
            pass


def plan_gets(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranged GETs that fetch sorted ``[begin, end)`` ranges: neighbouring (or overlapping) ranges share
    one GET, since every request costs a round trip; a run longer than ``READ_PIECE`` is cut into equal
    pieces fetched concurrently, since one stream of an object store is slower than several."""
    runs: list[tuple[int, int]] = []
    for begin, end in ranges:
        if runs and begin <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(end, runs[-1][1]))
        else:
            runs.append((begin, end))
    gets: list[tuple[int, int]] = []
    for begin, end in runs:
        pieces = -(-(end - begin) // READ_PIECE)
        bounds = [begin + (end - begin) * i // pieces for i in range(pieces + 1)]
        gets.extend(itertools.pairwise(bounds))
    return gets


Fill = list[tuple[int, memoryview]]  # (offset in a GET, destination) pieces, in order


def _fills(gets: Sequence[tuple[int, int]], todo: Sequence[tuple[int, memoryview]]) -> list[Fill]:
    """For each GET, the ``(offset in the GET, destination)`` pieces its bytes fill, in order."""
    fills: list[Fill] = [[] for _ in gets]
    index = 0
    for begin, view in todo:
        while gets[index][1] <= begin:
            index += 1
        at, piece = begin, index
        while at < begin + len(view):
            start, end = gets[piece]
            take = min(end, begin + len(view)) - at
            fills[piece].append((at - start, view[at - begin : at - begin + take]))
            at += take
            piece += 1
    return fills


def _mtime(info: Mapping[str, Any]) -> float | None:
    for key in _MTIME_KEYS:
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None


class FsspecStore(Store):
    """A prefix of any fsspec filesystem. Subclasses (S3) replace how bytes travel (``_output``, ``_head``,
    ``_fetch``) and how a lost create race reads (``_lost_race``), never what the interface promises."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.capabilities = Capabilities(exclusive_create=bool(_ATOMIC_PUT.intersection(protocols)), local=False)
        # whether the store was seen to refuse a create-only PUT over an existing object (_probe_create_only)
        self._create_only_checked = not self.capabilities.exclusive_create
        self._probe_lock = threading.Lock()

    def _full(self, path: str) -> str:
        """The object key of ``path``, refused (UnsafePathError, PTH-2) unless it is a plain relative path: a
        key is not a path, but a proxy or another client that collapses ``..`` would reach outside the root.
        Called before any ``try`` that turns exceptions into storage errors."""
        split_path(path)
        return f"{self.root}/{path}"

    def sibling(self, name: str) -> FsspecStore:
        parent = self.root.rpartition("/")[0]
        url = self.url.rstrip("/")
        return type(self)(self.fs, f"{parent}/{name}", f"{url.rpartition('/')[0]}/{name}")

    def _wrap(self, exc: Exception, path: str, doing: str, *, writing: bool = False) -> Exception:
        where = f"{self.url.rstrip('/')}/{path}" if path else self.url
        if isinstance(exc, FileNotFoundError):
            if writing:  # on a write, "not found" means the bucket (or container) is missing
                return StorageError(f"{doing} failed: no such bucket or location for {where}", path=path)
            return MissingFileError("file is missing", path=path)
        if isinstance(exc, PermissionError):
            return StorageError(f"{doing} failed: access denied to {where}: {exc}", path=path)
        return StorageError(f"{doing} failed for {where}: {type(exc).__name__}: {exc}", path=path)

    def create(self, path: str) -> OutputFile:
        full = self._full(path)
        try:
            return self._output(full, path)
        except StorageError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            raise self._wrap(cause, path, "create", writing=True) from exc

    def _output(self, full: str, path: str) -> OutputFile:
        if self.capabilities.exclusive_create:  # uploads appear whole: no temporary name needed
            return DirectOutput(self.fs, full, path)
        return RenameOutput(self.fs, full, path)

    def put_exclusive(self, path: str, data: bytes) -> None:
        """Create-only (S3: ``If-None-Match: *``). Before a store's first one, the store is seen to honour it
        (``_probe_create_only``): a store that ignores the condition would let two writers both commit."""
        if not self._create_only_checked:
            with self._probe_lock:
                if not self._create_only_checked:
                    self._probe_create_only(path)
                    self._create_only_checked = True
        self._put_create_only(path, data)

    def _lost_race(self, exc: BaseException) -> bool:
        """Whether a create-only write failed because the object exists."""
        return caused_by(exc, lambda e: isinstance(e, FileExistsError))

    def _put_create_only(self, path: str, data: bytes) -> None:
        full = self._full(path)
        try:
            self.fs.pipe_file(full, data, mode="create")
        except FileExistsError:
            raise
        except Exception as exc:
            if self._lost_race(exc):
                raise FileExistsError(path) from exc
            raise self._wrap(exc, path, "exclusive write", writing=True) from exc

    def _probe_create_only(self, path: str) -> None:
        """Write a probe object, then create-only again over it: that must fail as a lost race (HTTP 412).
        A store (or a proxy before it) that drops ``If-None-Match`` overwrites instead, and is refused.

        A probe, not a read-back of the manifest after its PUT: a read-back sees the writer's own bytes even
        when a second writer overwrites them a moment later, so it cannot tell a store that honours the
        condition from one that does not. Three requests, once per store; the probe is deleted either way.
        A refusal names ``path``, the lock or manifest that was about to be written.
        """
        probe = PROBE_NAME.format(token=secrets.token_hex(6))
        where = f"{self.url.rstrip('/')}/"
        try:
            try:
                self._put_create_only(probe, b"probe")
            except FileExistsError as exc:  # not a lost race: nothing had that name
                raise StorageError(
                    f"{where} refused a create-only PUT of a new object ({probe}) as if it existed (HTTP 412)",
                    path=path,
                ) from exc
            try:
                self._put_create_only(probe, b"probe")
            except FileExistsError:
                return  # refused, as it must be
            raise StorageError(
                f"{where} does not honour conditional writes: a create-only PUT (If-None-Match: *) replaced "
                "an existing object instead of failing with 412, so two writers could both commit here and "
                "one save would silently disappear; refusing to write a lock or manifest to this store",
                path=path,
            )
        finally:
            try:
                self.delete(probe)
            except StorageError:
                pass  # a leftover probe is a writer's temp file to `ckpt gc`

    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        size = self.size(path)
        if size > max_size:
            raise SizeMismatchError(f"is {size} bytes, more than the {max_size} this file may have", path=path)
        if size == 0:
            return b""  # a ranged GET of an empty object is "not satisfiable"
        try:
            # Ranged, so an object replaced meanwhile by a bigger one still costs at most max_size + 1 bytes.
            data = self._head(path, max_size + 1)
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._wrap(exc, path, "read") from exc
        if len(data) > max_size:
            raise SizeMismatchError(f"is more than the {max_size} bytes this file may have", path=path)
        return data

    def _head(self, path: str, limit: int) -> bytes:
        """The file's first bytes, at most ``limit`` of them."""
        return bytes(self.fs.cat_file(self._full(path), start=0, end=limit))

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" else out
        full = self._full(path)
        if not len(view):
            return
        try:
            data = self.fs.cat_file(full, start=begin, end=begin + len(view))
        except Exception as exc:
            raise self._wrap(exc, path, "ranged read") from exc
        if len(data) != len(view):
            raise SizeMismatchError(f"file ends before byte {begin + len(view)}", path=path)
        view[:] = data

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        todo = sorted(
            ((begin, out.cast("B") if out.format != "B" else out) for begin, out in requests if len(out)),
            key=lambda r: r[0],
        )
        self._full(path)  # refused here, not wrapped below
        if not todo:
            return
        gets = plan_gets([(begin, begin + len(view)) for begin, view in todo])
        fills = _fills(gets, todo)
        try:
            blobs = self._fetch(path, gets, todo, fills)
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._wrap(exc, path, "ranged read") from exc
        if blobs is None:
            return
        for (start, end), data, fill in zip(gets, blobs, fills, strict=True):
            if isinstance(data, Exception):
                raise self._wrap(data, path, "ranged read") from data
            if len(data) != end - start:
                raise SizeMismatchError(f"file ends before byte {end}", path=path)
            for offset, view in fill:
                view[:] = memoryview(data)[offset : offset + len(view)]

    def _fetch(
        self, path: str, gets: Sequence[tuple[int, int]], todo: Sequence[tuple[int, memoryview]], fills: list[Fill]
    ) -> builtins.list[Any] | None:
        """The bytes (or the exception) of each of ``gets``; None when they were put into ``fills`` already."""
        # one call: fsspec sends the GETs together (concurrently on async backends)
        blobs: builtins.list[Any] = self.fs.cat_ranges(
            [self._full(path)] * len(gets), [g[0] for g in gets], [g[1] for g in gets]
        )
        return blobs

    def size(self, path: str) -> int:
        full = self._full(path)
        try:
            return int(self.fs.size(full))
        except Exception as exc:
            raise self._wrap(exc, path, "stat") from exc

    def exists(self, path: str) -> bool:
        full = self._full(path)
        try:
            return bool(self.fs.exists(full))
        except Exception as exc:
            raise self._wrap(exc, path, "stat") from exc

    def is_directory(self) -> bool:
        try:
            return bool(self.fs.isdir(self.root))
        except Exception as exc:
            raise self._wrap(exc, "", "stat") from exc

    def list(self) -> dict[str, int]:
        return {path: info.size for path, info in self.list_detail().items()}

    def list_detail(self) -> dict[str, FileInfo]:
        try:
            self.fs.invalidate_cache(self.root)
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._wrap(exc, "", "listing") from exc
        prefix = self.root + "/"
        out: dict[str, FileInfo] = {}
        for name, info in found.items():
            if name.startswith(prefix) and info.get("type", "file") == "file":
                out[name[len(prefix) :]] = FileInfo(size=int(info.get("size") or 0), mtime=_mtime(info))
        return out

    def delete(self, path: str) -> None:
        full = self._full(path)
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._wrap(exc, path, "delete", writing=True) from exc
