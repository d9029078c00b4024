"""Where an exporter writes: one rule for every foreign format.

The names an exporter writes are its own constants or come from the checkpoint (Accelerate's sampler
and custom-object files are named by its ``accelerate`` context): every one is untrusted and held to
the path rule of reads (relative, '/'-separated, no '', '.' or '..' segment, so no absolute path and
nothing above the destination), refused with :class:`UnsafePathError` before a byte is written.

A local destination directory must hold no symlink or special file: a writer going through fsspec or
torch (DCP) would write through it, and ``--overwrite`` must never mean "overwrite whatever a link
points at". Each file ckptfmt itself writes is then opened below the destination one directory at a
time, ``O_NOFOLLOW`` at every level, so a symlink placed after the check is refused, not followed.
The destination the user named (a directory, or the ``.ckpt`` file's directory) is followed as given.

An overwrite replaces a *name*, never the file behind it: each local file is written under a temp name
beside its final one, fsync'd, and renamed over it (as LocalStore saves), so an old file that is a hard
link to a file outside the destination (``cp -al`` and ``rsync --link-dest`` trees, dedup tools) keeps
its bytes there. A DCP export, which torch writes itself (``open(..., "wb")`` through any such link),
goes into a fresh directory inside the destination, whose files are then renamed into place.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from ..errors import StorageError, UnsafePathError
from ..storage.base import split_path
from ..storage.direct import write_all
from ..storage.local import LocalStore, kind_of, open_dir_below, scan_dir, unlink_if_present, walk_to_parent
from .base import Location, fs_call, refuse_existing, refuse_links

_STAGING_PREFIX = ".export-staging-"  # the fresh directory a DCP export is written into (staged_directory)


class Sink(Protocol):
    """What :func:`open_output` yields: a file being written."""

    def write(self, data: bytes | memoryview, /) -> object: ...


def check_name(out: Location, name: object) -> str:
    """``name`` if it is a plain relative path below ``out``, else UnsafePathError naming both."""
    if not isinstance(name, str) or "\\" in name:
        raise UnsafePathError(f"refusing to write {name!r}: not a plain relative file name", path=out.url)
    try:
        split_path(name)
    except UnsafePathError as exc:
        raise UnsafePathError(
            f"refusing to write {name!r}: {exc.message} (no '..', no absolute path)", path=out.url
        ) from exc
    return name


def prepare_directory(out: Location, names: Iterable[str], *, overwrite: bool) -> None:
    """Before an export writes ``names`` into the directory ``out``: every name checked, a local destination
    holding a symlink or special file refused, existing files refused unless ``overwrite``; then ``out`` made."""
    checked = [check_name(out, name) for name in names]
    refuse_links(out)
    refuse_existing(out, checked, overwrite)
    fs_call(out.url, out.fs.makedirs, out.path, exist_ok=True)


@contextmanager
def open_output(out: Location, name: str) -> Iterator[Sink]:
    """The file ``name`` below the destination ``out``, to be written; it replaces the old file of that name when
    the block ends without an error (locally: a new file renamed over the name, durable before it is visible)."""
    target = out.join(check_name(out, name))
    if target.root is None:  # an object store's PUT replaces the object whole: no link to write through
        with fs_call(target.url, out.fs.open, target.path, "wb") as f:
            yield f
        return
    output = _create_local(target.root, target.rel, target.url)
    try:
        yield output
    except BaseException:
        output.abort()
        raise
    output.commit()  # fsync, then rename over the old name (which keeps its inode's other names intact)
    LocalStore(target.root, direct_io=False).sync_dirs([target.rel])


def write_output(out: Location, name: str, data: bytes) -> None:
    """Write ``data`` as the file ``name`` below ``out`` (see :func:`open_output`)."""
    target = out.join(check_name(out, name))
    if target.root is None:
        fs_call(target.url, out.fs.pipe_file, target.path, data)
        return
    with open_output(out, name) as f:
        f.write(data)


def _refuse_odd(dir_fd: int, leaf: str, url: str) -> None:
    """Refuse a symlink, directory or special file at ``leaf``: the rename would replace a symlink rather than
    write through it, but an export names what it finds in its way rather than silently removing it."""
    try:
        mode = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"cannot inspect: {exc}", path=url) from exc
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"is {kind_of(mode)}; exports write through nothing", path=url)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _ReplacingFile:
    """A temp file ``.<leaf>.tmp-<12 hex>`` beside ``leaf`` in the directory held by ``dir_fd`` (owned: closed on
    commit or abort), written straight through, fsync'd and renamed over ``leaf`` on commit. No staging buffers:
    an export writes each byte once and its memory must grow with a tensor, not with two 32 MiB buffers a file."""

    def __init__(self, dir_fd: int, leaf: str, url: str) -> None:
        self._dir_fd: int | None = dir_fd
        self._leaf = leaf
        self._url = url
        self._tmp = f".{leaf}.tmp-{secrets.token_hex(6)}"
        try:
            self._fd: int | None = os.open(self._tmp, _CREATE, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            self._dir_fd = None
            raise StorageError(f"cannot create a temp file: {exc}", path=url) from exc

    def write(self, data: bytes | memoryview, /) -> None:
        assert self._fd is not None, "write after commit/abort"
        try:
            write_all(self._fd, memoryview(data).cast("B"))
        except OSError as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._url) from exc

    def commit(self) -> None:
        assert self._fd is not None and self._dir_fd is not None, "commit after commit/abort"
        try:
            os.fsync(self._fd)  # durable before it is visible under the name
            os.close(self._fd)
            self._fd = None
            # replaces the old entry (never truncates it: its other hard links keep their bytes)
            os.rename(self._tmp, self._leaf, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as exc:
            self.abort()
            raise StorageError(f"could not write: {exc}", path=self._url) from exc
        os.close(self._dir_fd)
        self._dir_fd = None

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            unlink_if_present(self._tmp, self._dir_fd)
            os.close(self._dir_fd)
            self._dir_fd = None


def _create_local(root: str, rel: str, url: str) -> _ReplacingFile:
    """A temp file beside ``rel`` below ``root`` (no symlink followed at any level, directories made as needed),
    renamed over ``rel`` on commit; a symlink, directory or special file at ``rel`` refused."""
    try:
        dir_fd, leaf = walk_to_parent(root, rel, create=True)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{exc.message}; exports write through nothing", path=url) from exc
    except StorageError as exc:
        raise StorageError(exc.message, path=url) from exc
    try:
        _refuse_odd(dir_fd, leaf, url)
    except BaseException:
        os.close(dir_fd)
        raise
    return _ReplacingFile(dir_fd, leaf, url)  # owns dir_fd from here, closed even on failure


@contextmanager
def staged_directory(out: Location, *, last: str) -> Iterator[str]:
    """A fresh, empty local directory inside ``out`` for a writer that opens its own files (torch's DCP writer);
    when the block ends without an error, each of its files is renamed over its name in ``out`` (``last`` after
    the others), then ``out`` is fsync'd. The directory is removed either way.

    The writer must make its files durable itself (torch fsyncs each one); what is renamed is never truncated,
    so an old file of the same name that is a hard link to a file outside keeps its bytes there.
    """
    assert out.root is not None, "a local destination"
    refuse_links(out)
    fs_call(out.url, out.fs.makedirs, out.path, exist_ok=True)
    try:
        staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out.path)
    except OSError as exc:
        raise StorageError(f"cannot make a staging directory: {exc}", path=out.url) from exc
    try:
        yield staging
        _publish(out, os.path.basename(staging), last)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # our own fresh directory; rmtree follows no symlink


def _publish(out: Location, staging: str, last: str) -> None:
    """Rename every file of ``out``'s subdirectory ``staging`` over its name in ``out`` (``last`` last)."""
    assert out.root is not None
    try:
        dir_fd = open_dir_below(out.root, out.rel)
    except StorageError as exc:
        raise StorageError(exc.message, path=out.url) from exc
    try:
        src_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            entries = scan_dir(src_fd)
            for name, st in sorted(entries, key=lambda e: (e[0] == last, e[0])):
                url = out.join(name).url
                if not stat.S_ISREG(st.st_mode):
                    raise StorageError(f"the writer made {kind_of(st.st_mode)} here; exports write files", path=url)
                _refuse_odd(dir_fd, name, url)
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(src_fd)
        os.fsync(dir_fd)
    except OSError as exc:
        raise StorageError(f"cannot move the written files into place: {exc}", path=out.url) from exc
    finally:
        os.close(dir_fd)
