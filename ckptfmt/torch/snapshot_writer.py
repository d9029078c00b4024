"""The write path of the memory tier: a snapshot written into the slot rank 0 picks, committed by every rank together.

Call sequence (:class:`~ckptfmt.torch.memory.MemorySnapshots` drives it, on the trainer's thread)::

    writer = SnapshotWriter(tier, run, lock=..., ring=..., loaded_ring=..., queue=..., check_capacity=..., ...)
    writer.snapshot(snap, optimizer, persist=...)  # capacity checked when due; the write submitted to its thread
    writer.wait_snapshot()                         # committed, or skipped on every rank; a failure raised
    writer.spread_later(slot)                      # several nodes: a persist of a committed slot on that thread
    writer.spread_now(slot)                        # ... and waited for (close)
    writer.shutdown()
    writer.remove_gate()

One write is in flight at a time, on the one writer thread (``_writer``): the slot chosen (rank 0 picks it,
:class:`~ckptfmt.tier.ring.RingPolicy`, and every rank learns it through :func:`~ckptfmt.decide.decide`), the
snapshot written by the ordinary writer with the ordinary collective commit, then its replica round
(:class:`.replica_rounds.ReplicaRounds`) and its durable copy (:class:`.persist_queue.PersistQueue`). A snapshot
that cannot be taken is skipped on every rank together (:meth:`SnapshotWriter._not_taken`); a durable save due
at its step is then written from the same state straight to the run directory (``write_durable``).

Locking: ``lock`` is the snapshots' one lock (``MemorySnapshots._lock``); rank 0's ring is picked from and
committed to under it (``loaded_ring`` is called under it only). What the writer thread sets (``newest``, the
files of the newest snapshot, the counters, ``recheck``) is read by the trainer's thread only after
:meth:`~SnapshotWriter.wait_snapshot`; the step gate (:class:`~.engines.StepGate`) holds ``optimizer.step()``
until a snapshot's bytes are in its slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError
from ..manifest import FileRecord
from ..plan_cache import PlanCache
from ..run import RunDirectory
from ..storage.slot import SlotStore
from ..thread_pools import submit_or_run
from ..tier import MemoryTier, SlotBinding
from ..tier.binding import normalize_run_url
from ..tier.nodes import NodeMap
from ..tier.ring import RingPolicy, SlotRef
from ..tier.votes import as_error, is_int
from ..writer import CheckpointWriter
from . import state
from .engines import StepGate
from .persist_queue import PersistQueue
from .replica_rounds import ReplicaRounds
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")

__all__ = ["SnapshotWriter", "state_bytes"]


def _step_of(snap: Snapshot) -> int:
    return int(snap.contexts.get("provenance", {}).get("step", 0))


def state_bytes(snap: Snapshot) -> int:
    """Tensor bytes this rank puts in a snapshot (deferred tensors at their live size)."""
    total = sum(int(getattr(v, "nbytes", 0)) for named in snap.tensors.values() for v in named.values())
    for _, _, tensor in snap.deferred:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class SnapshotWriter:
    """One rank's snapshots into the node's slots: the writer thread, the write in flight, the step gate, the
    host buffers, the newest commit and the counters (see the module docstring)."""

    def __init__(
        self,
        tier: MemoryTier,
        run: RunDirectory,
        *,
        collective: Collective | None,
        rank: int,
        world_size: int,
        nodes: NodeMap,
        node: str,
        run_id: str,
        lock: threading.Lock,
        ring: RingPolicy,
        loaded_ring: Callable[[], RingPolicy],
        queue: PersistQueue,
        rounds: ReplicaRounds | None,
        check_capacity: Callable[[int], None],
        write_durable: Callable[[int, Snapshot, CheckpointError | None], None] | None,
    ) -> None:
        self.tier = tier
        self.run = run
        self.collective = collective
        self.rank = rank
        self.world_size = world_size
        self.nodes = nodes
        self.node = node
        self.run_id = run_id
        self._lock = lock
        self.ring = ring  # as it is (every rank marks a slot it failed or wrote)
        self._loaded_ring = loaded_ring  # rank 0's, loaded from the slots on first use (call it under the lock)
        self.persist_queue = queue
        self._rounds = rounds
        self._check_capacity = check_capacity  # the façade's: sets spare, checked_capacity and recheck
        self.write_durable = write_durable
        self._files: list[str] = []  # the files this rank wrote into the newest snapshot
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-memory")
        self._inflight: Future[None] | None = None
        self._gate = StepGate()  # holds optimizer.step() until a snapshot's bytes are in the slot
        self.spare = False  # the memory directory has room for the spare slot (the capacity check, all ranks)
        self.checked_capacity = False
        self.recheck = False  # a snapshot failed: check the capacity again before the next one
        self._writing: int | None = None  # the slot of the snapshot being written
        self._refused: CheckpointError | None = None  # why this snapshot's copies are not to be written anywhere
        self.buffers = HostBuffers(pinned=True) if torch.cuda.is_available() else None
        self.plan_cache = PlanCache()  # every snapshot writes the same tensors: planned once (plan_cache.py)
        self.newest: SlotRef | None = None  # the newest commit
        self.snapshots = 0
        self.skipped = 0  # snapshots not taken: no slot could be written (MEM-2), or their write failed
        self.failed = 0  # of those, the ones whose write failed (every rank counts the same)
        self.capture_seconds = 0.0  # the trainer's thread, in snapshot()

    @property
    def held_seconds(self) -> float:
        """Total time optimizer.step() waited for a snapshot's bytes."""
        return self._gate.held_seconds

    # ---------------------------------------------------------------- the trainer's thread

    def snapshot(self, snap: Snapshot, optimizer: torch.optim.Optimizer, *, persist: bool) -> None:
        """Write ``snap`` (captured with ``defer=True``) into the next slot in the background; persist it
        afterwards when ``persist``. Waits for the previous snapshot first, raising its failure."""
        started = time.perf_counter()
        self.raise_background_error()  # a failed durable save is raised here, as an async save's is
        self.wait_snapshot()
        if not self.checked_capacity:
            self._check_capacity(state_bytes(snap))  # before the first snapshot: a refusal is the caller's
        elif self.recheck:
            try:
                self._check_capacity(state_bytes(snap))
            except CheckpointError as exc:  # decided together: every rank skips this snapshot
                self._not_taken(_step_of(snap), f"the memory directory has no room for it: {exc}", failed=False)
                if persist:  # on this thread, written before it returns
                    self._refused = None
                    self._durable_instead(_step_of(snap), snap)
                self.capture_seconds += time.perf_counter() - started
                return
        self._gate.close_on(optimizer)
        if self.buffers is not None and torch.cuda.is_available():
            self.buffers.source_stream = torch.cuda.current_stream()
        self._inflight = self._writer.submit(self._write, snap, persist)
        self.snapshots += 1
        self.capture_seconds += time.perf_counter() - started

    def wait_snapshot(self) -> None:
        """Block until the snapshot in flight is committed; raise its failure."""
        future, self._inflight = self._inflight, None
        if future is not None:
            future.result()

    def raise_background_error(self) -> None:
        """Raise the failure of a snapshot write or a durable copy that ended in the background."""
        if self._inflight is not None and self._inflight.done():
            self.wait_snapshot()
        if self.persist_queue.any_failed():
            self.wait_snapshot()
            self.persist_queue.wait()
        self.persist_queue.forget_done()

    def spread_later(self, slot: int) -> None:
        """Several nodes: persist the committed ``slot`` (this rank's files of it) on the writer thread."""
        self.wait_snapshot()
        self._inflight = self._writer.submit(self.persist_queue.spread, slot, self._files)

    def spread_now(self, slot: int) -> None:
        """Several nodes: persist the committed ``slot`` on the writer thread and wait for it."""
        submit_or_run(self._writer, self.persist_queue.spread, slot, self._files).result()

    def shutdown(self) -> None:
        """Stop the writer thread (after the work in flight)."""
        self._writer.shutdown()

    def remove_gate(self) -> None:
        """Unregister the step gate's hook (on the trainer's thread, never while ``step()`` runs)."""
        self._gate.remove()

    # ---------------------------------------------------------------- the writer thread

    def _pick_slot(self) -> int:
        """Rank 0: the slot the next snapshot goes to, or -1 when none may be written (MEM-2, :class:`RingPolicy`)."""
        with self._lock:
            ring = self._loaded_ring()
            index = ring.pick(newest=self.newest.slot if self.newest is not None else None, spare=self.spare)
        return -1 if index is None else index

    def _choose_slot(self, step: int) -> int:
        """Every rank: the slot rank 0 picked for the snapshot of ``step`` (-1: none may be written)."""
        index = decide(
            self.collective, None, lambda _: self._pick_slot(), what=f"the memory slot of step {step}", max_size=64
        )
        if not is_int(index) or not -1 <= index < self.tier.slot_count:
            raise MalformedMessageError(f"rank 0 chose memory slot {str(index)[:40]} for step {step}")
        return int(index)

    def _write(self, snap: Snapshot, persist: bool) -> None:
        """The background half of :meth:`snapshot`: the slot written and committed (every rank together), then its
        replica round and durable copy. A snapshot that fails is skipped on every rank (the writer's commit and
        :func:`~ckptfmt.decide.decide` make every rank learn one failure); its durable save, if one is due, is
        written from the same state straight to the run directory."""
        step = _step_of(snap)
        # What staging changes in the snapshot, for a durable save staged again from it: rank 0's rng becomes every
        # rank's, and the views' version counters are checked once (a torn state must fail that save too).
        contexts, sources = dict(snap.contexts), list(snap.sources)
        # Views of CPU tensors hold this step's state only while the next optimizer.step() is held: a durable save
        # due now keeps it held until the snapshot's outcome is known, so that it can be written instead.
        hold = persist and self.buffers is None
        self._refused = None
        self._writing = None
        committed: tuple[int, dict[int, tuple[FileRecord, ...]]] | None = None
        try:
            try:
                committed = self._write_slot(snap, step, release=not hold)
            except Exception as exc:  # every rank learnt it (the writer's commit, decide): all skip this snapshot
                if not isinstance(exc, CheckpointError | OSError):
                    log.error("memory snapshot of step %d: unexpected failure", step, exc_info=exc)
                if self._writing is not None:
                    self.ring.failed(self._writing)
                self._not_taken(step, f"{type(exc).__name__}: {exc}", failed=True)
            if committed is None and persist:
                snap.contexts.clear()
                snap.contexts.update(contexts)
                if self.buffers is None:
                    snap.sources[:] = sources
                self._durable_instead(step, snap)
        finally:
            self._gate.open()  # even on failure: never leave the trainer's optimizer blocked
        if committed is None:
            return
        slot, local = committed
        if self._rounds is not None:
            self._rounds.start(slot, step, local, self._files)
        if self.nodes.multi_node:
            if persist:
                self.persist_queue.spread(slot, self._files)
        elif self.rank == 0 and persist:
            self.persist_queue.submit(slot)

    def _write_slot(
        self, snap: Snapshot, step: int, *, release: bool
    ) -> tuple[int, dict[int, tuple[FileRecord, ...]]] | None:
        """Write and commit ``snap`` into the slot rank 0 picks: (slot, local replicas), or None when no slot may be
        written. Any failure is every rank's (raised on each). ``release``: let the trainer's next step run once
        the bytes are in the slot, before the commit. Otherwise, and on a failure or a skip, the caller releases it,
        after a durable save written instead has taken this step's state."""
        slot = self._choose_slot(step)
        if slot < 0:
            self._not_taken(
                step,
                "no slot may be rewritten: one is being persisted and the other holds the newest snapshot "
                "(spec/memory.md MEM-2)",
                failed=False,
            )
            return None
        self._writing = slot
        # this rank's part before the collective writer starts: a failure here is decided on together, so that
        # no rank starts a writer that the others never join
        problem: CheckpointError | None = None
        path = ""
        copying = False
        try:
            path = self.tier.writable_slot(slot)
            copying = True
            snap.materialize(self.buffers)
        except Exception as exc:
            problem = as_error(exc, self.rank)
            if copying and not snap.deferred:
                self._refused = problem  # copies made but not to be trusted (a source changed meanwhile)
        decide(self.collective, problem, lambda _: None, what=f"the memory snapshot of step {step}", max_size=1 << 20)
        spread = self.nodes.multi_node
        binding = SlotBinding(
            run_id=self.run_id,
            run_dir=normalize_run_url(self.run.url),
            node=self.node,
            world_size=self.world_size,
            step=step,
            nodes=self.nodes.nodes if spread else (),
        )
        writer = CheckpointWriter(
            SlotStore(path),
            profile="training",
            overwrite=True,
            collective=self.collective,
            metadata=binding.to_metadata(),
            store_of_rank=self.nodes.store_of_rank() if spread else None,
            # on this thread: a copy into memory is bound by memory, not by a disk's queue, so one core does it, and
            # no thread is started and no file handed over per snapshot
            workers=0,
            check_manifest=False,  # parsed by whoever reads the slot, which passes over one it refuses (MEM-6)
            plan_cache=self.plan_cache,
        )
        state.stage_snapshot(writer, snap)
        try:
            writer.flush()
        except BaseException:
            writer.abort()
            raise
        local = self._rounds.write_local(snap) if self._rounds is not None else {}
        if release:
            self._gate.open()
        ckpt_id = writer.commit()
        self._files = [f.path for f in writer.result().files]
        self.newest = SlotRef(slot, step, ckpt_id)
        self.ring.succeeded(slot)
        if self.rank == 0:
            with self._lock:
                self._loaded_ring().committed(slot, step)
        return slot, local

    def _not_taken(self, step: int, why: str, *, failed: bool) -> None:
        """Count and say that the snapshot of ``step`` was not taken (every rank, together); after a failed one the
        capacity is checked again before the next (a full tmpfs may have drained, or filled for good)."""
        self.skipped += 1
        if failed:
            self.failed += 1
            self.recheck = True
        held = f"step {self.newest.step}" if self.newest is not None else "none"
        log.warning(
            "memory snapshot of step %d skipped: %s; the newest snapshot in memory is %s, and training goes on",
            step,
            why,
            held,
        )

    def _durable_instead(self, step: int, snap: Snapshot) -> None:
        """A durable save due at ``step``, whose memory snapshot was not taken: the same state written straight to
        the run directory by the caller's ``write_durable`` (every rank together; a rank whose state could not be
        taken makes that save fail for all). Its failure is raised, as a failed durable save's is."""
        if self.write_durable is None:
            log.warning("durable save of step %d not made: its memory snapshot was not taken", step)
            return
        problem = self._refused
        if problem is None and snap.deferred:
            try:
                snap.materialize(self.buffers)
            except Exception as exc:
                problem = as_error(exc, self.rank)
        self.write_durable(step, snap, problem)
        self.persist_queue.made_durable(step)
        log.warning(
            "durable save of step %d written straight to %s, as its memory snapshot was not taken", step, self.run.url
        )
