"""Local disks, through the os module: fsync, rename, no symlinks followed, regular files only."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import MissingFileError, SizeMismatchError, StorageError, UnsafePathError
from .base import Capabilities, OutputFile, Store

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalOutput(OutputFile):
    def __init__(self, final: Path, rel: str) -> None:
        self._final = final
        self._rel = rel
        self._tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(6)}")
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        assert self._fd is not None, "write after commit/abort"
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc

    def commit(self) -> None:
        assert self._fd is not None, "commit after commit/abort"
        try:
            # An fsync error is final: a retried fsync may report success with the data lost.
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.rename(self._tmp, self._final)  # replaces an old file's entry; never truncates it
        except OSError as exc:
            self.abort()
            raise StorageError(f"could not make the file durable: {exc}", path=self._rel) from exc

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.url = str(self.root)
        self.capabilities = Capabilities(ranged_reads=True, exclusive_create=True, local=True)

    def _full(self, path: str) -> Path:
        return self.root.joinpath(*path.split("/"))

    def _open_read(self, path: str) -> int:
        """Open a file below the root following no symlink at any level; regular files only."""
        parts = path.split("/")
        try:
            dir_fd = os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            raise MissingFileError("file is missing", path=path) from None
        except OSError as exc:
            raise StorageError(f"cannot open checkpoint root {self.root}: {exc}", path=path) from exc
        try:
            for part in parts[:-1]:
                try:
                    next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
                except FileNotFoundError:
                    raise MissingFileError("file is missing", path=path) from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePathError(f"{part!r} is a symlink or not a directory", path=path) from exc
                    raise StorageError(f"cannot open directory {part!r}: {exc}", path=path) from exc
                os.close(dir_fd)
                dir_fd = next_fd
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                raise MissingFileError("file is missing", path=path) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePathError("is a symlink; readers follow none", path=path) from exc
                raise StorageError(f"cannot open: {exc}", path=path) from exc
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePathError("is not a regular file", path=path)
        return fd

    def create(self, path: str) -> OutputFile:
        final = self._full(path)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            return LocalOutput(final, path)
        except OSError as exc:
            raise StorageError(f"cannot create: {exc}", path=path) from exc

    def put_exclusive(self, path: str, data: bytes) -> None:
        final = self._full(path)
        out = self.create(path)
        assert isinstance(out, LocalOutput)
        out.write(data)
        try:
            assert out._fd is not None
            os.fsync(out._fd)
            os.close(out._fd)
            out._fd = None
            os.link(out._tmp, final)  # atomic and exclusive: fails if the name exists
        except FileExistsError:
            raise
        except OSError as exc:
            raise StorageError(f"could not write: {exc}", path=path) from exc
        finally:
            out.abort()  # drops the temp name; the linked file stays
        self.sync_dirs([path])

    def read(self, path: str) -> bytes:
        fd = self._open_read(path)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        fd = self._open_read(path)
        try:
            view = out.cast("B") if out.format != "B" else out
            pos = 0
            while pos < len(view):
                got = os.preadv(fd, [view[pos:]], begin + pos)
                if got == 0:
                    raise SizeMismatchError(
                        f"file ends before byte {begin + len(view)} (read {begin + pos})", path=path
                    )
                pos += got
        except OSError as exc:
            raise StorageError(f"read failed: {exc}", path=path) from exc
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        fd = self._open_read(path)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.lexists(self._full(path))

    def list(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if not self.root.is_dir():
            return out
        for dirpath, _dirnames, filenames in os.walk(self.root, followlinks=False):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                try:
                    out[rel] = os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
        return out

    def delete(self, path: str) -> None:
        try:
            os.unlink(self._full(path))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot delete: {exc}", path=path) from exc

    def remove_empty_dirs(self) -> None:
        if not self.root.is_dir():
            return
        for dirpath, _dirnames, _filenames in os.walk(self.root, topdown=False, followlinks=False):
            try:
                os.rmdir(dirpath)  # fails, harmlessly, on a directory that is not empty
            except OSError:
                pass

    def sync_dirs(self, paths: Iterable[str]) -> None:
        dirs = {self._full(p).parent for p in paths}
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            # A new subdirectory's own entry lives in its parent: sync up to the root.
            current = d
            while True:
                try:
                    _fsync_dir(current)
                except OSError as exc:
                    raise StorageError(f"fsync of directory {current} failed: {exc}") from exc
                if current == self.root or self.root not in current.parents:
                    break
                current = current.parent
