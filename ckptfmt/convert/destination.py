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
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import StorageError, UnsafePathError
from ..storage.base import split_path
from ..storage.local import kind_of, walk_to_parent
from .base import Location, fs_call, refuse_existing, refuse_links

_WRITE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_TRUNC
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | os.O_NONBLOCK  # a FIFO fails to open (ENXIO) instead of blocking until a reader comes
    | getattr(os, "O_NOCTTY", 0)
)


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
def open_output(out: Location, name: str) -> Iterator[BinaryIO]:
    """The file ``name`` below the destination ``out``, opened to be written (created or truncated)."""
    target = out.join(check_name(out, name))
    if target.root is None:
        with fs_call(target.url, out.fs.open, target.path, "wb") as f:
            yield f
        return
    fd = _open_local(target.root, target.rel, target.url)
    with os.fdopen(fd, "wb") as f:
        yield f


def write_output(out: Location, name: str, data: bytes) -> None:
    """Write ``data`` as the file ``name`` below ``out`` (see :func:`open_output`)."""
    target = out.join(check_name(out, name))
    if target.root is None:
        fs_call(target.url, out.fs.pipe_file, target.path, data)
        return
    with open_output(out, name) as f:
        f.write(data)


def _open_local(root: str, rel: str, url: str) -> int:
    """A write fd of the regular file ``rel`` below ``root``: no symlink followed at any level, directories
    made as needed, a FIFO, socket or device refused."""
    try:
        dir_fd, leaf = walk_to_parent(root, rel, create=True)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{exc.message}; exports write through nothing", path=url) from exc
    except StorageError as exc:
        raise StorageError(exc.message, path=url) from exc
    try:
        fd = os.open(leaf, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            try:
                what = kind_of(os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                what = "not a regular file"
            raise UnsafePathError(f"is {what}; exports write through nothing", path=url) from exc
        raise StorageError(f"cannot open for writing: {exc}", path=url) from exc
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"is {kind_of(mode)}; exports write regular files only", path=url)
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # clears O_NONBLOCK
    except BaseException:
        os.close(fd)
        raise
    return fd
