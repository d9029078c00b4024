"""Which memory slots belong to a run (spec/memory.md MEM-4), and which of them a restore may start from.

A slot is this run's when its binding names this run, this node and this run directory; any other (another run's,
another node's, torn, invalid) is left out of a restore and out of the ring's committed steps, with the reason
logged. Rank 0 looks at the slots; every rank gets its answer (:func:`~ckptfmt.decide.decide`), checked as the
hostile input it may be. A restore across nodes goes through :class:`~ckptfmt.tier.agreed.AgreedRestore`.

No lock: the candidates are listed before any snapshot thread runs; ``own_step`` is called under the snapshots'
lock by whoever loads the ring.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..collective import Collective, PeerChannel
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError
from ..manifest import checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..run import RunDirectory, checkpoint_name
from ..storage import open_store
from .agreed import AgreedRestore
from .binding import SlotBinding, normalize_run_url
from .nodes import NodeMap
from .ring import MemoryTier, Slot
from .votes import is_int

log = logging.getLogger("ckptfmt")

CHECKPOINT_ID = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCandidate:
    """A committed slot this run may restore from."""

    step: int
    url: str
    checkpoint_id: str
    slot: int  # its index in this node's ring (url is that slot's path here)


class RunSlots:
    """This run's slots in this node's memory directory: whose a slot is, and what a restore may read."""

    def __init__(
        self,
        tier: MemoryTier,
        run: RunDirectory,
        *,
        collective: Collective | None,
        channel: PeerChannel | None,
        nodes: NodeMap,
        node: str,
        run_id: str,
        rank: int,
    ) -> None:
        self.tier = tier
        self.run = run
        self.collective = collective
        self.channel = channel
        self.nodes = nodes
        self.node = node
        self.run_id = run_id
        self.rank = rank

    def foreign(self, binding: SlotBinding) -> str | None:
        """Why a slot bound so is not this run's, node's and run directory's (MEM-4), or None when it is."""
        why = binding.foreign_to(run_id=self.run_id, node=self.node)
        if why is None and normalize_run_url(binding.run_dir) != normalize_run_url(self.run.url):
            why = f"written for run directory {binding.run_dir!r}"
        return why

    def own_step(self, slot: Slot) -> int | None:
        """The step of a committed slot of this run and node; None for any other (free to rewrite)."""
        if slot.status != "committed" or slot.binding is None or self.foreign(slot.binding) is not None:
            return None
        return slot.binding.step

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
                foreign = self.foreign(slot.binding)
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
        return self.parse_candidates(decided)

    def parse_candidates(self, decided: object) -> list[MemoryCandidate]:
        """The coordinator's list of ``[step, slot index, checkpoint id]``, checked as the hostile input it may be
        (the same checks on every rank, so every rank accepts or refuses it alike)."""
        if not isinstance(decided, list) or len(decided) > self.tier.slot_count:
            raise MalformedMessageError("rank 0 sent a malformed list of memory slots")
        out: list[MemoryCandidate] = []
        for entry in decided:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise MalformedMessageError(f"rank 0 sent a malformed memory slot entry: {str(entry)[:80]}")
            step, index, ckpt_id = entry
            if not is_int(step) or step < 0:
                raise MalformedMessageError(f"rank 0 sent a memory slot with step {str(step)[:40]}")
            if not is_int(index) or not 0 <= index < self.tier.slot_count:
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

    def durable_id(self, step: int) -> str | None:
        """The checkpoint id of the run directory's committed ``step-<step>``; None when there is none (or it cannot
        be read: then a persist finds out what is there)."""
        try:
            store = open_store(self.run.child_url(checkpoint_name(step)), self.run.storage_options)
            return checkpoint_id(read_manifest_bytes(store))
        except CheckpointError:
            return None
