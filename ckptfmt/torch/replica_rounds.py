"""The trainer's side of replicas (spec/memory.md, replicas): after each committed snapshot, a round that copies
every rank's files to its partners on other nodes (:class:`~ckptfmt.tier.replica.Replicator`).

Call sequence (the snapshot writer's thread, every rank together)::

    rounds = ReplicaRounds(replicator, collective, tier, world_size)
    local = rounds.write_local(snap)           # while the step is held: what this rank holds of its sources' state
    ...                                        # the snapshot committed into ``slot``
    rounds.start(slot, step, local, files)     # every rank decides together whether the round starts

No lock of its own: both calls run on the snapshot writer's one thread; the replicator's threads keep their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError
from ..manifest import MAX_MANIFEST_BYTES, FileRecord
from ..storage.slot import SlotStore
from ..tier import MemoryTier
from ..tier.replica import Replicator
from ..tier.votes import one_bool
from ..writer import CheckpointWriter
from .sharding import LocalShard, owners, replicated_sizes
from .state import Snapshot

log = logging.getLogger("ckptfmt")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaLag:
    """How far this rank's replicas trail its snapshots: ``steps`` from the newest committed snapshot back to the
    newest one whose copies are all committed, and ``seconds`` since the oldest snapshot not yet copied committed
    (0 and 0.0: up to date). A round that cannot keep up is coalesced: the snapshots committed meanwhile are not
    copied, and the next round copies the newest, so the lag falls back as soon as the link keeps up."""

    steps: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "seconds": self.seconds}


class ReplicaRounds:
    """Numbered replica rounds of one rank: its local replicas written, then each round started or skipped."""

    def __init__(
        self,
        replicator: Replicator,
        collective: Collective | None,
        tier: MemoryTier,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicator = replicator
        self.collective = collective
        self.tier = tier
        self.world_size = world_size
        self.rounds = 0
        self._clock = clock
        self._waiting: dict[int, float] = {}  # committed step -> when, while no copy of it or a newer one is made
        self._newest: int | None = None

    def lag(self) -> ReplicaLag:
        """This rank's :class:`ReplicaLag` now (snapshot writer's thread or the trainer's: reads only)."""
        replicated = self.replicator.replicated_step()
        waiting = dict(self._waiting)
        behind = [s for s in waiting if replicated is None or s > replicated]
        newest = self._newest
        if newest is None or not behind:
            return ReplicaLag(steps=0, seconds=0.0)
        oldest = min(behind)
        steps = newest - replicated if replicated is not None else newest - oldest + 1
        return ReplicaLag(steps=steps, seconds=max(0.0, self._clock() - waiting[oldest]))

    def write_local(self, snap: Snapshot) -> dict[int, tuple[FileRecord, ...]]:
        """Data-parallel replicas are not copied again (spec/memory.md, replicas): when a rank that replicates to this
        one holds the same state (DDP: everything; HSDP or ``Replicate()`` placements: the same piece of every
        sharded tensor), its share is written here from this rank's own state, into its copy directory, while the
        step is still held; the round then sends only what differs from the manifest. Nothing here can fail the
        snapshot: a file not written is sent."""
        if not self.replicator.sources:
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
                store = SlotStore(self.replicator.local_dir(src, self.rounds))
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

    def start(self, slot: int, step: int, local: dict[int, tuple[FileRecord, ...]], files: list[str]) -> None:
        """Start a replica round for the snapshot just committed, when every rank's previous round is done (all
        ranks decide together: a partner still busy makes every rank skip this one, never wait)."""
        self._waiting[step] = self._clock()
        self._newest = step
        replicated = self.replicator.replicated_step()
        if replicated is not None:
            self._waiting = {s: t for s, t in self._waiting.items() if s > replicated}
        if self.collective is None:
            return
        go = decide(
            self.collective,
            self.replicator.busy(),
            one_bool("whether its replica round is still busy", lambda busy: not any(busy)),
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
        self.replicator.start(self.rounds, step=step, slot_path=path, manifest_bytes=manifest, files=files, local=local)
        self.rounds += 1
