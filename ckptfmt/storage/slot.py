"""A memory-tier slot: a local directory (tmpfs, ``/dev/shm``) whose data files are rewritten in place.

A slot holds one checkpoint at a time and is overwritten by the next snapshot but one (spec/memory.md).
Writing a new temp file per snapshot and renaming it over the old one, as :class:`LocalStore` does for
durable saves, would give every snapshot freshly allocated (zeroed, faulted) tmpfs pages and free the
old ones: on a training node that costs more than the copy itself. Here a data file keeps its inode:
it is opened without truncation, written from offset 0 and cut to the length written, so the pages of
the previous snapshot are reused.

This is safe because of the commit protocol, not the storage: the writer un-commits the slot (deletes
its manifest) before the first byte of a new snapshot is written, so files rewritten in place are
never under a manifest that lists them with other digests; a process killed mid-snapshot leaves an
uncommitted slot (no manifest), which readers refuse and restores skip. Nothing here is fsync'd: the
memory tier survives a crashed process (tmpfs pages outlive it), not a lost node or a power cut, which
is what replicas and durable saves are for.

What the commit protocol cannot cover is a reader that maps a data file (``read_tensor(mmap=True)``): a
shared map shows the next snapshot's bytes after the digest check, and a file cut shorter under it kills
the reader with SIGBUS. So no file that is rewritten in place is ever mapped: a slot store maps nothing,
and before its first rewrite in place a writer makes the marker :data:`~ckptfmt.storage.local.IN_PLACE_MARKER`
in the slot's root, which any :class:`LocalStore` opened on the directory sees and then copies instead of
mapping. A file older than the marker may be mapped by a reader that saw none: it is replaced by a fresh
inode (that reader keeps the old bytes), never rewritten in place. The marker is never removed, nor listed.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Iterable

from ..errors import StorageError, UnsafePathError
from .base import Capabilities, FileInfo, OutputFile
from .direct import write_all
from .local import IN_PLACE_MARKER, LocalOutput, LocalStore, unlink_if_present, walk_lstat, walk_to_parent

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_REWRITE_FLAGS = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC  # no O_TRUNC: keep the pages
_MARKER_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK


class InPlaceOutput(OutputFile):
    """A file rewritten from offset 0 under its final name, cut to the bytes written at :meth:`commit`."""

    def __init__(self, dir_fd: int, name: str, rel: str) -> None:
        self._rel = rel
        self._dir_fd: int | None = dir_fd
        self._name = name
        try:
            self._fd: int | None = os.open(name, _REWRITE_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            self._dir_fd = None
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    "is a symlink; slots follow none", problem="symlink", path=rel, requirement="PTH-3"
                ) from exc
            raise StorageError(f"cannot open for rewriting: {exc}", path=rel) from exc
        self._offset = 0

    def write(self, data: bytes | memoryview) -> None:
        assert self._fd is not None, "write after commit/abort"
        view = memoryview(data).cast("B")
        try:
            write_all(self._fd, view)
        except OSError as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc
        self._offset += len(view)

    def commit(self) -> None:
        assert self._fd is not None, "commit after commit/abort"
        try:
            if os.fstat(self._fd).st_size != self._offset:
                os.ftruncate(self._fd, self._offset)  # a longer previous content must not trail the new one
        except OSError as exc:
            self.abort()
            raise StorageError(f"cannot finish the file: {exc}", path=self._rel) from exc
        self._close()

    def abort(self) -> None:
        if self._fd is not None and self._dir_fd is not None:
            unlink_if_present(self._name, self._dir_fd)
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


class SlotStore(LocalStore):
    """A :class:`LocalStore` whose data files are rewritten in place and never fsync'd (see the module doc).

    Manifest and writer lock still go through ``put_exclusive`` (create-only, by link), so the commit
    protocol is the durable one; only what "durable" means differs (the slot's directory, in memory).
    :meth:`mapping` is always None and :meth:`create` marks the root first (the module doc says why);
    :meth:`list` leaves the marker out, so commit clean-ups and listings of a slot never see it.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root, direct_io=False)
        self.capabilities = Capabilities(exclusive_create=True, local=True)
        self._marked_ns: int | None = None  # the marker's mtime, once made or found
        self._ours: set[str] = set()  # files this store wrote: newer than the marker whatever the clock says

    def create(self, path: str) -> OutputFile:
        marked_ns = self._mark()
        dir_fd, name = walk_to_parent(self.url, path, create=True)  # InPlaceOutput owns (and closes) dir_fd
        try:
            if path not in self._ours:
                _replace_if_older(dir_fd, name, path, marked_ns)
        except BaseException:
            os.close(dir_fd)
            raise
        out = InPlaceOutput(dir_fd, name, path)
        self._ours.add(path)
        return out

    def _mark(self) -> int:
        """Make the root's marker, if absent, before any file here is rewritten in place; its mtime (ns).

        The store that makes it dates it at the newest change of a data file already here (0 in a fresh slot):
        those files may be mapped by readers that saw no marker, and every file written from now on is newer.
        """
        if self._marked_ns is None:
            dir_fd, name = walk_to_parent(self.url, IN_PLACE_MARKER, create=True)
            made = False
            try:
                try:
                    fd = os.open(name, _MARKER_FLAGS, dir_fd=dir_fd)
                except FileNotFoundError:
                    present = walk_lstat(self.url)  # before the marker: every file a reader may have mapped
                    try:
                        fd = os.open(name, _MARKER_FLAGS | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
                        made = True
                    except FileExistsError:  # another writer of the slot made it meanwhile: its date stands
                        fd = os.open(name, _MARKER_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePathError(
                        "is a symlink; slots follow none", problem="symlink", path=IN_PLACE_MARKER, requirement="PTH-3"
                    ) from exc
                raise StorageError(f"cannot make the in-place marker: {exc}", path=IN_PLACE_MARKER) from exc
            finally:
                os.close(dir_fd)
            try:
                if made:
                    older = [
                        st.st_ctime_ns
                        for rel, st in present.items()
                        if stat.S_ISREG(st.st_mode) and not rel.rsplit("/", 1)[-1].startswith(".")
                    ]  # dot-names (the writer's lock, temp files) are never rewritten in place, nor mapped
                    stamp = max(older, default=0)
                    os.utime(fd, ns=(stamp, stamp))
                st = os.fstat(fd)
            except OSError as exc:
                raise StorageError(f"cannot date the in-place marker: {exc}", path=IN_PLACE_MARKER) from exc
            finally:
                os.close(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError("is not a regular file", problem="file_kind", path=IN_PLACE_MARKER)
            self._marked_ns = st.st_mtime_ns
        return self._marked_ns

    def mapping(self, path: str) -> mmap.mmap | None:
        """None: a slot's files are rewritten in place, so a reader copies them (module doc)."""
        return None

    def list(self) -> dict[str, int]:
        files = super().list()
        files.pop(IN_PLACE_MARKER, None)
        return files

    def list_detail(self) -> dict[str, FileInfo]:
        files = super().list_detail()
        files.pop(IN_PLACE_MARKER, None)
        return files

    def put_exclusive(self, path: str, data: bytes) -> None:
        # The manifest and the lock: a new file published by link (create-only), as on disk; not the
        # in-place rewrite of create(), which would turn a second writer's lock into an overwrite.
        dir_fd, name = walk_to_parent(self.url, path, create=True)
        out = LocalOutput(dir_fd, name, path, direct=False)
        out.write(data)
        out.link_exclusive()

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Nothing to sync: a slot outlives its writer's process, not the node (module doc)."""


def _replace_if_older(dir_fd: int, name: str, path: str, marked_ns: int) -> None:
    """Unlink ``name`` when it was last changed no later than the marker's date: a reader may have mapped it
    before the marker existed, and keeps its bytes only if the rewrite goes to a fresh inode. A file of the
    same clock tick counts as older (one fresh inode more, never a rewritten map)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_ctime_ns <= marked_ns:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot replace a file older than the in-place marker: {exc}", path=path) from exc
