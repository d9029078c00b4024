"""Durable saves of the memory tier: committed slots copied into the run directory in the background.

Call sequence (:class:`~ckptfmt.torch.memory.MemorySnapshots` drives it)::

    queue = PersistQueue(tier, run, lock=..., ring=..., loaded_ring=..., copy=persist, ...)
    queue.submit(slot)           # one node, rank 0: the slot just committed, copied on the persist thread
    queue.spread(slot, files)    # several nodes, every rank, on the caller's thread: its own files; rank 0 commits
    queue.copy_newest()          # SIGTERM or close(), rank 0: the newest committed slot, now, unthrottled
    queue.any_failed(); queue.forget_done()
    queue.start_closing(); queue.announce_wait(); queue.wait()
    queue.shutdown()

Locking: ``lock`` is the snapshots' one lock (``MemorySnapshots._lock``). It guards the ring (every hold, release
and read of rank 0's :class:`~ckptfmt.tier.ring.RingPolicy`) and the queued persist (``waiting``), which the
trainer's thread, the snapshot writer and the persist thread all touch; a copy itself runs outside it, with its
slot held. ``copying``, ``closing`` and ``deadline`` are single assignments read by other threads without the
lock (a log line, the throttle), as before the split.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from ..collective import Collective
from ..errors import CheckpointExistsError
from ..run import RunDirectory
from ..tier import MemoryTier, Throttle
from ..tier.persist import Persisted, lower_thread_priority, persist_spread
from ..tier.persist_incremental import IncrementalPersist
from ..tier.ring import RingPolicy

log = logging.getLogger("ckptfmt")


class CopySlot(Protocol):
    """How one node's committed slot is copied into the run directory (:func:`ckptfmt.tier.persist`, byte for byte;
    :class:`~ckptfmt.tier.persist_incremental.IncrementalPersist`, referencing the previous durable save)."""

    def __call__(self, source: str, run: RunDirectory, *, throttle: Throttle, codec: str | None) -> Persisted: ...


class _Abandoned(Exception):
    """Raised inside a persist's copy loop when close() stops waiting for it (its close_timeout ran out); the
    persist aborts (no manifest, its files and lock removed) and :meth:`PersistQueue.copy_held` says so."""


class _CopyThrottle(Throttle):
    """A persist's throttle that close() lifts (nothing trains beside the copy any more) and cuts off once its
    ``close_timeout`` ran out (checked after each piece of the copy)."""

    def __init__(self, duty: float, queue: PersistQueue) -> None:
        super().__init__(duty)
        self._queue = queue

    def after(self, seconds: float) -> None:
        deadline = self._queue.deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise _Abandoned
        if not self._queue.closing:
            super().after(seconds)


class PersistQueue:
    """Rank 0's background copies of one node's slots (at most one running, one waiting) and every rank's spread
    persists across nodes; what was made durable (``durable_step``, ``last_persisted``)."""

    def __init__(
        self,
        tier: MemoryTier,
        run: RunDirectory,
        *,
        lock: threading.Lock,
        ring: RingPolicy,
        loaded_ring: Callable[[], RingPolicy],
        copy: CopySlot,
        collective: Collective | None,
        rank: int,
        persist_duty: float,
        codec: str | None,
        on_persisted: Callable[[Persisted], None] | None,
        close_timeout: float | None,
    ) -> None:
        self.tier = tier
        self.run = run
        self._lock = lock
        self._ring = ring  # as it is (a spread persist holds a slot in a ring rank 0 alone loads)
        self._loaded_ring = loaded_ring  # rank 0's, loaded from the slots on first use (call it under the lock)
        self._copy = copy
        self.collective = collective
        self.rank = rank
        self.persist_duty = persist_duty
        self.codec = codec  # of durable saves; memory snapshots are raw
        self.on_persisted = on_persisted
        self.close_timeout = close_timeout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-persist")
        self.futures: list[Future[Persisted | None]] = []
        self.waiting: tuple[int, int] | None = None  # (slot, step) of the persist queued behind the running one
        self.copying: tuple[int, int] | None = None  # (slot, step) that the persist thread copies now
        self.closing = False  # close() runs: nothing trains beside a copy any more, so it is not throttled
        self.deadline: float | None = None  # time.monotonic() after which close() abandons a copy
        self.durable_step: int | None = None  # the newest step made durable by this process
        self.last_persisted: Persisted | None = None

    @property
    def copies_keep_ids(self) -> bool:
        """Durable copies are the snapshots, byte for byte, with their checkpoint ids (MEM-7): no codec re-encodes
        them and no incremental persist re-writes them (those have ids of their own, MEM-7)."""
        return self.codec in (None, "raw") and not isinstance(self._copy, IncrementalPersist)

    def made_durable(self, step: int) -> None:
        self.durable_step = max(self.durable_step or -1, step)

    def submit(self, slot: int) -> None:
        """Persist the snapshot just committed in ``slot`` in the background.

        Only a running copy holds its slot out of the ring; one waiting behind it does not (two held slots
        would leave a two-slot ring nowhere to write). At most one waits: a newer one due meanwhile replaces
        it. A waiting copy whose slot was rewritten before it started takes the newest committed snapshot
        instead, so a disk slower than the durable cadence makes durable saves sparser or later, never
        stalls the trainer, never skips a memory snapshot, and never persists an older step after a newer.
        """
        with self._lock:
            step = self._loaded_ring().step_of(slot)
            if self.waiting is not None:
                log.warning("durable save of step %s dropped: step %s is due before it started", self.waiting[1], step)
            self.waiting = (slot, step if step is not None else -1)
        self.futures.append(self._pool.submit(self._copy_waiting))

    def _copy_waiting(self) -> Persisted | None:
        with self._lock:
            waiting, self.waiting = self.waiting, None
            if waiting is None:  # replaced by a newer one, which an earlier task already took
                return None
            slot, step = waiting
            ring = self._loaded_ring()
            if ring.step_of(slot) != step:  # rewritten since: the newest committed snapshot instead
                newest = ring.newest_committed()
                if newest is None:
                    return None
                log.warning(
                    "the durable save due at step %d wrote step %s instead, the newest snapshot still whole in memory: "
                    "step %d's memory slot was reused for a newer snapshot while an earlier durable save was still "
                    "being written",
                    step,
                    newest[1],
                    step,
                )
                slot, step = newest
            ring.hold(slot)
        return self.copy_held(slot, step, self.persist_duty)

    def copy_newest(self) -> Persisted | None:
        """Copy the newest committed slot now, unthrottled, on the calling thread; None when there is none."""
        with self._lock:
            newest = self._loaded_ring().newest_committed()
            if newest is None:
                return None
            self._ring.hold(newest[0])
        return self.copy_held(newest[0], newest[1], 1.0)

    def copy_held(self, slot: int, step: int, duty: float) -> Persisted | None:
        """Copy a slot already held out of the ring; release it afterwards."""
        lower_thread_priority()
        self.copying = (slot, step)
        try:
            done = self._copy(self.tier.slot_path(slot), self.run, throttle=_CopyThrottle(duty, self), codec=self.codec)
        except CheckpointExistsError as exc:  # another process persists the same step right now
            log.warning("memory slot %d not persisted: %s", slot, exc)
            return None
        except _Abandoned:
            log.warning(
                "the durable copy of step %d was abandoned at close after close_timeout=%s s; the snapshot stays in "
                "memory slot %s (a restart restores and persists it, or `ckpt rescue %s %s`)",
                step,
                self.close_timeout,
                self.tier.slot_path(slot),
                self.tier.memory_dir,
                self.run.url,
            )
            return None
        finally:
            self.copying = None
            with self._lock:
                self._ring.release(slot)
        if done.status == "conflict":
            log.warning(
                "%s holds another checkpoint of step %d: the memory snapshot was not persisted there",
                done.destination,
                done.step,
            )
        self.last_persisted = done
        self.made_durable(done.step)  # a conflict too: nothing more to do there
        if self.on_persisted is not None:
            self.on_persisted(done)
        return done

    def spread(self, slot: int, files: Sequence[str]) -> None:
        """Several nodes: every rank copies its files of the slot into the run directory, rank 0 commits (on the
        caller's thread: the ranks' copies must line up, so they are not coalesced as one node's are)."""
        assert self.collective is not None
        with self._lock:
            self._ring.hold(slot)
        try:
            done = persist_spread(
                self.tier.slot_path(slot),
                self.run,
                collective=self.collective,
                files=files,
                throttle=Throttle(1.0 if self.closing else self.persist_duty),
            )
        finally:
            with self._lock:
                self._ring.release(slot)
        self.last_persisted = done
        self.made_durable(done.step)
        if self.rank == 0 and self.on_persisted is not None:
            self.on_persisted(done)

    # ---------------------------------------------------------------- waiting and shutdown

    def wait(self) -> Persisted | None:
        """Every persist submitted so far done; the first failure is raised."""
        futures, self.futures = self.futures, []
        last = None
        for future in futures:
            last = future.result() or last
        return last

    def any_failed(self) -> bool:
        return any(f.done() and f.exception() is not None for f in self.futures)

    def forget_done(self) -> None:
        # persists that went well need no more looking at (a long run makes thousands of them)
        self.futures = [f for f in self.futures if not f.done()]

    def start_closing(self) -> None:
        """close() runs: copies go unthrottled from now on, and are abandoned after ``close_timeout``."""
        self.closing = True
        if self.close_timeout is not None:
            self.deadline = time.monotonic() + self.close_timeout

    def announce_wait(self) -> None:
        """Say what close() waits for, when a durable copy is still running or queued."""
        if all(f.done() for f in self.futures):
            return
        copying, waiting = self.copying, self.waiting
        parts = [f"step {copying[1]} (memory slot {copying[0]})"] if copying is not None else []
        if waiting is not None:
            parts.append(f"step {waiting[1]}, queued")
        bound = (
            f"at most close_timeout={self.close_timeout} s, then abandoned"
            if self.close_timeout is not None
            else "until it is done (close_timeout= bounds this)"
        )
        log.warning(
            "closing: waiting for the durable copy of %s into %s, unthrottled, %s",
            " and ".join(parts) or "a memory snapshot",
            self.run.url,
            bound,
        )

    def shutdown(self) -> None:
        self._pool.shutdown()
