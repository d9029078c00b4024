"""The memory save engine: a snapshot in node memory every ``memory_every`` steps, made durable from there.

It wraps :class:`~ckptfmt.torch.memory.MemorySnapshots` (slots, persists, replicas) for the manager: the cadence,
the capture, the process groups of its own, retention after each persist. A durable save that falls due at a step
whose snapshot could not be taken is written straight to the run directory by a :class:`DurableEngine` (sync,
full), over the memory tier's own process group.

A persist copies the slot byte for byte (re-encoded with ``codec``); with ``incremental=True`` it re-writes the
snapshot referencing the chunks of the previous durable save that are unchanged
(:class:`~ckptfmt.tier.persist_incremental.IncrementalPersist`, ``full_every`` and ``frozen`` as for a direct save).
That is one node's persist: a job whose snapshots span several nodes persists them from every node at once, by
copying, so ``incremental=True`` there is refused at construction.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta

from ..codecs.xor_zstd import is_delta
from ..collective import Collective, PeerChannel
from ..errors import CheckpointError, UsageError
from ..run import RunDirectory, checkpoint_name
from ..tier.persist import Persisted
from ..tier.persist_incremental import IncrementalPersist
from ..tier.replica import RoundResult
from . import api
from .durable import DurableEngine
from .engines import Due
from .memory import MemorySnapshots
from .options import DurableOptions, MemoryOptions, RetentionOptions
from .replica_rounds import ReplicaLag
from .state import Snapshot
from .training_state import Lineage, TrainingState

log = logging.getLogger("ckptfmt")


class MemoryEngine:
    """Snapshots into node memory, persisted every ``every`` steps (see the module docstring)."""

    def __init__(
        self,
        run: RunDirectory,
        *,
        options: MemoryOptions,
        codec: str | None = None,
        durable: DurableOptions | None = None,
        lineage: Lineage,
        retention: RetentionOptions,
        collective: Collective | None,
        process_group: object,
    ) -> None:
        if durable is not None:  # the manager's durable options: the codec, and how a persist references a base
            codec = durable.codec
        if is_delta(codec):
            raise UsageError(
                "codec 'xor-zstd' is for durable incremental saves; the memory tier persists in zstd or raw"
            )
        self.run = run
        self.options = options
        self.lineage = lineage
        self.retention = retention
        # its own process group: snapshots commit from a background thread, while the trainer's thread runs the
        # model's collectives on the default group
        timeout = timedelta(seconds=options.peer_timeout)
        dedicated: Collective | None = (
            collective if collective is not None else api._collective(process_group, dedicated=True, timeout=timeout)
        )
        channel = collective if isinstance(collective, PeerChannel) else None
        if options.replicate and collective is None:  # its own group again: replica rounds run beside snapshots
            channel = api._collective(process_group, dedicated=True, timeout=timeout, purpose="replica")
        # durable saves written instead of a snapshot not taken: full ones, on the snapshots' own group
        self._direct = DurableEngine(
            run, collective=dedicated, lineage=lineage, retention=retention, options=DurableOptions(codec=codec)
        )
        self.snapshots = MemorySnapshots(
            run,
            memory_dir=options.memory_dir,
            slots=options.slots,
            collective=dedicated,
            persist_duty=options.persist_duty,
            codec=codec,
            on_persisted=self._on_persisted,
            replicate=options.replicate,
            replicas=options.replicas,
            replica_rate=options.replica_rate,
            channel=channel,
            write_durable=self._write_durable,
            close_timeout=options.close_timeout,
            copy=(
                IncrementalPersist(full_every=durable.full_every, frozen=durable.frozen)
                if durable is not None and durable.incremental
                else None
            ),
        )
        if durable is not None and durable.incremental and self.snapshots.nodes.multi_node:
            # (every rank sees the same nodes: every rank refuses)
            self.snapshots.close(persist=False)
            raise UsageError(
                "incremental=True cannot be combined with memory_every= on several nodes: a snapshot spread over "
                "several nodes' memory is persisted from every node at once, as a copy; give incremental=True on "
                "one node, or not at all"
            )

    @property
    def held_seconds(self) -> float:
        return self.snapshots.held_seconds

    @property
    def multi_node(self) -> bool:
        return self.snapshots.nodes.multi_node

    def start_watcher(self, signals: tuple[signal.Signals, ...]) -> None:
        self.snapshots.start_watcher(signals)

    def due(self, step: int, *, every: int, preempted: bool) -> Due:
        """A snapshot every ``memory_every`` steps, persisted every ``every`` steps; after a preemption signal, one at
        once, persisted before the process exits."""
        durable = step % every == 0
        return Due(write=preempted or durable or step % self.options.every == 0, durable=durable)

    def save(self, step: int, state: TrainingState, *, persist: bool) -> None:
        """A memory snapshot of the full training state (persisted afterwards when ``persist``)."""
        memory = self.snapshots
        memory.wait_snapshot()
        newest = memory.newest
        if newest is not None:
            self.lineage.last_checkpoint_id = newest.checkpoint_id
            if newest.step == step == self.lineage.step:  # in a slot already (a save() after checkpoint_if_due)
                if persist:
                    memory.persist_slot(newest.slot)
                return
        snap = self.lineage.capture(step, state, defer=True)
        self.lineage.step = step
        assert state.optimizer is not None
        memory.snapshot(snap, state.optimizer, persist=persist)

    def _on_persisted(self, done: Persisted) -> None:
        """Rank 0's persist thread, after a memory snapshot became a durable checkpoint: retention."""
        if done.status == "persisted":
            self.run.gc(keep_last=self.retention.keep_last, keep_every=self.retention.keep_every, protect={done.name})

    def _write_durable(self, step: int, snap: Snapshot, problem: CheckpointError | None) -> None:
        """The memory tier's background thread, on every rank together: a durable save fell due at a step whose memory
        snapshot was not taken, so ``snap`` (that step's state) is written straight to the run directory, as a save
        without the memory tier is, over the memory tier's own process group. ``problem``: this rank's state could
        not be taken, which fails the save on every rank."""
        self._direct.write(checkpoint_name(step), step, snap, group=self.snapshots.collective, problem=problem)

    def wait_written(self) -> None:
        """Block until the snapshot in flight is committed in its slot (not persisted)."""
        self.snapshots.wait_snapshot()
        self._note_newest()

    def replica_lag(self) -> ReplicaLag | None:
        return self.snapshots.replica_lag()

    def wait_replica(self) -> RoundResult | None:
        self.snapshots.wait_replica()
        replicator = self.snapshots.replicator
        return replicator.last if replicator is not None else None

    def wait(self) -> str | None:
        self.snapshots.wait()
        self._note_newest()
        return self.lineage.last_checkpoint_id

    def _note_newest(self) -> None:
        if self.snapshots.newest is not None:
            self.lineage.last_checkpoint_id = self.snapshots.newest.checkpoint_id

    def raise_background_error(self) -> None:
        self.snapshots.raise_background_error()

    def protected(self) -> set[str]:
        return set()

    def close(self, *, persist: bool) -> None:
        """Persist the newest snapshot unless the run directory has it (``persist=False``: leave it in memory only);
        the memory tier's close waits for its copies itself, saying so (bounded by ``close_timeout``)."""
        self.snapshots.close(persist=persist)
