"""The memory tier's capacity check, decided by every rank together (spec/memory.md MEM-2).

Two decisions (:func:`~ckptfmt.decide.decide`): the ranks' snapshot sizes, then every node leader's look at its own
memory directory for its ranks' share (and, with replicas, one more share: its partners' copies). The answer is
the same on every rank: the ring does not fit (every rank raises the same error), it fits without its spare slot
(False), or with it (True).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError, MemoryCapacityError
from .nodes import NodeMap
from .ring import MemoryTier
from .votes import is_int

log = logging.getLogger("ckptfmt")

MAX_STATE_BYTES = 1 << 62  # what a rank may say its snapshot holds (a larger count is a malformed message)


def byte_counts(values: object, *, expected: int | None = None) -> list[int]:
    """Every rank's snapshot bytes, checked: one non-negative count per rank (the first malformed one named)."""
    if not isinstance(values, list) or (expected is not None and len(values) != expected):
        raise MalformedMessageError("the snapshot sizes are not one count per rank")
    for rank, value in enumerate(values):
        if not is_int(value) or not 0 <= value <= MAX_STATE_BYTES:
            raise MalformedMessageError(f"rank {rank} reported {str(value)[:40]} snapshot bytes, not a count")
    return values


def spare_fits(values: Sequence[object]) -> bool:
    """The node leaders' capacity verdicts (the others send None): whether every node has room for a spare slot."""
    fits = True
    for rank, value in enumerate(values):
        if value is None:
            continue
        if not (isinstance(value, dict) and set(value) == {"spare"} and isinstance(value["spare"], bool)):
            raise MalformedMessageError(f"rank {rank} sent a malformed memory capacity verdict")
        fits = fits and value["spare"]
    return fits


def agree_capacity(
    collective: Collective | None,
    per_rank: int,
    *,
    tier: MemoryTier,
    ring_slots: int,
    run_url: str,
    nodes: NodeMap,
    node: str,
    rank: int,
    world_size: int,
    replicas: bool,
) -> bool:
    """Whether the spare slot fits on every node, the same on every rank; raise (every rank alike) when the ring
    itself does not fit a node's memory directory. ``replicas``: each node also holds its partners' copies."""
    decided = decide(
        collective, per_rank, lambda values: byte_counts(list(values)), what="the snapshot sizes", max_size=64
    )
    totals = byte_counts(decided, expected=world_size)
    verdict: dict[str, bool] | CheckpointError | None = None
    if nodes.leader(node) == rank:
        mine = sum(totals[r] for r in nodes.ranks_of(node))
        sources: set[int] = set()  # whose copies this node's ranks receive (rewritten in place by the rounds)
        if replicas:
            mine *= 1 + nodes.replicas  # its own share, and a copy of a share for each replica it holds
            sources = {s for r in nodes.ranks_of(node) for s in nodes.sources_of(r)}
        try:
            verdict = {"spare": _room(tier, ring_slots, run_url, mine, sources)}
        except CheckpointError as exc:
            verdict = exc
    spare: object = decide(collective, verdict, spare_fits, what="the memory capacity check", max_size=64 << 10)
    if not isinstance(spare, bool):
        raise MalformedMessageError(f"the memory capacity check decided {spare!r}, not a boolean")
    if tier.slot_count > ring_slots and not spare and rank == 0:
        log.warning(
            "%s has room for %d memory slots but not for a spare one: a snapshot that falls due while a slot "
            "is being persisted and the other holds the newest snapshot is skipped (spec/memory.md MEM-2)",
            tier.memory_dir,
            ring_slots,
        )
    return spare


def _room(tier: MemoryTier, ring_slots: int, run_url: str, share: int, sources: set[int]) -> bool:
    """Whether this node's memory directory fits the ring and its spare slot (True), the ring alone (False);
    MemoryCapacityError when not even the ring fits."""
    try:
        tier.check_capacity(share, peer_sources=sources)
        return tier.slot_count > ring_slots
    except MemoryCapacityError:
        if tier.slot_count == ring_slots:
            raise
    ring = MemoryTier(tier.memory_dir, run_url, slots=ring_slots)
    ring.check_capacity(share, peer_sources=sources)
    return False
