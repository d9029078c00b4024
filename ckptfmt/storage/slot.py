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
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ..errors import StorageError, UnsafePathError
from .base import Capabilities, OutputFile
from .direct import write_all
from .local import LocalOutput, LocalStore, walk_to_parent

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_REWRITE_FLAGS = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC  # no O_TRUNC: keep the pages


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
            try:
                os.unlink(self._name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
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
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root, direct_io=False)
        self.capabilities = Capabilities(exclusive_create=True, local=True)

    def create(self, path: str) -> OutputFile:
        dir_fd, name = walk_to_parent(self.url, path, create=True)  # InPlaceOutput owns (and closes) dir_fd
        return InPlaceOutput(dir_fd, name, path)

    def put_exclusive(self, path: str, data: bytes) -> None:
        # The manifest and the lock: a new file published by link (create-only), as on disk; not the
        # in-place rewrite of create(), which would turn a second writer's lock into an overwrite.
        dir_fd, name = walk_to_parent(self.url, path, create=True)
        out = LocalOutput(dir_fd, name, path, direct=False)
        out.write(data)
        out.link_exclusive()

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Nothing to sync: a slot outlives its writer's process, not the node (module doc)."""
