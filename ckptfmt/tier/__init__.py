"""The memory tier: verified snapshots in node memory, persisted from there (spec/memory.md).

A memory snapshot is an ordinary ckptfmt checkpoint in a slot directory on a tmpfs
(:mod:`.ring`), bound to its run and node by manifest metadata (:mod:`.binding`), written in place
(:class:`~ckptfmt.storage.slot.SlotStore`), copied byte for byte into the run directory
(:mod:`.persist`) or re-written on top of the previous durable save (:mod:`.persist_incremental`), and rescued
by ``ckpt rescue`` after its writers died (:mod:`.rescue`).
The trainer's side is :class:`ckptfmt.torch.CheckpointManager` (``memory_every=``).
"""

from __future__ import annotations

from .binding import SlotBinding, node_key, run_identity
from .persist import Persisted, Throttle, persist
from .rescue import RescueOutcome, find_slots, rescue
from .ring import DEFAULT_MEMORY_DIR, MemoryTier, Slot, default_memory_dir, read_slot

__all__ = [
    "DEFAULT_MEMORY_DIR",
    "MemoryTier",
    "Persisted",
    "RescueOutcome",
    "Slot",
    "SlotBinding",
    "Throttle",
    "default_memory_dir",
    "find_slots",
    "node_key",
    "persist",
    "read_slot",
    "rescue",
    "run_identity",
]
