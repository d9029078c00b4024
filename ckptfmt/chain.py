"""Chains of incremental checkpoints (spec/references.md): how deep a save is, and whether the next one is full.

A save that references a base records in its manifest's metadata how many saves lie between it and the last
self-contained one (``ckptfmt.incremental.since_full``; 0 or absent: it is self-contained). A chain is cut by a
self-contained save once the count would reach ``full_every``, so a damaged base costs at most ``full_every``
saves and a chain of references never grows without bound. The durable engine (direct saves) and an incremental
persist from memory both decide with :func:`next_depth`, so the two count alike whichever wrote the base.
"""

from __future__ import annotations

from collections.abc import Mapping

SINCE_FULL = "ckptfmt.incremental.since_full"  # manifest metadata: saves since the last self-contained one
UNKNOWN_DEPTH = 1 << 30  # a referencing checkpoint that does not say how deep it is: as if full_every were reached


def since_full(metadata: Mapping[str, str]) -> int:
    """Saves since the last full one, as the checkpoint records it (unknown: :data:`UNKNOWN_DEPTH`)."""
    value = metadata.get(SINCE_FULL, "")
    return int(value) if value.isdigit() else UNKNOWN_DEPTH


def depth_of(metadata: Mapping[str, str], *, referencing: bool) -> int:
    """The depth of a checkpoint: 0 when it references no base (self-contained, whatever its metadata says),
    else what its metadata records (:func:`since_full`)."""
    return since_full(metadata) if referencing else 0


def next_depth(depth: int, full_every: int) -> int | None:
    """The depth of the save after one of ``depth``: ``depth + 1`` (it references that one), or None when it
    must be self-contained (every ``full_every``-th save is; ``full_every=1``: every save)."""
    return None if depth + 1 >= full_every else depth + 1
