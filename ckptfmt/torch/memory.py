"""The trainer's side of the memory tier: a snapshot in node memory every few steps, durable saves made from it.

Call sequence (the manager drives it; every rank makes the same calls)::

    tier = MemorySnapshots(run, memory_dir=..., slots=2, collective=dedicated_group)
    candidates = tier.candidates()            # at start: this run's committed slots, newest first
    tier.snapshot(step, persist=..., **state) # on the trainer's thread, every memory_every steps
    tier.wait()                               # the snapshot in flight committed, persists done
    tier.close()

A snapshot captures on the trainer's thread what the next forward pass may change (RNG, data position,
config, scheduler, buffers); parameters and optimizer state are written by a background thread straight
from the live tensors (CPU) or from pinned host copies made on a side stream (CUDA) while the next
forward and backward run, and an optimizer step pre-hook holds the next ``step()`` until those bytes are
in the slot. The snapshot is a checkpoint written by the ordinary writer, with the ordinary collective
commit, into the node's slot (:class:`~ckptfmt.storage.slot.SlotStore`); rank 0 picks the slot.

A durable save is a persist of a committed slot (:func:`ckptfmt.tier.persist`): rank 0 copies the
node's slot into the run directory in a throttled background thread; the slot is held out of the ring
until the copy is done. On SIGTERM the newest committed slot is persisted at once by a watcher thread
(it runs even while the trainer's thread is blocked in a collective with a dead peer).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..collective import Collective, PeerChannel, decode_status, encode_status
from ..errors import CheckpointError, CheckpointExistsError, MemoryCapacityError, UsageError
from ..manifest import MAX_MANIFEST_BYTES, FileRecord
from ..run import RunDirectory
from ..storage.slot import SlotStore
from ..tier import MemoryTier, Slot, SlotBinding, Throttle, node_key, persist, run_identity
from ..tier.agreed import AgreedRestore
from ..tier.binding import normalize_run_url
from ..tier.nodes import NodeMap
from ..tier.persist import Persisted, lower_thread_priority, persist_spread
from ..tier.replica import Replicator
from ..writer import CheckpointWriter
from . import state
from .sharding import LocalShard, owners, replicated_sizes
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCandidate:
    """A committed slot this run may restore from."""

    step: int
    url: str
    checkpoint_id: str


def state_bytes(snap: Snapshot) -> int:
    """Tensor bytes this rank puts in a snapshot (deferred tensors at their live size)."""
    total = sum(int(getattr(v, "nbytes", 0)) for named in snap.tensors.values() for v in named.values())
    for _, _, tensor in snap.deferred:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


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
        keep_last: int | None = None,
        keep_every: int | None = None,
        on_persisted: Callable[[Persisted], None] | None = None,
        replicate: bool = False,
        channel: PeerChannel | None = None,
    ) -> None:
        self.run = run
        self.tier = MemoryTier(memory_dir, run.url, slots=slots)
        self.collective = collective
        self.rank = collective.rank if collective is not None else 0
        self.node = node_key()
        self.run_id = run_identity(run.url)
        self.world_size = collective.world_size if collective is not None else 1
        self.persist_duty = persist_duty
        self.codec = codec  # of durable saves; memory snapshots are raw
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_persisted = on_persisted
        self.nodes = NodeMap.gather(collective, self.node)
        self.channel = channel
        self.tier.ensure()
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
        self._held: dict[int, int] = {}  # slot -> number of persists copying it (out of the ring meanwhile)
        self._lock = threading.Lock()
        self._slot_steps: dict[int, int | None] | None = None  # rank 0's view of the ring
        self._copied = threading.Event()
        self._copied.set()
        self._gated: Any = None  # the optimizer the step gate is registered on
        self._gate: Any = None
        self._checked_capacity = False
        self.buffers = HostBuffers(pinned=True) if torch.cuda.is_available() else None
        self.newest: tuple[int, int, str] | None = None  # (slot, step, checkpoint id) of the newest commit
        self.snapshots = 0
        self.skipped = 0
        self.capture_seconds = 0.0  # the trainer's thread, in snapshot()
        self.held_seconds = 0.0  # optimizer.step() waiting for a snapshot's bytes
        self.last_persisted: Persisted | None = None
        self._watcher: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None

    # ---------------------------------------------------------------- set-up

    def check_capacity(self, per_rank: int) -> None:
        """Refuse slots that would not fit the memory directory (all ranks raise the same error)."""
        totals = [per_rank]
        if self.collective is not None:
            gathered = self.collective.gather(str(per_rank).encode(), dst=0)
            totals = [int(g) for g in gathered] if gathered is not None else []
        # every node checks its own memory directory for its ranks' share (and, with replicas, one more share:
        # its partners' copies); the first refusal is every rank's
        verdict: bytes | None = None
        if self.collective is not None:
            shares = json.dumps(totals).encode() if self.rank == 0 else None
            totals = json.loads(self.collective.broadcast(shares, src=0))
        error: MemoryCapacityError | None = None
        if self.nodes.leader(self.node) == self.rank:
            mine = sum(totals[r] for r in self.nodes.ranks_of(self.node))
            if self.replicator is not None:
                mine *= 2
            try:
                self.tier.check_capacity(mine)
            except MemoryCapacityError as exc:
                error = exc
        if self.collective is not None:
            statuses = self.collective.gather(encode_status(error), dst=0)
            if statuses is not None:
                verdict = next((s for s in statuses if b'"error"' in s), encode_status(None))
            verdict = self.collective.broadcast(verdict, src=0)
        else:
            verdict = encode_status(error)
        decode_status(verdict)
        self._checked_capacity = True

    # ---------------------------------------------------------------- restore

    def candidates(self) -> list[MemoryCandidate]:
        """This run's and node's committed slots, newest first (rank 0 looks; every rank gets its answer).
        Slots of another run or node, torn or invalid ones are logged with the reason and left out."""
        found: list[MemoryCandidate] = []
        if self.rank == 0:
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
                found.append(MemoryCandidate(step=slot.binding.step, url=slot.path, checkpoint_id=slot.checkpoint_id))
            found.sort(key=lambda c: c.step, reverse=True)
        if self.collective is None:
            return found
        data = json.dumps([[c.step, c.url, c.checkpoint_id] for c in found]).encode() if self.rank == 0 else None
        return [
            MemoryCandidate(step=int(s), url=str(u), checkpoint_id=str(i))
            for s, u, i in json.loads(self.collective.broadcast(data, src=0))
        ]

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
        background (rank 0), so it outlives this node."""
        slot = int(candidate.url.rstrip("/").rpartition("-")[2]) if candidate is not None else None
        if self.across_nodes:
            # a restore across nodes read from several directories, perhaps of another world: no slot here is
            # that snapshot whole, so none is adopted or persisted; every slot holding a newer step is dropped
            slot = None
        if candidate is not None and slot is not None:
            self.newest = (slot, candidate.step, candidate.checkpoint_id)
        if self.rank != 0:
            return
        with self._lock:
            ring = self._ring()
            for index, held in ring.items():
                if held is not None and (held > step or (held == step and index != slot)):
                    ring[index] = None
        if slot is not None:
            self._submit_persist(slot)

    # ---------------------------------------------------------------- snapshots

    def snapshot(self, snap: Snapshot, optimizer: torch.optim.Optimizer, *, persist: bool) -> None:
        """Write ``snap`` (captured with ``defer=True``) into the next slot in the background; persist it
        afterwards when ``persist``. Waits for the previous snapshot first, raising its failure."""
        started = time.perf_counter()
        self.raise_background_error()  # a failed durable save is raised here, as an async save's is
        self.wait_snapshot()
        if not self._checked_capacity:
            self.check_capacity(state_bytes(snap))
        self._gate_optimizer(optimizer)
        if self.buffers is not None and torch.cuda.is_available():
            self.buffers.source_stream = torch.cuda.current_stream()
        self._copied.clear()
        self._inflight = self._writer.submit(self._write, snap, persist)
        self.snapshots += 1
        self.capture_seconds += time.perf_counter() - started

    def _gate_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._gated is optimizer:
            return
        if self._gate is not None:
            self._gate.remove()

        def hold_step(opt: Any, args: Any, kwargs: Any) -> None:
            if not self._copied.is_set():
                start = time.perf_counter()
                self._copied.wait()
                self.held_seconds += time.perf_counter() - start

        self._gate = optimizer.register_step_pre_hook(hold_step)
        self._gated = optimizer

    def _ring(self) -> dict[int, int | None]:
        """Rank 0's view of the ring: slot -> committed step (None: empty, torn or being rewritten). Under _lock."""
        if self._slot_steps is None:
            self._slot_steps = {s.index: self._own_step(s) for s in self.tier.slots()}
        return self._slot_steps

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

    def _choose_slot(self) -> int:
        chosen: bytes | None = None
        if self.rank == 0:
            with self._lock:
                ring = self._ring()
                free = {s: step for s, step in ring.items() if not self._held.get(s)}
                index = min(free, key=lambda s: (free[s] is not None, free[s] or 0, s)) if free else -1
                if index >= 0:
                    ring[index] = None  # being rewritten: no persist may start on it now
            chosen = str(index).encode()
        if self.collective is not None:
            chosen = self.collective.broadcast(chosen, src=0)
        assert chosen is not None
        return int(chosen)

    def _write(self, snap: Snapshot, persist: bool) -> None:
        step = int(snap.contexts.get("provenance", {}).get("step", 0))
        try:
            slot = self._choose_slot()
            if slot < 0:  # every slot is being persisted: this step has no memory snapshot (never overwrite one)
                self.skipped += 1
                log.warning("memory snapshot of step %d skipped: every slot is being persisted", step)
                return
            snap.materialize(self.buffers)
            spread = self.nodes.multi_node
            binding = SlotBinding(
                run_id=self.run_id,
                run_dir=normalize_run_url(self.run.url),
                node=self.node,
                world_size=self.world_size,
                step=step,
                nodes=self.nodes.nodes if spread else (),
            )
            store = SlotStore(self.tier.writable_slot(slot))
            writer = CheckpointWriter(
                store,
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
        finally:
            self._copied.set()  # even on failure: never leave the trainer's optimizer blocked
        ckpt_id = writer.commit()
        self._files = [f.path for f in writer.result().files]
        self.newest = (slot, step, ckpt_id)
        if self.rank == 0:
            with self._lock:
                self._ring()[slot] = step
        self._replicate(slot, step, local)
        if self.nodes.multi_node:
            if persist:
                self._persist_spread(slot)
        elif self.rank == 0 and persist:
            self._submit_persist(slot)

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
        busy = self.collective.gather(b"1" if self.replicator.busy() else b"0", dst=0)
        decision = (b"skip" if b"1" in busy else b"go") if busy is not None else None
        if self.collective.broadcast(decision, src=0) != b"go":
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
            self._held[slot] = self._held.get(slot, 0) + 1
        try:
            done = persist_spread(
                self.tier.slot_path(slot),
                self.run,
                collective=self.collective,
                files=self._files,
                throttle=Throttle(self.persist_duty),
            )
        finally:
            with self._lock:
                self._held[slot] -= 1
        self.last_persisted = done
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
            step = self._ring().get(slot)
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
            if ring.get(slot) != step:  # rewritten since: the newest committed snapshot instead
                committed = {s: st for s, st in ring.items() if st is not None}
                if not committed:
                    return None
                slot = max(committed, key=lambda s: committed[s] or 0)
                log.warning(
                    "durable save of step %d taken from step %s: its slot was rewritten first", step, committed[slot]
                )
            self._held[slot] = self._held.get(slot, 0) + 1
        return self._persist_held(slot, self.persist_duty)

    def _persist_held(self, slot: int, duty: float) -> Persisted | None:
        """Copy a slot already held out of the ring; release it afterwards."""
        lower_thread_priority()
        try:
            done = persist(self.tier.slot_path(slot), self.run, throttle=Throttle(duty), codec=self.codec)
        except CheckpointExistsError as exc:  # another process persists the same step right now
            log.warning("memory slot %d not persisted: %s", slot, exc)
            return None
        finally:
            with self._lock:
                self._held[slot] -= 1
        if done.status == "conflict":
            log.warning(
                "%s holds another checkpoint of step %d: the memory snapshot was not persisted there",
                done.destination,
                done.step,
            )
        self.last_persisted = done
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
            committed = {s: step for s, step in self._ring().items() if step is not None}
            if not committed:
                return None
            slot = max(committed, key=lambda s: committed[s] or 0)
            self._held[slot] = self._held.get(slot, 0) + 1
        return self._persist_held(slot, 1.0)

    def close(self, *, persist: bool = True) -> None:
        """Wait for the work in flight; with ``persist``, make the newest snapshot durable if it is not yet
        (rank 0: "on exit, the newest snapshot is persisted"); then stop the threads."""
        try:
            self.wait()
            newest, done = self.newest, self.last_persisted
            if persist and newest is not None and (done is None or done.step < newest[1]):
                if self.nodes.multi_node:  # every rank copies its own files, together
                    self._writer.submit(self._persist_spread, newest[0]).result()
                else:
                    self.persist_newest()
        finally:
            if self.replicator is not None:
                self.replicator.close()
            self._writer.shutdown()
            self._persister.shutdown()
            if self._gate is not None:
                self._gate.remove()
                self._gate = None
            self.stop_watcher()

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
