"""The trainer's side of the memory tier: a snapshot in node memory every few steps, durable saves made from it.

Call sequence (the manager's memory engine drives it; every rank makes the same calls)::

    tier = MemorySnapshots(run, memory_dir=..., slots=2, collective=dedicated_group)
    candidates = tier.candidates()                # at start: this run's committed slots, newest first
    tier.check_capacity(per_rank_bytes)           # optional: else before the first snapshot
    snap = api.capture(..., defer=True)           # on the trainer's thread, every memory_every steps
    tier.snapshot(snap, optimizer, persist=...)   # written into the next slot in the background
    tier.wait_snapshot()                          # the snapshot in flight committed (not persisted)
    tier.wait()                                   # ... and every persist done
    tier.close()

A snapshot captures on the trainer's thread what the next forward pass may change (RNG, data position,
config, scheduler, buffers); parameters and optimizer state are written by a background thread straight
from the live tensors (CPU) or from pinned host copies made on a side stream (CUDA) while the next
forward and backward run, and an optimizer step pre-hook holds the next ``step()`` until those bytes are
in the slot. The snapshot is a checkpoint written by the ordinary writer, with the ordinary collective
commit, into the node's slot (:class:`~ckptfmt.storage.slot.SlotStore`); rank 0 picks the slot
(:class:`~ckptfmt.tier.ring.RingPolicy`); a replica round follows (:mod:`.replica_rounds`).

A durable save is a persist of a committed slot (:func:`ckptfmt.tier.persist`): rank 0 copies the
node's slot into the run directory in a throttled background thread; the slot is held out of the ring
until the copy is done (:mod:`.persist_queue`). On SIGTERM the newest committed slot is persisted at once by a
watcher thread (:mod:`.signal_watcher`; it runs even while the trainer's thread is blocked in a collective with a
dead peer).

The slot holding the newest committed snapshot is never rewritten (spec/memory.md MEM-2): a two-slot ring
has a third, spare slot, written only while a slot is held for a durable copy and the other holds the newest
snapshot; without room for it (the capacity check), such a snapshot is skipped.

A snapshot that cannot be taken (no room in the memory directory, a failed write, a source changed during
its copy) is skipped on every rank together, with a warning: the older slots still hold, the capacity is
checked again before the next one, and training goes on. A durable save that falls due at such a step is
written from the live state straight to the run directory (the caller's ``write_durable``).

What lives where: this class is the façade the manager, the restorer and the tests use; the snapshot write path
(slot chosen, written, committed, or skipped with a durable save instead) is
:class:`.snapshot_writer.SnapshotWriter`; the capacity check is :func:`ckptfmt.tier.capacity.agree_capacity`, the
restore side (whose slots, candidates, the agreed restore) :class:`ckptfmt.tier.candidates.RunSlots`, the durable
copies :class:`.persist_queue.PersistQueue`, replica rounds :class:`.replica_rounds.ReplicaRounds`, the SIGTERM
thread :class:`.signal_watcher.SignalWatcher`.

Threads and locking: the trainer's thread calls the public methods; the snapshot writer's one thread writes slots,
starts replica rounds and runs spread persists; the persist queue's one thread copies one node's slots; the
SIGTERM watcher and the replicator have threads of their own. ``_lock`` is the one lock: it guards rank 0's ring
(:class:`~ckptfmt.tier.ring.RingPolicy`, load, pick, commit, hold, release, drop) and the persist queued behind the
running one; the snapshot writer and the persist queue share it (it is handed over at construction). Everything
else the writer thread sets (``newest``, the files it wrote, counters) is read by the trainer's thread only after
``wait_snapshot``; the step gate (:class:`~.engines.StepGate`) holds ``optimizer.step()`` until a snapshot's bytes
are in its slot.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..collective import Collective, PeerChannel
from ..errors import CheckpointError, UsageError
from ..run import RunDirectory, checkpoint_name
from ..tier import MemoryTier, node_key, persist, run_identity
from ..tier.agreed import AgreedRestore
from ..tier.candidates import MemoryCandidate, RunSlots
from ..tier.capacity import agree_capacity
from ..tier.nodes import NodeMap
from ..tier.persist import Persisted
from ..tier.placement import DOMAIN_ENV
from ..tier.placement_record import PlacementRecord
from ..tier.replica import Replicator
from ..tier.ring import RingPolicy, SlotRef
from .persist_queue import CopySlot, PersistQueue
from .replica_rounds import ReplicaLag, ReplicaRounds
from .signal_watcher import SignalWatcher
from .snapshot_writer import SnapshotWriter, state_bytes
from .state import Snapshot

log = logging.getLogger("ckptfmt")

__all__ = ["MemoryCandidate", "MemorySnapshots", "state_bytes"]


class MemorySnapshots:
    """The memory tier of one rank: snapshots into the node's slots, their replicas, their durable copies."""

    def __init__(
        self,
        run: RunDirectory,
        *,
        memory_dir: str | os.PathLike[str] | None,
        slots: int,
        collective: Collective | None,
        persist_duty: float = 0.5,
        codec: str | None = None,
        on_persisted: Callable[[Persisted], None] | None = None,
        replicate: bool = False,
        replicas: int = 1,
        replica_rate: float | None = None,
        channel: PeerChannel | None = None,
        write_durable: Callable[[int, Snapshot, CheckpointError | None], None] | None = None,
        close_timeout: float | None = None,
        copy: CopySlot | None = None,
    ) -> None:
        if close_timeout is not None and close_timeout < 0:
            raise UsageError("close_timeout must be None (wait until done) or a number of seconds")
        self.run = run
        # MEM-2: with one slot of a two-slot ring held for a durable copy, the other holds the newest snapshot;
        # a spare slot (the ring's last) is written then instead of it. A ring of three or more always has
        # a slot that is neither held nor the newest.
        self.ring_slots = slots
        self.tier = MemoryTier(memory_dir, run.url, slots=slots + 1 if slots == 2 else slots)
        self.ring = RingPolicy(slot_count=self.tier.slot_count, ring_slots=slots)  # rank 0's is the one that picks
        self.collective = collective
        self.rank = collective.rank if collective is not None else 0
        self.node = node_key()
        self.run_id = run_identity(run.url)
        self.world_size = collective.world_size if collective is not None else 1
        self.nodes = NodeMap.gather(collective, self.node, os.environ.get(DOMAIN_ENV, ""), replicas)
        self.channel = channel
        self.tier.ensure()
        # the ranks of each node prove that they share the memory directory (MEM-15), every rank together: ranks
        # with one node key but private /dev/shm are refused here, not at the first snapshot's commit
        self.nodes.prove_shared(collective, self.tier.root)
        self.replicator: Replicator | None = None
        # a restore across nodes: the job spans several, or it asked for replicas (a job shrunk onto one node
        # after a node loss reads its own slots and the copies that node holds of the lost one's files)
        self.across_nodes = replicate or self.nodes.multi_node
        if replicate and not self.nodes.multi_node:
            log.warning(
                "replicate=True, but every rank is on node %r: there is no other node to hold a copy", self.node
            )
        elif replicate:
            if channel is None:
                raise UsageError("replicate=True needs a channel between ranks (torch.distributed)")
            self.replicator = Replicator(self.tier, channel, self.nodes, self.rank, rate=replica_rate)
            if self.rank == 0:
                self._record_placement(run)
        self._rounds = (
            ReplicaRounds(self.replicator, collective, self.tier, self.world_size)
            if self.replicator is not None
            else None
        )
        self.run_slots = RunSlots(
            self.tier,
            run,
            collective=collective,
            channel=channel,
            nodes=self.nodes,
            node=self.node,
            run_id=self.run_id,
            rank=self.rank,
        )
        self._lock = threading.Lock()  # rank 0's ring, and the persist queued (shared with the persist queue)
        # ``persist`` looked up here, at construction: what copies a slot into the run directory
        self.persist_queue = PersistQueue(
            self.tier,
            run,
            lock=self._lock,
            ring=self.ring,
            loaded_ring=self._ring,
            copy=copy if copy is not None else persist,  # default: byte for byte (MEM-7)
            collective=collective,
            rank=self.rank,
            persist_duty=persist_duty,
            codec=codec,
            on_persisted=on_persisted,
            close_timeout=close_timeout,
        )
        self._snapshots = SnapshotWriter(
            self.tier,
            run,
            collective=collective,
            rank=self.rank,
            world_size=self.world_size,
            nodes=self.nodes,
            node=self.node,
            run_id=self.run_id,
            lock=self._lock,
            ring=self.ring,
            loaded_ring=self._ring,
            queue=self.persist_queue,
            rounds=self._rounds,
            check_capacity=lambda per_rank: self.check_capacity(per_rank),  # looked up per call (tests patch it)
            write_durable=write_durable,
        )
        self._watcher = SignalWatcher(self.persist_newest)

    # ---------------------------------------------------------------- what the snapshot writer knows

    @property
    def newest(self) -> SlotRef | None:
        """The newest committed snapshot (read on the trainer's thread after :meth:`wait_snapshot`)."""
        return self._snapshots.newest

    @property
    def spare(self) -> bool:
        """The memory directory has room for the spare slot (the capacity check, the same on every rank)."""
        return self._snapshots.spare

    @property
    def _recheck(self) -> bool:
        """A snapshot failed: the capacity is checked again before the next one."""
        return self._snapshots.recheck

    @_recheck.setter
    def _recheck(self, value: bool) -> None:
        self._snapshots.recheck = value

    @property
    def snapshots(self) -> int:
        """Snapshots started."""
        return self._snapshots.snapshots

    @property
    def skipped(self) -> int:
        """Snapshots not taken: no slot could be written (MEM-2), or their write failed."""
        return self._snapshots.skipped

    @property
    def failed(self) -> int:
        """Of the snapshots skipped, those whose write failed (every rank counts the same)."""
        return self._snapshots.failed

    @property
    def capture_seconds(self) -> float:
        """Time the trainer's thread spent in :meth:`snapshot`."""
        return self._snapshots.capture_seconds

    @property
    def held_seconds(self) -> float:
        """Total time optimizer.step() waited for a snapshot's bytes."""
        return self._snapshots.held_seconds

    # ---------------------------------------------------------------- what the persist queue knows

    @property
    def durable_step(self) -> int | None:
        """The newest step made durable by this process."""
        return self.persist_queue.durable_step

    @property
    def last_persisted(self) -> Persisted | None:
        return self.persist_queue.last_persisted

    @property
    def close_timeout(self) -> float | None:
        return self.persist_queue.close_timeout

    @property
    def codec(self) -> str | None:
        """The codec of durable saves (memory snapshots are raw)."""
        return self.persist_queue.codec

    @property
    def _persists(self) -> list[Future[Persisted | None]]:
        """The durable copies submitted and not yet looked at."""
        return self.persist_queue.futures

    # ---------------------------------------------------------------- set-up

    def check_capacity(self, per_rank: int) -> None:
        """Refuse slots that would not fit the memory directory (all ranks raise the same error); find whether the
        spare slot fits too (``self.spare``, the same on every rank): :func:`~ckptfmt.tier.capacity.agree_capacity`."""
        self._snapshots.spare = agree_capacity(
            self.collective,
            per_rank,
            tier=self.tier,
            ring_slots=self.ring_slots,
            run_url=self.run.url,
            nodes=self.nodes,
            node=self.node,
            rank=self.rank,
            world_size=self.world_size,
            replicas=self.replicator is not None,
        )
        self._snapshots.checked_capacity = True
        self._snapshots.recheck = False

    # ---------------------------------------------------------------- restore

    def candidates(self) -> list[MemoryCandidate]:
        """This run's and node's committed slots, newest first
        (:meth:`~ckptfmt.tier.candidates.RunSlots.candidates`)."""
        return self.run_slots.candidates()

    def agreed(self) -> AgreedRestore:
        """The restore across nodes (several nodes, or replicas): what every node holds, agreed on every rank."""
        return self.run_slots.agreed()

    def restored(self, step: int, candidate: MemoryCandidate | None) -> None:
        """After a restore of ``step`` (from ``candidate``, or from the run directory when None): slots holding a
        newer step are not this trajectory's (they failed, or another rank could not use them) and go back to the
        ring to be rewritten, never persisted; a restored snapshot the run directory lacks is persisted in the
        background (rank 0), so it outlives this node (one the run directory holds already is not copied again)."""
        slot = candidate.slot if candidate is not None else None
        if self.across_nodes:
            # a restore across nodes read from several directories, perhaps of another world: no slot here is
            # that snapshot whole, so none is adopted or persisted; every slot holding a newer step is dropped
            slot = None
        if candidate is not None and slot is not None:
            self._snapshots.newest = SlotRef(slot, candidate.step, candidate.checkpoint_id)
        if self.rank != 0:
            return
        with self._lock:
            self._ring().drop_after(step, slot)
        if slot is None or candidate is None:
            return
        durable = self.run_slots.durable_id(candidate.step)
        if durable is None:
            self.persist_queue.submit(slot)
            return
        self.persist_queue.made_durable(candidate.step)
        # (a durable copy re-written, with a codec or references, has an id of its own: that the step is there is
        # enough)
        if durable != candidate.checkpoint_id and self.persist_queue.copies_keep_ids:
            log.warning(
                "%s holds another checkpoint of step %d: the restored memory snapshot was not persisted there",
                self.run.child_url(checkpoint_name(candidate.step)),
                candidate.step,
            )

    # ---------------------------------------------------------------- snapshots

    def snapshot(self, snap: Snapshot, optimizer: torch.optim.Optimizer, *, persist: bool) -> None:
        """Write ``snap`` (captured with ``defer=True``) into the next slot in the background; persist it
        afterwards when ``persist``. Waits for the previous snapshot first, raising its failure
        (:meth:`.snapshot_writer.SnapshotWriter.snapshot`)."""
        self._snapshots.snapshot(snap, optimizer, persist=persist)

    def _ring(self) -> RingPolicy:
        """Rank 0's ring, loaded from the slots on first use (under _lock)."""
        if not self.ring.loaded:
            self.ring.load({s.index: self.run_slots.own_step(s) for s in self.tier.slots()})
        return self.ring

    def persist_slot(self, slot: int) -> None:
        """Persist the committed snapshot in ``slot`` in the background (one node: rank 0, the others have nothing
        to do; several: every rank copies its own files, so every rank calls this)."""
        if self.nodes.multi_node:
            self._snapshots.spread_later(slot)
        elif self.rank == 0:
            self.persist_queue.submit(slot)

    # ---------------------------------------------------------------- waiting and shutdown

    def wait_snapshot(self) -> None:
        """Block until the snapshot in flight is committed; raise its failure."""
        self._snapshots.wait_snapshot()

    def _record_placement(self, run: RunDirectory) -> None:
        """The replica count and domains, for ``ckpt ls``; a record only: failing to write it costs no snapshot."""
        record = PlacementRecord(replicas=self.nodes.replicas, domains=self.nodes.domains)
        try:
            run.record_placement(record.to_dict())
        except CheckpointError as exc:
            log.warning("the replica placement was not recorded in the run directory: %s", exc)

    def replica_lag(self) -> ReplicaLag | None:
        """How far this rank's replicas trail its snapshots; None without replicas."""
        return self._rounds.lag() if self._rounds is not None else None

    def wait_replica(self) -> None:
        """Block until this rank's part of the replica round in flight is done (its failures are logged)."""
        self.wait_snapshot()
        if self.replicator is not None:
            self.replicator.wait()

    def wait(self) -> Persisted | None:
        """The snapshot in flight committed and every persist done; the first failure is raised."""
        self.wait_snapshot()
        return self.persist_queue.wait()

    def raise_background_error(self) -> None:
        self._snapshots.raise_background_error()

    def persist_newest(self) -> Persisted | None:
        """Persist the newest committed snapshot now, unthrottled, on the calling thread (SIGTERM); None when
        there is none or this is not rank 0 (or the snapshot is spread over several nodes)."""
        if self.rank != 0 or self.nodes.multi_node:
            return None
        return self.persist_queue.copy_newest()

    def close(self, *, persist: bool = True) -> None:
        """Wait for the work in flight; with ``persist``, make the newest snapshot durable if it is not yet
        (rank 0: "on exit, the newest snapshot is persisted"); then stop the threads.

        Nothing trains beside the copies any more, so they run unthrottled; a wait for one is logged, and with
        ``close_timeout`` rank 0 abandons one node's copies that outlast it (the snapshot stays in memory)."""
        try:
            self.wait_snapshot()
            self.persist_queue.start_closing()
            self.persist_queue.announce_wait()
            self.wait()
            newest, durable = self.newest, self.durable_step
            if persist and newest is not None and (durable is None or durable < newest.step):
                if self.nodes.multi_node:  # every rank copies its own files, together
                    self._snapshots.spread_now(newest.slot)
                else:
                    self.persist_newest()
        finally:
            if self.replicator is not None:
                self.replicator.close()
            self._snapshots.shutdown()
            self.persist_queue.shutdown()
            self._snapshots.remove_gate()
            self.stop_watcher()

    # ---------------------------------------------------------------- SIGTERM while blocked

    def start_watcher(self, signals: tuple[signal.Signals, ...]) -> None:
        """Persist the newest snapshot as soon as one of ``signals`` arrives, from a thread of its own
        (:class:`~.signal_watcher.SignalWatcher`: main thread only, and only when nobody else owns the wakeup fd)."""
        if self.rank != 0:
            return
        if self.nodes.multi_node:
            # rank 0 alone holds only its node's files of a snapshot; a persist takes every rank
            # (checkpoint_if_due's preemption save), and replicas keep what a lost node held
            return
        self._watcher.start(signals)

    def stop_watcher(self) -> None:
        self._watcher.stop()
