"""The committer: the commit protocol of spec/commit.md, in exactly one place.

It alone takes and releases the writer lock (step 1), refuses or un-commits an existing checkpoint
(step 2), writes the manifest create-only after syncing every directory it lists (steps 4-5),
deletes a replaced checkpoint's leftovers (step 6), and cleans up on abort. It never sees tensor data.

With several ranks, only the coordinator (rank 0 by default) has a committer: the other ranks write
their data files under the coordinator's lock and hand it their records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from .errors import CheckpointError, CheckpointExistsError, CheckpointLockedError, MissingFileError
from .lock import MAX_LOCK_BYTES, WriterLock, read_lock, takeover_marker
from .manifest import Manifest, checkpoint_id
from .manifest_parse import parse_manifest
from .paths import LOCK_NAME, MANIFEST_NAME
from .storage import Store

log = logging.getLogger("ckptfmt")


class Committer:
    """Holds ``store``'s writer lock from construction until :meth:`commit` or :meth:`abort`."""

    def __init__(
        self,
        store: Store,
        *,
        overwrite: bool = False,
        bases: tuple[str, ...] = (),
        before_replace: Callable[[], None] | None = None,
        check_manifest: bool = True,
    ) -> None:
        self.store = store
        self.holder = WriterLock.mine(bases)
        # False: the manifest is not parsed back before its commit. For a store whose every reader parses it and
        # passes over one it refuses (a memory slot: restores, persists and peers, MEM-6), where the check would
        # cost a snapshot taken every step about as much CPU as its copy.
        self.check_manifest = check_manifest
        # called under the lock before a committed checkpoint is un-committed: may refuse the replace (REF-14)
        self.before_replace = before_replace
        self.old_files: dict[str, int] = {}
        self._acquire(overwrite)

    def _acquire(self, overwrite: bool) -> None:
        self._lock(overwrite=overwrite)
        try:
            self._check_existing(overwrite)
        except BaseException:
            self.abort([])  # the lock was taken: never leave it held by a writer that gave up
            raise

    def _lock(self, *, overwrite: bool) -> None:
        try:
            self.store.put_exclusive(LOCK_NAME, self.holder.to_bytes())
            return
        except FileExistsError:
            pass
        current = read_lock(self.store)
        if current is not None and current.holder_is_dead():
            if self._take_over(current):
                return
            current = read_lock(self.store)  # who won the takeover, for the message
        holder = current.holder() if current is not None else "holder unknown"
        raise CheckpointLockedError(
            f"another writer holds {LOCK_NAME} ({holder}); if it is dead, remove the lock (`ckpt gc`) or wait for it",
            path=self.store.url,
        ) from None

    def _take_over(self, stale: WriterLock) -> bool:
        """Replace the dead lock ``stale`` with ours; False when another writer holds the root or is taking it.

        Deleting by name after reading the holder dead is a race: a second taker that read the same dead lock
        would delete the first one's fresh lock, and both would write (and the loser's abort delete the
        winner's files). So only the writer that creates ``stale``'s marker (create-only: one of them) may
        delete it, and only while it is still ``stale``; nobody else deletes a lock that is not theirs, so
        ``stale`` cannot change between that read and the delete. Ours is then put create-only as usual.
        """
        marker = takeover_marker(stale)
        try:
            self.store.put_exclusive(marker, self.holder.to_bytes())
        except FileExistsError:
            return False  # another writer is taking it over (or was killed doing so: gc removes the marker)
        try:
            current = read_lock(self.store)
            if current is not None and current.nonce != stale.nonce:
                return False  # taken over already (the marker was made again after the winner removed it)
            if current is not None:
                self.store.delete(LOCK_NAME)
            try:
                self.store.put_exclusive(LOCK_NAME, self.holder.to_bytes())
            except FileExistsError:
                return False  # a new writer came in between: it holds the root
            return self._holds_lock()
        finally:
            # Once our lock is in place a late taker that makes the marker again finds a lock that is not
            # ``stale``, and leaves it; a marker left by a failure here is for gc.
            try:
                self.store.delete(marker)
            except CheckpointError as exc:
                log.warning("%s: could not remove %s (%s); `ckpt gc` removes it", self.store.url, marker, exc)

    def _holds_lock(self) -> bool:
        """Whether the lock now there is ours, read back after a takeover: on a store whose create-only put is
        not atomic another taker's put may have replaced it, and then this writer must neither write nor delete
        the lock. A failed read fails the save, and the lock (ours, most likely) is abandoned, as abort does."""
        try:
            return self.store.read(LOCK_NAME, max_size=MAX_LOCK_BYTES) == self.holder.to_bytes()
        except MissingFileError:
            return False
        except CheckpointError:
            self.holder.abandon()
            raise

    def _check_existing(self, overwrite: bool) -> None:
        if self.store.exists(MANIFEST_NAME):
            if not overwrite:
                raise CheckpointExistsError(
                    "a committed checkpoint is already here; pass overwrite=True to replace it",
                    path=self.store.url,
                )
            if self.before_replace is not None:
                self.before_replace()
            # Replace: un-commit first, so no reader ever sees the old manifest over new data files.
            self.old_files = self.store.list()
            self.store.delete(MANIFEST_NAME)

    def commit(self, manifest: Manifest, written: Iterable[str]) -> str:
        """Write ``manifest`` create-only once every file in ``written`` is durable; returns the checkpoint id.

        On failure nothing is committed and the error propagates; the caller aborts.
        """
        return self.commit_bytes(manifest.to_bytes(), [f.path for f in manifest.files], written)

    def commit_bytes(self, data: bytes, files: Iterable[str], written: Iterable[str]) -> str:
        """:meth:`commit` of a manifest given as its canonical bytes, which list ``files``."""
        if self.check_manifest:
            parse_manifest(data)  # never commit what a reader would refuse
        self.store.sync_dirs(written)
        try:
            self.store.put_exclusive(MANIFEST_NAME, data)
        except FileExistsError:
            raise CheckpointExistsError(
                "another writer committed a checkpoint here first", path=self.store.url
            ) from None
        # Committed. What follows is clean-up (step 6): a failure there must not report a committed save as
        # failed; what it leaves (old files, the lock) is for gc, and this process may take its lock over.
        try:
            keep = set(files)
            for path in self.old_files:
                if path not in keep and path not in (MANIFEST_NAME, LOCK_NAME):
                    self.store.delete(path)
            self.store.delete(LOCK_NAME)
        except CheckpointError as exc:
            log.warning("%s: committed, but clean-up failed (%s); `ckpt gc` removes what is left", self.store.url, exc)
            self.holder.abandon()
        return checkpoint_id(data)

    def abort(self, written: Iterable[str]) -> None:
        """Delete every file in ``written`` and the lock; no manifest is left."""
        try:
            for path in written:
                self.store.delete(path)
            self.store.delete(LOCK_NAME)
        except CheckpointError:
            # Storage is unreachable: stop trying (each attempt waits out retries). What is left is an
            # incomplete checkpoint that gc removes, and this process may take over its own lock.
            self.holder.abandon()
