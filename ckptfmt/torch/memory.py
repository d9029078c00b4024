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
(:class:`~ckptfmt.tier.ring.RingPolicy`).

A durable save is a persist of a committed slot (:func:`ckptfmt.tier.persist`): rank 0 copies the
node's slot into the run directory in a throttled background thread; the slot is held out of the ring
until the copy is done. On SIGTERM the newest committed slot is persisted at once by a watcher thread
(it runs even while the trainer's thread is blocked in a collective with a dead peer).

The slot holding the newest committed snapshot is never rewritten (spec/memory.md MEM-2): a two-slot ring
has a third, spare slot, written only while a slot is held for a durable copy and the other holds the newest
snapshot; without room for it (the capacity check), such a snapshot is skipped.

A snapshot that cannot be taken (no room in the memory directory, a failed write, a source changed during
its copy) is skipped on every rank together, with a warning: the older slots still hold, the capacity is
checked again before the next one, and training goes on. A durable save that falls due at such a step is
written from the live state straight to the run directory (the caller's ``write_durable``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..collective import Collective, PeerChannel
from ..decide import decide
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CollectiveError,
    MalformedMessageError,
    MemoryCapacityError,
    StorageError,
    UsageError,
)
from ..manifest import MAX_MANIFEST_BYTES, FileRecord, checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..run import RunDirectory, checkpoint_name
from ..storage import open_store
from ..storage.slot import SlotStore
from ..tier import MemoryTier, Slot, SlotBinding, Throttle, node_key, persist, run_identity
from ..tier.agreed import AgreedRestore
from ..tier.binding import normalize_run_url
from ..tier.nodes import NodeMap
from ..tier.persist import Persisted, lower_thread_priority, persist_spread
from ..tier.replica import Replicator
from ..tier.ring import RingPolicy, SlotRef
from ..writer import CheckpointWriter
from . import state
from .engines import StepGate
from .sharding import LocalShard, owners, replicated_sizes
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")

CHECKPOINT_ID = re.compile(r"sha256:[0-9a-f]{64}")
MAX_STATE_BYTES = 1 << 62  # what a rank may say its snapshot holds (a larger count is a malformed message)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCandidate:
    """A committed slot this run may restore from."""

    step: int
    url: str
    checkpoint_id: str
    slot: int  # its index in this node's ring (url is that slot's path here)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _byte_counts(values: object, *, expected: int | None = None) -> list[int]:
    """Every rank's snapshot bytes, checked: one non-negative count per rank (the first malformed one named)."""
    if not isinstance(values, list) or (expected is not None and len(values) != expected):
        raise MalformedMessageError("the snapshot sizes are not one count per rank")
    for rank, value in enumerate(values):
        if not _is_int(value) or not 0 <= value <= MAX_STATE_BYTES:
            raise MalformedMessageError(f"rank {rank} reported {str(value)[:40]} snapshot bytes, not a count")
    return values


def _spare_fits(values: Sequence[object]) -> bool:
    """The node leaders' capacity verdicts (the others send None): whether every node has room for a spare slot."""
    fits = True
    for rank, value in enumerate(values):
        if value is None:
            continue
        if not (isinstance(value, dict) and set(value) == {"spare"} and isinstance(value["spare"], bool)):
            raise MalformedMessageError(f"rank {rank} sent a malformed memory capacity verdict")
        fits = fits and value["spare"]
    return fits


def _one_bool(what: str, combine: Callable[[list[bool]], bool]) -> Callable[[Sequence[object]], bool]:
    """A decision over one boolean from every rank (a rank that sends anything else is named)."""

    def decide_fn(values: Sequence[object]) -> bool:
        for rank, value in enumerate(values):
            if not isinstance(value, bool):
                raise MalformedMessageError(f"rank {rank} sent {str(value)[:40]} as {what}, not a boolean")
        return combine([bool(v) for v in values])

    return decide_fn


def _as_error(exc: BaseException, rank: int) -> CheckpointError:
    """What a rank contributes to a decision when its part failed: a CheckpointError (an OSError, a bug's raw
    error wrapped, naming the rank)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return StorageError(f"rank {rank}: {exc}")
    return CollectiveError(f"rank {rank} failed: {exc!r}")


def _step_of(snap: Snapshot) -> int:
    return int(snap.contexts.get("provenance", {}).get("step", 0))


def state_bytes(snap: Snapshot) -> int:
    """Tensor bytes this rank puts in a snapshot (deferred tensors at their live size)."""
    total = sum(int(getattr(v, "nbytes", 0)) for named in snap.tensors.values() for v in named.values())
    for _, _, tensor in snap.deferred:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class _Abandoned(Exception):
    """Raised inside a persist's copy loop when close() stops waiting for it (its close_timeout ran out); the
    persist aborts (no manifest, its files and lock removed) and :meth:`MemorySnapshots._persist_held` says so."""


class _CopyThrottle(Throttle):
    """A persist's throttle that close() lifts (nothing trains beside the copy any more) and cuts off once its
    ``close_timeout`` ran out (checked after each piece of the copy)."""

    def __init__(self, duty: float, tier: MemorySnapshots) -> None:
        super().__init__(duty)
        self._tier = tier

    def after(self, seconds: float) -> None:
        deadline = self._tier._deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise _Abandoned
        if not self._tier._closing:
            super().after(seconds)


class MemorySnapshots:
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
        channel: PeerChannel | None = None,
        write_durable: Callable[[int, Snapshot, CheckpointError | None], None] | None = None,
        close_timeout: float | None = None,
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
        self.spare = False  # the memory directory has room for the spare slot (the capacity check, all ranks)
        self.collective = collective
        self.rank = collective.rank if collective is not None else 0
        self.node = node_key()
        self.run_id = run_identity(run.url)
        self.world_size = collective.world_size if collective is not None else 1
        self.persist_duty = persist_duty
        self.codec = codec  # of durable saves; memory snapshots are raw
        self.on_persisted = on_persisted
        self.nodes = NodeMap.gather(collective, self.node)
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
            self.replicator = Replicator(self.tier, channel, self.nodes, self.rank)
        self._replica_rounds = 0
        self._files: list[str] = []  # the files this rank wrote into the newest snapshot
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-memory")
        self._persister = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-persist")
        self._inflight: Future[None] | None = None
        self._persists: list[Future[Persisted | None]] = []
        self._waiting: tuple[int, int] | None = None  # (slot, step) of the persist queued behind the running one
        self._lock = threading.Lock()
        self._gate = StepGate()  # holds optimizer.step() until a snapshot's bytes are in the slot
        self._checked_capacity = False
        self._recheck = False  # a snapshot failed: check the capacity again before the next one
        self.write_durable = write_durable
        self._writing: int | None = None  # the slot of the snapshot being written
        self._refused: CheckpointError | None = None  # why this snapshot's copies are not to be written anywhere
        self.close_timeout = close_timeout
        self._closing = False  # close() runs: nothing trains beside a copy any more, so it is not throttled
        self._deadline: float | None = None  # time.monotonic() after which close() abandons a copy
        self._copying: tuple[int, int] | None = None  # (slot, step) that the persister copies now
        self.durable_step: int | None = None  # the newest step made durable by this process
        self.buffers = HostBuffers(pinned=True) if torch.cuda.is_available() else None
        self.newest: SlotRef | None = None  # the newest commit
        self.snapshots = 0
        self.skipped = 0  # snapshots not taken: no slot could be written (MEM-2), or their write failed
        self.failed = 0  # of those, the ones whose write failed (every rank counts the same)
        self.capture_seconds = 0.0  # the trainer's thread, in snapshot()
        self.last_persisted: Persisted | None = None
        self._watcher: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None

    # ---------------------------------------------------------------- set-up

    def check_capacity(self, per_rank: int) -> None:
        """Refuse slots that would not fit the memory directory (all ranks raise the same error); find whether the
        spare slot fits too (``self.spare``, the same on every rank).

        Two decisions of every rank (:func:`~ckptfmt.decide.decide`): the ranks' snapshot sizes, then every node
        leader's look at its own memory directory for its ranks' share (and, with replicas, one more share: its
        partners' copies)."""
        decided = decide(
            self.collective, per_rank, lambda values: _byte_counts(list(values)), what="the snapshot sizes", max_size=64
        )
        totals = _byte_counts(decided, expected=self.world_size)
        verdict: dict[str, bool] | CheckpointError | None = None
        if self.nodes.leader(self.node) == self.rank:
            mine = sum(totals[r] for r in self.nodes.ranks_of(self.node))
            sources: set[int] = set()  # whose copies this node's ranks receive (rewritten in place by the rounds)
            if self.replicator is not None:
                mine *= 2
                sources = {s for r in self.nodes.ranks_of(self.node) for s in self.nodes.sources_of(r)}
            try:
                verdict = {"spare": self._room(mine, sources)}
            except CheckpointError as exc:
                verdict = exc
        spare = decide(self.collective, verdict, _spare_fits, what="the memory capacity check", max_size=64 << 10)
        if not isinstance(spare, bool):
            raise MalformedMessageError(f"the memory capacity check decided {spare!r}, not a boolean")
        if self.tier.slot_count > self.ring_slots and not spare and self.rank == 0:
            log.warning(
                "%s has room for %d memory slots but not for a spare one: a snapshot that falls due while a slot "
                "is being persisted and the other holds the newest snapshot is skipped (spec/memory.md MEM-2)",
                self.tier.memory_dir,
                self.ring_slots,
            )
        self.spare = spare
        self._checked_capacity = True
        self._recheck = False

    def _room(self, share: int, sources: set[int]) -> bool:
        """Whether this node's memory directory fits the ring and its spare slot (True), the ring alone (False);
        MemoryCapacityError when not even the ring fits."""
        try:
            self.tier.check_capacity(share, peer_sources=sources)
            return self.tier.slot_count > self.ring_slots
        except MemoryCapacityError:
            if self.tier.slot_count == self.ring_slots:
                raise
        ring = MemoryTier(self.tier.memory_dir, self.run.url, slots=self.ring_slots)
        ring.check_capacity(share, peer_sources=sources)
        return False

    # ---------------------------------------------------------------- restore

    def candidates(self) -> list[MemoryCandidate]:
        """This run's and node's committed slots, newest first (rank 0 looks; every rank gets its answer, each
        slot named by its index in this rank's own ring). Slots of another run or node, torn or invalid ones are
        logged with the reason and left out."""

        def listing(_: Sequence[object]) -> list[tuple[int, int, str]]:
            found: list[tuple[int, int, str]] = []
            for slot in self.tier.slots():
                if slot.status == "empty":
                    continue
                if slot.status != "committed" or slot.binding is None or slot.checkpoint_id is None:
                    log.warning("memory slot %s ignored: %s", slot.path, slot.reason or slot.status)
                    continue
                foreign = self._foreign(slot.binding)
                if foreign is not None:
                    log.warning(
                        "memory slot %s (step %d) ignored: %s; `ckpt rescue %s %s` persists it",
                        slot.path,
                        slot.binding.step,
                        foreign,
                        self.tier.memory_dir,
                        self.run.url,
                    )
                    continue
                found.append((slot.binding.step, slot.index, slot.checkpoint_id))
            found.sort(key=lambda c: c[0], reverse=True)
            return found

        decided = decide(self.collective, None, listing, what="the memory slots", max_size=64)
        return self._parse_candidates(decided)

    def _parse_candidates(self, decided: object) -> list[MemoryCandidate]:
        """The coordinator's list of ``[step, slot index, checkpoint id]``, checked as the hostile input it may be
        (the same checks on every rank, so every rank accepts or refuses it alike)."""
        if not isinstance(decided, list) or len(decided) > self.tier.slot_count:
            raise MalformedMessageError("rank 0 sent a malformed list of memory slots")
        out: list[MemoryCandidate] = []
        for entry in decided:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise MalformedMessageError(f"rank 0 sent a malformed memory slot entry: {str(entry)[:80]}")
            step, index, ckpt_id = entry
            if not _is_int(step) or step < 0:
                raise MalformedMessageError(f"rank 0 sent a memory slot with step {str(step)[:40]}")
            if not _is_int(index) or not 0 <= index < self.tier.slot_count:
                raise MalformedMessageError(f"rank 0 sent memory slot index {str(index)[:40]}")
            if not isinstance(ckpt_id, str) or CHECKPOINT_ID.fullmatch(ckpt_id) is None:
                raise MalformedMessageError(f"rank 0 sent a memory slot with checkpoint id {str(ckpt_id)[:80]!r}")
            out.append(MemoryCandidate(step=step, url=self.tier.slot_path(index), checkpoint_id=ckpt_id, slot=index))
        return out

    def agreed(self) -> AgreedRestore:
        """The restore across nodes (several nodes, or replicas): what every node holds, agreed on every rank."""
        return AgreedRestore(
            self.tier,
            collective=self.collective,
            channel=self.channel,
            nodes=self.nodes,
            node=self.node,
            run_id=self.run_id,
            run_dir=self.run.url,
            rank=self.rank,
        )

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
            self.newest = SlotRef(slot, candidate.step, candidate.checkpoint_id)
        if self.rank != 0:
            return
        with self._lock:
            self._ring().drop_after(step, slot)
        if slot is None or candidate is None:
            return
        durable = self._durable_id(candidate.step)
        if durable is None:
            self._submit_persist(slot)
            return
        self.durable_step = max(self.durable_step or -1, candidate.step)
        # (a durable copy made with a codec has an id of its own: that the step is there is enough)
        if durable != candidate.checkpoint_id and self.codec is None:
            log.warning(
                "%s holds another checkpoint of step %d: the restored memory snapshot was not persisted there",
                self.run.child_url(checkpoint_name(candidate.step)),
                candidate.step,
            )

    def _durable_id(self, step: int) -> str | None:
        """The checkpoint id of the run directory's committed ``step-<step>``; None when there is none (or it cannot
        be read: then a persist finds out what is there)."""
        try:
            store = open_store(self.run.child_url(checkpoint_name(step)), self.run.storage_options)
            return checkpoint_id(read_manifest_bytes(store))
        except CheckpointError:
            return None

    # ---------------------------------------------------------------- snapshots

    def snapshot(self, snap: Snapshot, optimizer: torch.optim.Optimizer, *, persist: bool) -> None:
        """Write ``snap`` (captured with ``defer=True``) into the next slot in the background; persist it
        afterwards when ``persist``. Waits for the previous snapshot first, raising its failure."""
        started = time.perf_counter()
        self.raise_background_error()  # a failed durable save is raised here, as an async save's is
        self.wait_snapshot()
        if not self._checked_capacity:
            self.check_capacity(state_bytes(snap))  # before the first snapshot: a refusal is the caller's
        elif self._recheck:
            try:
                self.check_capacity(state_bytes(snap))
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

    @property
    def held_seconds(self) -> float:
        """Total time optimizer.step() waited for a snapshot's bytes."""
        return self._gate.held_seconds

    def _ring(self) -> RingPolicy:
        """Rank 0's ring, loaded from the slots on first use (under _lock)."""
        if not self.ring.loaded:
            self.ring.load({s.index: self._own_step(s) for s in self.tier.slots()})
        return self.ring

    def _own_step(self, slot: Slot) -> int | None:
        """The step of a committed slot of this run and node; None for any other (free to rewrite)."""
        if slot.status != "committed" or slot.binding is None or self._foreign(slot.binding) is not None:
            return None
        return slot.binding.step

    def _foreign(self, binding: SlotBinding) -> str | None:
        """Why a slot bound so is not this run's, node's and run directory's (MEM-4), or None when it is."""
        why = binding.foreign_to(run_id=self.run_id, node=self.node)
        if why is None and normalize_run_url(binding.run_dir) != normalize_run_url(self.run.url):
            why = f"written for run directory {binding.run_dir!r}"
        return why

    def _pick_slot(self) -> int:
        """Rank 0: the slot the next snapshot goes to, or -1 when none may be written (MEM-2, :class:`RingPolicy`)."""
        with self._lock:
            index = self._ring().pick(newest=self.newest.slot if self.newest is not None else None, spare=self.spare)
        return -1 if index is None else index

    def _choose_slot(self, step: int) -> int:
        """Every rank: the slot rank 0 picked for the snapshot of ``step`` (-1: none may be written)."""
        index = decide(
            self.collective, None, lambda _: self._pick_slot(), what=f"the memory slot of step {step}", max_size=64
        )
        if not _is_int(index) or not -1 <= index < self.tier.slot_count:
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
        self._replicate(slot, step, local)
        if self.nodes.multi_node:
            if persist:
                self._persist_spread(slot)
        elif self.rank == 0 and persist:
            self._submit_persist(slot)

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
            problem = _as_error(exc, self.rank)
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
        )
        state.stage_snapshot(writer, snap)
        try:
            writer.flush()
        except BaseException:
            writer.abort()
            raise
        local = self._write_local_replicas(snap)
        if release:
            self._gate.open()
        ckpt_id = writer.commit()
        self._files = [f.path for f in writer.result().files]
        self.newest = SlotRef(slot, step, ckpt_id)
        self.ring.succeeded(slot)
        if self.rank == 0:
            with self._lock:
                self._ring().committed(slot, step)
        return slot, local

    def _not_taken(self, step: int, why: str, *, failed: bool) -> None:
        """Count and say that the snapshot of ``step`` was not taken (every rank, together); after a failed one the
        capacity is checked again before the next (a full tmpfs may have drained, or filled for good)."""
        self.skipped += 1
        if failed:
            self.failed += 1
            self._recheck = True
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
                problem = _as_error(exc, self.rank)
        self.write_durable(step, snap, problem)
        self.durable_step = max(self.durable_step or -1, step)
        log.warning(
            "durable save of step %d written straight to %s, as its memory snapshot was not taken", step, self.run.url
        )

    def _write_local_replicas(self, snap: Snapshot) -> dict[int, tuple[FileRecord, ...]]:
        """Data-parallel replicas are not copied again (spec/memory.md, replicas): when a rank that replicates to this
        one holds the same state (DDP: everything; HSDP or ``Replicate()`` placements: the same piece of every
        sharded tensor), its share is written here from this rank's own state, into its copy directory, while the
        step is still held; the round then sends only what differs from the manifest. Nothing here can fail the
        snapshot: a file not written is sent."""
        if self.replicator is None or not self.replicator.sources:
            return {}
        assigned = owners(replicated_sizes(snap.tensors), self.world_size)
        shards = [v for named in snap.tensors.values() for v in named.values() if isinstance(v, LocalShard)]
        out: dict[int, tuple[FileRecord, ...]] = {}
        for src in self.replicator.sources:
            if any(src not in v.holders for v in shards):
                continue  # the source holds other pieces than this rank (sharded, not replicated, between the two)
            mine = [
                (f, n, v)
                for f, named in snap.tensors.items()
                for n, v in named.items()
                if (v.writer_rank == src if isinstance(v, LocalShard) else assigned.get(f"{f}/{n}") == src)
            ]
            if not mine:
                continue
            try:
                store = SlotStore(self.replicator.local_dir(src, self._replica_rounds))
                writer = CheckpointWriter(store, profile="training", overwrite=True, rank=src)
            except CheckpointError as exc:
                log.warning("local replica of rank %d not written: %s", src, exc)
                continue
            try:
                for name in snap.tensors:  # the fields in the order the source declares them (file names follow)
                    writer.write_tensors(name, {})
                    for field_name, tname, value in mine:
                        if field_name != name:
                            continue
                        if isinstance(value, LocalShard):
                            writer.write_tensor(
                                name, tname, value.array, global_shape=value.global_shape, offsets=value.offsets
                            )
                        else:
                            writer.write_tensor(name, tname, value)
                out[src] = writer.release()
            except CheckpointError as exc:
                writer.abort()
                log.warning("local replica of rank %d not written: %s", src, exc)
        return out

    def _replicate(self, slot: int, step: int, local: dict[int, tuple[FileRecord, ...]]) -> None:
        """Start a replica round for the snapshot just committed, when every rank's previous round is done (all
        ranks decide together: a partner still busy makes every rank skip this one, never wait)."""
        if self.replicator is None or self.collective is None:
            return
        go = decide(
            self.collective,
            self.replicator.busy(),
            _one_bool("whether its replica round is still busy", lambda busy: not any(busy)),
            what=f"the replica round of step {step}",
            max_size=64,
        )
        if not isinstance(go, bool):
            raise MalformedMessageError(f"rank 0 decided {str(go)[:40]} on the replica round of step {step}")
        if not go:
            self.replicator.skipped += 1
            log.info("replica of step %d skipped: the previous one is still being copied", step)
            return
        path = self.tier.slot_path(slot)
        manifest = SlotStore(path).read("manifest.json", max_size=MAX_MANIFEST_BYTES)
        self.replicator.start(
            self._replica_rounds, step=step, slot_path=path, manifest_bytes=manifest, files=self._files, local=local
        )
        self._replica_rounds += 1

    def _persist_spread(self, slot: int) -> None:
        """Several nodes: every rank copies its files of the slot into the run directory, rank 0 commits (on this
        thread: the ranks' copies must line up, so they are not coalesced as one node's are)."""
        assert self.collective is not None
        with self._lock:
            self.ring.hold(slot)
        try:
            done = persist_spread(
                self.tier.slot_path(slot),
                self.run,
                collective=self.collective,
                files=self._files,
                throttle=Throttle(1.0 if self._closing else self.persist_duty),
            )
        finally:
            with self._lock:
                self.ring.release(slot)
        self.last_persisted = done
        self.durable_step = max(self.durable_step or -1, done.step)
        if self.rank == 0 and self.on_persisted is not None:
            self.on_persisted(done)

    def _submit_persist(self, slot: int) -> None:
        """Persist the snapshot just committed in ``slot`` in the background.

        Only a running copy holds its slot out of the ring; one waiting behind it does not (two held slots
        would leave a two-slot ring nowhere to write). At most one waits: a newer one due meanwhile replaces
        it. A waiting copy whose slot was rewritten before it started takes the newest committed snapshot
        instead, so a disk slower than the durable cadence makes durable saves sparser or later, never
        stalls the trainer, never skips a memory snapshot, and never persists an older step after a newer.
        """
        with self._lock:
            step = self._ring().step_of(slot)
            if self._waiting is not None:
                log.warning("durable save of step %s dropped: step %s is due before it started", self._waiting[1], step)
            self._waiting = (slot, step if step is not None else -1)
        self._persists.append(self._persister.submit(self._persist_waiting))

    def persist_slot(self, slot: int) -> None:
        """Persist the committed snapshot in ``slot`` in the background (one node: rank 0, the others have nothing
        to do; several: every rank copies its own files, so every rank calls this)."""
        if self.nodes.multi_node:
            self.wait_snapshot()
            self._inflight = self._writer.submit(self._persist_spread, slot)
        elif self.rank == 0:
            self._submit_persist(slot)

    def _persist_waiting(self) -> Persisted | None:
        with self._lock:
            waiting, self._waiting = self._waiting, None
            if waiting is None:  # replaced by a newer one, which an earlier task already took
                return None
            slot, step = waiting
            ring = self._ring()
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
        return self._persist_held(slot, step, self.persist_duty)

    def _persist_held(self, slot: int, step: int, duty: float) -> Persisted | None:
        """Copy a slot already held out of the ring; release it afterwards."""
        lower_thread_priority()
        self._copying = (slot, step)
        try:
            done = persist(self.tier.slot_path(slot), self.run, throttle=_CopyThrottle(duty, self), codec=self.codec)
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
            self._copying = None
            with self._lock:
                self.ring.release(slot)
        if done.status == "conflict":
            log.warning(
                "%s holds another checkpoint of step %d: the memory snapshot was not persisted there",
                done.destination,
                done.step,
            )
        self.last_persisted = done
        self.durable_step = max(self.durable_step or -1, done.step)  # a conflict too: nothing more to do there
        if self.on_persisted is not None:
            self.on_persisted(done)
        return done

    # ---------------------------------------------------------------- waiting and shutdown

    def wait_snapshot(self) -> None:
        """Block until the snapshot in flight is committed; raise its failure."""
        future, self._inflight = self._inflight, None
        if future is not None:
            future.result()

    def wait_replica(self) -> None:
        """Block until this rank's part of the replica round in flight is done (its failures are logged)."""
        self.wait_snapshot()
        if self.replicator is not None:
            self.replicator.wait()

    def wait(self) -> Persisted | None:
        """The snapshot in flight committed and every persist done; the first failure is raised."""
        self.wait_snapshot()
        futures, self._persists = self._persists, []
        last = None
        for future in futures:
            last = future.result() or last
        return last

    def raise_background_error(self) -> None:
        if self._inflight is not None and self._inflight.done():
            self.wait_snapshot()
        if any(f.done() and f.exception() is not None for f in self._persists):
            self.wait()
        # persists that went well need no more looking at (a long run makes thousands of them)
        self._persists = [f for f in self._persists if not f.done()]

    def persist_newest(self) -> Persisted | None:
        """Persist the newest committed snapshot now, unthrottled, on the calling thread (SIGTERM); None when
        there is none or this is not rank 0 (or the snapshot is spread over several nodes)."""
        if self.rank != 0 or self.nodes.multi_node:
            return None
        with self._lock:
            newest = self._ring().newest_committed()
            if newest is None:
                return None
            self.ring.hold(newest[0])
        return self._persist_held(newest[0], newest[1], 1.0)

    def close(self, *, persist: bool = True) -> None:
        """Wait for the work in flight; with ``persist``, make the newest snapshot durable if it is not yet
        (rank 0: "on exit, the newest snapshot is persisted"); then stop the threads.

        Nothing trains beside the copies any more, so they run unthrottled; a wait for one is logged, and with
        ``close_timeout`` rank 0 abandons one node's copies that outlast it (the snapshot stays in memory)."""
        try:
            self.wait_snapshot()
            self._closing = True
            if self.close_timeout is not None:
                self._deadline = time.monotonic() + self.close_timeout
            self._announce_wait()
            self.wait()
            newest, durable = self.newest, self.durable_step
            if persist and newest is not None and (durable is None or durable < newest.step):
                if self.nodes.multi_node:  # every rank copies its own files, together
                    self._writer.submit(self._persist_spread, newest.slot).result()
                else:
                    self.persist_newest()
        finally:
            if self.replicator is not None:
                self.replicator.close()
            self._writer.shutdown()
            self._persister.shutdown()
            self._gate.remove()
            self.stop_watcher()

    def _announce_wait(self) -> None:
        """Say what close() waits for, when a durable copy is still running or queued."""
        if all(f.done() for f in self._persists):
            return
        copying, waiting = self._copying, self._waiting
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

    # ---------------------------------------------------------------- SIGTERM while blocked

    def start_watcher(self, signals: tuple[signal.Signals, ...]) -> None:
        """Persist the newest snapshot as soon as one of ``signals`` arrives, from a thread of its own.

        A Python signal handler runs only when the main thread returns to the interpreter, which a trainer
        blocked in a collective with a dead peer never does before torchrun's SIGKILL. The C-level handler
        writes the signal number to the wakeup fd, which this thread reads at once. Main thread only, and
        only when nobody else (asyncio) owns the wakeup fd.
        """
        if self.rank != 0 or threading.current_thread() is not threading.main_thread():
            return
        if self.nodes.multi_node:
            # rank 0 alone holds only its node's files of a snapshot; a persist takes every rank
            # (checkpoint_if_due's preemption save), and replicas keep what a lost node held
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        wanted = {int(s) for s in signals}

        def watch() -> None:
            while True:
                try:
                    data = os.read(read_fd, 64)
                except OSError:
                    return
                if not data:
                    return
                if wanted & set(data):
                    try:
                        done = self.persist_newest()
                        if done is not None:
                            log.warning(
                                "signal received: memory snapshot of step %d is durable (%s)", done.step, done.status
                            )
                    except CheckpointError as exc:
                        log.error("signal received: the newest memory snapshot could not be persisted: %s", exc)

        self._watcher = threading.Thread(target=watch, name="ckptfmt-sigterm", daemon=True)
        self._watcher.start()

    def stop_watcher(self) -> None:
        if self._wakeup is None:
            return
        read_fd, write_fd = self._wakeup
        self._wakeup = None
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        os.close(write_fd)
        os.close(read_fd)
