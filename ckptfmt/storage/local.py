"""Local disks, through the os module: fsync, rename, no symlinks followed, regular files only.

Every operation below the root walks from the root one directory at a time with directory file
descriptors opened ``O_NOFOLLOW`` (the ``dir_fd=`` variants of mkdir, open, rename, link, unlink,
rmdir), so a symlink or a non-directory anywhere below the root is refused with :class:`UnsafePathError`
(its ``problem`` says which) instead of being followed, and nothing can be read, written or deleted
outside the root. The root itself is the caller's path: a symlink there is the caller's choice.

Files are opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO would block a plain open forever) and refused
by ``fstat`` unless regular (FIFOs, sockets, devices, directories) before a byte is read.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import mmap
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import MissingFileError, SizeMismatchError, StorageError, UnsafePathError, UsageError
from .base import DEFAULT_MAX_READ, Capabilities, FileInfo, OutputFile, RangeReader, Store, split_path
from .direct import StagedWriter

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)  # a terminal device opened by mistake never becomes ours
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK | _NOCTTY
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC  # the root may be reached through a symlink
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
MAX_DEPTH = 256  # directory levels list() and remove_empty_dirs() descend; far beyond any checkpoint layout
# In a checkpoint's root: its data files are rewritten in place (a memory slot, storage/slot.py), so none is mapped.
# A leading dot: readers ignore it (LAY-4), whichever store opens the directory.
IN_PLACE_MARKER = ".ckptfmt-in-place"


def kind_of(mode: int) -> str:
    """What a non-regular directory entry is, for error messages."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _makedirs_durably(root: str) -> None:
    """Make ``root`` and its missing parents (the caller's own path: made as the OS resolves it), and fsync
    the parent of each one made: a directory's entry lives in its parent, so without that a power cut can
    lose the whole checkpoint root after its commit returned."""
    made: list[str] = []
    current = os.path.abspath(root)
    while not os.path.exists(current):
        made.append(current)
        current = os.path.dirname(current)
    os.makedirs(root, exist_ok=True)
    for directory in made:
        fd = os.open(os.path.dirname(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open_root(root: str, path: str, *, create: bool = False) -> int:
    try:
        try:
            return os.open(root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        _makedirs_durably(root)
        return os.open(root, _ROOT_FLAGS)
    except FileNotFoundError:
        raise MissingFileError(f"{root} does not exist", path=path) from None
    except OSError as exc:
        raise StorageError(f"cannot open root directory {root}: {exc}", path=path) from exc


def _open_dir(dir_fd: int, name: str, path: str, *, create: bool = False) -> int:
    """Open the directory ``name`` inside ``dir_fd`` without following a symlink (making it if asked)."""
    for _ in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise MissingFileError(f"directory {name!r} is missing", path=path) from None
            try:
                os.mkdir(name, 0o755, dir_fd=dir_fd)
            except FileExistsError:
                pass  # made meanwhile (another thread of the writer): open it
            except OSError as exc:
                raise StorageError(f"cannot make directory {name!r}: {exc}", path=path) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    what = kind_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
                except OSError:
                    what = "not a directory"
                linked = what == "a symlink"
                raise UnsafePathError(
                    f"component {name!r} is {what}; nothing below the root is followed",
                    problem="symlink" if linked else "file_kind",
                    path=path,
                    requirement="PTH-3" if linked else "PTH-4",
                ) from exc
            raise StorageError(f"cannot open directory {name!r}: {exc}", path=path) from exc
    raise StorageError(f"directory {name!r} keeps disappearing", path=path)


def unlink_if_present(name: str, dir_fd: int) -> None:
    """Remove the entry ``name`` of the directory open at ``dir_fd``; one already gone is no error."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def walk_to_parent(root: str, path: str, *, create: bool = False) -> tuple[int, str]:
    """(fd of the directory holding ``path``, owned by the caller; its last component), walked from
    ``root`` one directory at a time following nothing (making missing directories if asked)."""
    parts = split_path(path)
    fd = _open_root(root, path, create=create)
    try:
        for part in parts[:-1]:
            next_fd = _open_dir(fd, part, path, create=create)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


@contextmanager
def parent_dir(root: str, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """:func:`walk_to_parent` as a context manager that closes the directory."""
    fd, name = walk_to_parent(root, path, create=create)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _open_regular(dir_fd: int | None, name: str, path: str) -> int:
    """Open a regular file for reading; refuse a symlink (never followed), FIFO, socket, device or directory.

    ``O_NONBLOCK`` makes the open of a FIFO return at once instead of waiting for a writer; ``fstat``
    then refuses anything but a regular file before a byte is read, and the flag is cleared.
    """
    try:
        if dir_fd is None:  # the root itself is the file: the caller's own path (a symlink there is their choice)
            fd = os.open(name, os.O_RDONLY | _CLOEXEC | os.O_NONBLOCK | _NOCTTY)
        else:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MissingFileError("file is missing", path=path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                "is a symlink; readers follow none", problem="symlink", path=path, requirement="PTH-3"
            ) from exc
        if exc.errno == errno.ENXIO:  # a unix socket cannot be opened
            raise UnsafePathError(
                "is a socket, not a regular file", problem="file_kind", path=path, requirement="PTH-4"
            ) from exc
        raise StorageError(f"cannot open: {exc}", path=path) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(
                f"is {kind_of(mode)}, not a regular file", problem="file_kind", path=path, requirement="PTH-4"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # clears O_NONBLOCK (the only status flag it was opened with)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_below(root: str | os.PathLike[str], path: str = "") -> int:
    """A read-only fd of the regular file ``path`` below ``root``, following no symlink below ``root``.

    ``path`` empty means ``root`` itself is the file. Raises MissingFileError, UnsafePathError (a
    symlink, FIFO, socket, device or directory where a file is expected) or StorageError. This is the
    one way ckptfmt opens a local file it did not write, checkpoints and converter sources alike.
    """
    top = os.path.abspath(os.fspath(root))
    if not path:
        return _open_regular(None, top, top)
    with parent_dir(top, path) as (dir_fd, name):
        return _open_regular(dir_fd, name, path)


def open_dir_below(root: str | os.PathLike[str], path: str = "") -> int:
    """A directory fd of ``path`` below ``root`` (``root`` itself when empty), following no symlink below
    ``root``; MissingFileError, UnsafePathError (a symlink or non-directory on the way) or StorageError."""
    top = os.path.abspath(os.fspath(root))
    if not path:
        return _open_root(top, top)
    with parent_dir(top, path) as (dir_fd, name):
        return _open_dir(dir_fd, name, path)


def read_fd(fd: int, path: str, max_size: int) -> bytes:
    """The whole of an open file, refused (before reading anything) when larger than ``max_size``."""
    size = os.fstat(fd).st_size
    if size > max_size:
        raise SizeMismatchError(f"is {size} bytes, more than the {max_size} this file may have", path=path)
    chunks: list[bytes] = []
    got = 0
    try:
        while True:
            chunk = os.read(fd, min(max_size + 1 - got, 1 << 20) or 1)
            if not chunk:
                break
            got += len(chunk)
            if got > max_size:  # grew while being read
                raise SizeMismatchError(f"is more than the {max_size} bytes this file may have", path=path)
            chunks.append(chunk)
    except OSError as exc:
        raise StorageError(f"read failed: {exc}", path=path) from exc
    return b"".join(chunks)


def pread_exact(fd: int, path: str, begin: int, out: memoryview) -> None:
    """Fill ``out`` from byte ``begin``; SizeMismatchError if the file is shorter."""
    view = out.cast("B") if out.format != "B" else out
    pos = 0
    try:
        while pos < len(view):
            got = os.preadv(fd, [view[pos:]], begin + pos)
            if got == 0:
                raise SizeMismatchError(f"file ends before byte {begin + len(view)} (read {begin + pos})", path=path)
            pos += got
    except OSError as exc:
        raise StorageError(f"read failed: {exc}", path=path) from exc


def merge_adjacent(requests: Sequence[tuple[int, memoryview]]) -> builtins.list[tuple[int, builtins.list[memoryview]]]:
    """Runs of back-to-back ranges, each read by one ``preadv`` into its views (at most ``IOV_MAX`` of them)."""
    runs: builtins.list[tuple[int, builtins.list[memoryview]]] = []
    end = -1
    for begin, out in sorted(requests, key=lambda r: r[0]):
        view = out.cast("B") if out.format != "B" else out
        if not len(view):
            continue
        if runs and begin == end and len(runs[-1][1]) < _IOV_MAX:
            runs[-1][1].append(view)
        else:
            runs.append((begin, [view]))
        end = begin + len(view)
    return runs


def preadv_exact(fd: int, path: str, begin: int, views: Sequence[memoryview]) -> None:
    """Fill ``views`` back to back from byte ``begin``; SizeMismatchError if the file is shorter."""
    todo = builtins.list(views)
    total = sum(len(v) for v in todo)
    pos = 0
    try:
        while todo:
            got = os.preadv(fd, todo, begin + pos)
            if got == 0:
                raise SizeMismatchError(f"file ends before byte {begin + total} (read {begin + pos})", path=path)
            pos += got
            while todo and got >= len(todo[0]):
                got -= len(todo[0])
                todo.pop(0)
            if todo and got:
                todo[0] = todo[0][got:]
    except OSError as exc:
        raise StorageError(f"read failed: {exc}", path=path) from exc


def scan_dir(dir_fd: int) -> builtins.list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of an open directory. An entry removed between the directory's read and its
    lstat (another writer's temporary file renamed into place) is not listed: it is gone, as if listed a moment
    later, where before it failed the listing."""
    out: builtins.list[tuple[str, os.stat_result]] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    return out


def lstat_children(directory: str | os.PathLike[str]) -> builtins.list[tuple[str, os.stat_result]]:
    """(name, lstat) of each entry directly inside ``directory``; empty if it is no directory."""
    try:
        fd = os.open(os.fspath(directory), _ROOT_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise StorageError(f"cannot list {os.fspath(directory)}: {exc}") from exc
    try:
        return scan_dir(fd)
    except OSError as exc:
        raise StorageError(f"cannot list {os.fspath(directory)}: {exc}") from exc
    finally:
        os.close(fd)


def walk_lstat(root: str | os.PathLike[str]) -> dict[str, os.stat_result]:
    """Every non-directory entry below ``root`` -> its lstat, walked with directory fds following no
    symlink (a symlink to a directory is an entry, not descended into); empty if ``root`` is no directory."""
    out: dict[str, os.stat_result] = {}
    try:
        fd = os.open(os.fspath(root), _ROOT_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return out
    except OSError as exc:
        raise StorageError(f"cannot list {os.fspath(root)}: {exc}") from exc
    try:
        _walk_into(fd, "", out, 0)
    finally:
        os.close(fd)
    return out


def _walk_into(dir_fd: int, prefix: str, out: dict[str, os.stat_result], depth: int) -> None:
    try:
        entries = scan_dir(dir_fd)
    except OSError as exc:
        raise StorageError(f"cannot list: {exc}", path=prefix or None) from exc
    for name, st in entries:
        rel = prefix + name
        if not stat.S_ISDIR(st.st_mode):
            out[rel] = st
            continue
        if depth >= MAX_DEPTH:
            raise UnsafePathError(f"directories nest deeper than {MAX_DEPTH} levels", path=rel)
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as exc:
            raise StorageError(f"cannot open directory: {exc}", path=rel) from exc
        try:
            _walk_into(child, rel + "/", out, depth + 1)
        finally:
            os.close(child)


def _read_ranges_on(fd: int, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool) -> None:
    for begin, views in merge_adjacent(requests):
        preadv_exact(fd, path, begin, views)
        if not keep_cached and _DONTNEED is not None:
            os.posix_fadvise(fd, begin, sum(len(v) for v in views), _DONTNEED)


class _LocalReader(RangeReader):
    """One descriptor, opened as every read here is (no symlink followed, a regular file), for the reads that drop
    their pages as they go; a read that keeps them opens one of its own.

    Dropping the pages, one descriptor is the faster (the kernel's readahead follows the stream); keeping them, a
    descriptor per read is faster and steadier, its readahead starting over at each read and reading exactly it
    (docs/benchmarks.md has the figures)."""

    def __init__(self, store: Store, path: str, fd: int) -> None:
        super().__init__(store, path)
        self._fd = fd

    def read_ranges(self, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        if self._fd < 0:
            raise UsageError(f"{self.path}: read through a closed reader")
        if keep_cached:
            self.store.read_ranges(self.path, requests)
        else:
            _read_ranges_on(self._fd, self.path, requests, keep_cached=False)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalOutput(OutputFile):
    """A temp file ``.<name>.tmp-<12 hex>`` beside the final name, in a directory held open by fd; written
    through a staging buffer, around the page cache when ``direct`` (storage/direct.py)."""

    def __init__(self, dir_fd: int, name: str, rel: str, *, direct: bool = True) -> None:
        self._dir_fd: int | None = dir_fd  # owned: closed on commit or abort
        self._name = name
        self._rel = rel
        self._tmp = f".{name}.tmp-{secrets.token_hex(6)}"
        try:
            self._fd: int | None = os.open(self._tmp, _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            self._dir_fd = None
            raise
        self._staged = StagedWriter(self._fd, direct=direct)

    def write(self, data: bytes | memoryview) -> None:
        assert self._fd is not None, "write after commit/abort"
        try:
            self._staged.write(memoryview(data).cast("B"))
        except OSError as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc

    def _sync_and_close(self) -> None:
        assert self._fd is not None, "commit after commit/abort"
        self._staged.finish()
        # An fsync error is final: a retried fsync may report success with the data lost.
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None

    def commit(self) -> None:
        try:
            self._sync_and_close()
            assert self._dir_fd is not None
            # Replaces an old file's entry (a symlink there is replaced, never written through); never truncates.
            os.rename(self._tmp, self._name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as exc:
            self.abort()
            raise StorageError(f"could not make the file durable: {exc}", path=self._rel) from exc
        self._release()

    def link_exclusive(self) -> None:
        """Publish by ``link``: atomic and exclusive, FileExistsError if the final name exists."""
        try:
            self._sync_and_close()
            assert self._dir_fd is not None
            os.link(self._tmp, self._name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as exc:
            raise StorageError(f"could not write: {exc}", path=self._rel) from exc
        finally:
            self.abort()  # drops the temp name; the linked file stays

    def abort(self) -> None:
        self._staged.release()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            unlink_if_present(self._tmp, self._dir_fd)
            self._release()

    def _release(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


class LocalStore(Store):
    """``direct_io``: write data files around the page cache where the filesystem allows (storage/direct.py)."""

    def __init__(self, root: str | os.PathLike[str], *, direct_io: bool = True) -> None:
        self.direct_io = direct_io
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.url = str(self.root)
        self.capabilities = Capabilities(exclusive_create=True, local=True)

    def sibling(self, name: str) -> LocalStore:
        # The root is resolved as the OS resolves it (PTH: "given by the user"), so "../name" is a sibling of
        # the directory the root is, whatever link it was given through (REF-15, spec/notes/gaps-1.2.md N10).
        path = Path(os.path.realpath(self.root)).parent / name
        if path.is_symlink():  # a base is a directory of the run directory, never a way out of it (REF-7)
            raise UnsafePathError(f"{name!r} beside {self.url} is a symbolic link", problem="symlink", path=str(path))
        return LocalStore(path, direct_io=self.direct_io)

    def _open_read(self, path: str) -> int:
        dir_fd, name = walk_to_parent(self.url, path)
        try:
            return _open_regular(dir_fd, name, path)
        finally:
            os.close(dir_fd)

    def create(self, path: str) -> OutputFile:
        dir_fd, name = walk_to_parent(self.url, path, create=True)  # LocalOutput owns (and closes) dir_fd
        try:
            return LocalOutput(dir_fd, name, path, direct=self.direct_io)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError("a symlink is in the way of the temp file", problem="symlink", path=path) from exc
            raise StorageError(f"cannot create: {exc}", path=path) from exc

    def put_exclusive(self, path: str, data: bytes) -> None:
        out = self.create(path)
        assert isinstance(out, LocalOutput)
        out.write(data)
        out.link_exclusive()
        try:
            self.sync_dirs([path])
        except StorageError:
            # Not durable, so not published: take the name back (it is ours, linked exclusively just now), or
            # a failed save would leave a manifest, or a lock, that nobody holds.
            self.delete(path)
            raise

    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        fd = self._open_read(path)
        try:
            return read_fd(fd, path, max_size)
        finally:
            os.close(fd)

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        self.read_ranges(path, [(begin, out)])

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        fd = self._open_read(path)  # one walk and one open for every range of the file
        try:
            _read_ranges_on(fd, path, requests, keep_cached=keep_cached)
        finally:
            os.close(fd)

    def reader(self, path: str) -> RangeReader:
        return _LocalReader(self, path, self._open_read(path))

    def drop_cached(self, path: str, begin: int, end: int) -> None:
        if _DONTNEED is None or end <= begin:
            return
        fd = self._open_read(path)
        try:
            os.posix_fadvise(fd, begin, end - begin, _DONTNEED)
        finally:
            os.close(fd)

    def mapping(self, path: str) -> mmap.mmap | None:
        """A read-only map of the file; None for an empty file, and for every file of a root that holds
        :data:`IN_PLACE_MARKER`: a shared map shows a rewrite in place (bytes changed after their digest was
        checked), and a file cut shorter under it kills the process with SIGBUS. Checked after mapping, not
        before: a writer makes the marker before its first rewrite in place, and never rewrites in place a file
        older than the marker (:class:`~ckptfmt.storage.slot.SlotStore`), so a marker still absent once the map
        exists means this file is never rewritten under it."""
        fd = self._open_read(path)
        try:
            if os.fstat(fd).st_size == 0:
                return None
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if os.path.lexists(self.root / IN_PLACE_MARKER):
            mapped.close()
            return None
        return mapped

    def size(self, path: str) -> int:
        fd = self._open_read(path)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        try:
            with parent_dir(self.url, path) as (dir_fd, name):
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except (MissingFileError, FileNotFoundError):
            return False
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot stat: {exc}", path=path) from exc
        return True

    def list(self) -> dict[str, int]:
        """Every non-directory entry below the root (symlinks, to directories too, and special files
        included: they are reported, never followed), relative path -> lstat size."""
        return {rel: st.st_size for rel, st in walk_lstat(self.url).items()}

    def list_detail(self) -> dict[str, FileInfo]:
        return {
            rel: FileInfo(
                size=st.st_size, mtime=st.st_mtime, kind=None if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode)
            )
            for rel, st in walk_lstat(self.url).items()
        }

    def is_directory(self) -> bool:
        return os.path.isdir(self.url)

    def delete(self, path: str) -> None:
        try:
            with parent_dir(self.url, path) as (dir_fd, name):
                os.unlink(name, dir_fd=dir_fd)  # a symlink is removed itself, never what it points to
        except (MissingFileError, FileNotFoundError):
            pass
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot delete: {exc}", path=path) from exc

    def remove_empty_dirs(self, under: str = "") -> None:
        try:
            if not under:
                fd = os.open(self.url, _ROOT_FLAGS)
                try:
                    self._prune(fd, 0)
                finally:
                    os.close(fd)
                os.rmdir(self.url)
                return
            with parent_dir(self.url, under) as (parent_fd, name):
                fd = _open_dir(parent_fd, name, under)
                try:
                    self._prune(fd, 0)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=parent_fd)
        except (MissingFileError, UnsafePathError):
            pass  # nothing there, or not a directory of ours: nothing to remove
        except OSError:
            pass  # not empty (or not ours to remove): left alone

    def _prune(self, dir_fd: int, depth: int) -> None:
        """Remove the empty real directories below an open directory, deepest first; symlinks are left."""
        if depth >= MAX_DEPTH:
            return
        for name, st in scan_dir(dir_fd):
            if not stat.S_ISDIR(st.st_mode):
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                self._prune(child, depth + 1)
            finally:
                os.close(child)
            try:
                os.rmdir(name, dir_fd=dir_fd)  # fails, harmlessly, on a directory that is not empty
            except OSError:
                pass

    def sync_dirs(self, paths: Iterable[str]) -> None:
        # Every directory holding one of these files, and its parents up to the root (a new
        # subdirectory's own entry lives in its parent): deepest first, each once.
        dirs: set[tuple[str, ...]] = {()}
        for path in paths:
            parts = tuple(split_path(path)[:-1])
            dirs.update(parts[:i] for i in range(len(parts) + 1))
        fds: dict[tuple[str, ...], int] = {}
        try:
            fds[()] = _open_root(self.url, "")
            for d in sorted(dirs, key=len):
                if d:
                    fds[d] = _open_dir(fds[d[:-1]], d[-1], "/".join(d))
            for d in sorted(dirs, key=len, reverse=True):
                try:
                    os.fsync(fds[d])
                except OSError as exc:
                    shown = os.path.join(self.url, *d)
                    raise StorageError(f"fsync of directory {shown} failed: {exc}") from exc
        finally:
            for fd in fds.values():
                os.close(fd)
