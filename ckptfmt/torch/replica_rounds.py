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


class ReplicaRounds:
    """Numbered replica rounds of one rank: its local replicas written, then each round started or skipped."""

    def __init__(
        self, replicator: Replicator, collective: Collective | None, tier: MemoryTier, world_size: int
    ) -> None:
        self.replicator = replicator
        self.collective = collective
        self.tier = tier
        self.world_size = world_size
        self.rounds = 0

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
