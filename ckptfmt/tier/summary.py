"""Per-node completeness summaries: what a restore's coordinator needs to choose a checkpoint, without file lists.

Rank 0 choosing from every node's holdings (:func:`~.holdings.complete`) takes in O(ranks x files) records: about
10 MB through one gather at 1,000 nodes x 8 ranks. A node's leader instead summarizes, for each checkpoint it
holds (its manifest checked against its id, MEM-17, on that node), which **writer ranks** it holds whole: every
file the manifest lists for that rank (by the reference writer's names, :func:`~.holdings.rank_of_file`) at the
manifest's size, in one of its holdings. That is a few ranges of ranks per checkpoint (its own ranks and those it
holds replicas of), so what reaches rank 0 grows with the nodes, not with their files.

The choice is pure and the same on every rank (:func:`choose`): the newest step whose every writer rank is held
whole by some node, the nodes agreeing on the checkpoint's writer ranks. It is conservative: a rank's files split
over two nodes (never so in a slot or a replica, which hold a rank's files together) do not count, so it never
calls a checkpoint complete that :func:`~.holdings.complete` would not. The same summaries, broadcast, are the map
of who holds what from which each node plans its own fetches (:func:`plan_fetches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import MalformedMessageError
from ..manifest_parse import parse_manifest
from .holdings import Holding, check_checkpoint_id, rank_of_file

OTHER = -1  # the group of files no rank's name claims
MAX_RANGES = 1 << 16  # in one summary: a node holds a few ranges of ranks per checkpoint, never this many

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, half-open [start, stop) of writer ranks (OTHER: -1)


def to_ranges(ranks: Iterable[int]) -> Ranges:
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return tuple(out)


def covers(held: Iterable[Ranges], wanted: Ranges) -> bool:
    """Whether the union of ``held`` covers every rank of ``wanted``."""
    merged = sorted(r for ranges in held for r in ranges)
    for start, stop in wanted:
        at = start
        for a, b in merged:
            if a <= at < b:
                at = b
            if at >= stop:
                break
        if at < stop:
            return False
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class Completeness:
    """What one node holds of one checkpoint: the writer ranks of its manifest, and those it holds whole."""

    checkpoint_id: str
    step: int
    writers: Ranges
    held: Ranges

    def to_dict(self) -> dict[str, object]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "writers": [list(r) for r in self.writers],
            "held": [list(r) for r in self.held],
        }

    @classmethod
    def from_dict(cls, doc: object, *, rank: int) -> Completeness:
        """Parse a summary a node's leader ``rank`` sent (MEM-16): MalformedMessageError naming it otherwise."""
        who = f"rank {rank}"
        if not isinstance(doc, dict) or set(doc) != {"checkpoint_id", "step", "writers", "held"}:
            raise MalformedMessageError(f"{who}: a completeness summary is not an object of its four members")
        step = doc["step"]
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63:
            raise MalformedMessageError(f"{who}: a completeness summary's step is not a non-negative integer")
        return cls(
            checkpoint_id=check_checkpoint_id(doc["checkpoint_id"], who),
            step=step,
            writers=parse_ranges(doc["writers"], who, "writers"),
            held=parse_ranges(doc["held"], who, "held"),
        )


def parse_ranges(value: object, who: str, name: str) -> Ranges:
    """Ranges another rank (``who``) sent as member ``name``: a bounded list of sorted, disjoint ``[start, stop)``
    pairs; MalformedMessageError naming both otherwise."""
    if not isinstance(value, list) or len(value) > MAX_RANGES:
        raise MalformedMessageError(f"{who}: summary member {name!r} is not a list of at most {MAX_RANGES} ranges")
    out: list[tuple[int, int]] = []
    for item in value:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
            and OTHER <= item[0] < item[1] < 1 << 31
            and (not out or out[-1][1] <= item[0])
        ):
            raise MalformedMessageError(f"{who}: summary member {name!r} holds {str(item)[:40]}, not a sorted range")
        out.append((item[0], item[1]))
    return tuple(out)


def minus(ranges: Ranges, taken: Iterable[Ranges]) -> Ranges:
    """The ranks of ``ranges`` that no range of ``taken`` covers, range by range (O(ranges x cuts), never rank by
    rank)."""
    cuts = sorted(r for rs in taken for r in rs)
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        at = start
        for a, b in cuts:
            if b <= at or a >= stop:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < stop:
            out.append((at, stop))
    merged: list[tuple[int, int]] = []
    for a, b in out:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)


def rank_groups(manifest_bytes: bytes) -> dict[int, dict[str, int]]:
    """A checkpoint's files by the rank that wrote them (:data:`OTHER`: by none), path -> size."""
    groups: dict[int, dict[str, int]] = {}
    for f in parse_manifest(manifest_bytes).files:
        rank = rank_of_file(f.path)
        groups.setdefault(OTHER if rank is None else rank, {})[f.path] = f.size
    return groups


def summarize(
    holdings: Sequence[Holding],
    groups_of: Mapping[str, Mapping[int, Mapping[str, int]]],
    writers_of: Mapping[str, Ranges] | None = None,
) -> list[Completeness]:
    """One node's summaries, from its holdings (checked as MEM-17 asks, by :func:`~.holdings.node_holdings`) and the
    :func:`rank_groups` of their checkpoints' manifests (each hashing to its id); newest step first. ``writers_of``:
    each checkpoint's writer ranks where the caller has them already (else computed from its groups, O(ranks))."""
    by_id: dict[str, list[Holding]] = {}
    for holding in holdings:
        by_id.setdefault(holding.checkpoint_id, []).append(holding)
    out = []
    for ckpt_id, held in by_id.items():
        groups = groups_of.get(ckpt_id)
        if groups is None:
            continue
        named = {rank_of_file(p) for h in held for p in h.files}  # only the ranks it has files of: O(its files)
        candidates = {c for c in (OTHER if r is None else r for r in named) if c in groups}
        # a holding holds a rank whole only if it has the rank's first file: look only at those (not at every
        # holding for every rank, O(holdings x ranks) on a node many copies are sent to)
        having: dict[str, list[Holding]] = {}
        for h in held:
            for p in h.files:
                having.setdefault(p, []).append(h)
        whole = [rank for rank in candidates if _held_whole(groups[rank], held, having)]
        out.append(
            Completeness(
                checkpoint_id=ckpt_id,
                step=held[0].step,
                writers=writers_of[ckpt_id] if writers_of and ckpt_id in writers_of else to_ranges(groups),
                held=to_ranges(whole),
            )
        )
    return sorted(out, key=lambda c: (c.step, c.checkpoint_id), reverse=True)


def _held_whole(group: Mapping[str, int], held: Sequence[Holding], having: Mapping[str, Sequence[Holding]]) -> bool:
    """Whether one of ``held`` has every file of ``group`` at its size (``having``: path -> the holdings with it)."""
    first = next(iter(group), None)
    if first is None:  # no files: any holding holds them all
        return bool(held)
    return any(all(h.files.get(p) == size for p, size in group.items()) for h in having.get(first, ()))


def choose(summaries: Mapping[str, Sequence[Completeness]]) -> list[tuple[int, str]]:
    """(step, checkpoint id) of every checkpoint whose every writer rank some node holds whole, newest first (ties:
    the id), from each node's summaries. A checkpoint whose nodes disagree on its step or its writer ranks (one of
    them is wrong: each checked the manifest it has against the id) is passed over."""
    seen: dict[str, tuple[int, Ranges]] = {}
    held: dict[str, list[Ranges]] = {}
    refused: set[str] = set()
    for node in sorted(summaries):
        for c in summaries[node]:
            if seen.setdefault(c.checkpoint_id, (c.step, c.writers)) != (c.step, c.writers):
                refused.add(c.checkpoint_id)
            held.setdefault(c.checkpoint_id, []).append(c.held)
    found = [
        (step, ckpt_id)
        for ckpt_id, (step, writers) in seen.items()
        if ckpt_id not in refused and covers(held[ckpt_id], writers)
    ]
    return sorted(found, reverse=True)


def holders_of(summaries: Mapping[str, Sequence[Completeness]], ckpt_id: str) -> dict[int, list[str]]:
    """The broadcast map for the chosen checkpoint: each writer rank -> the nodes that hold its files whole, sorted."""
    out: dict[int, list[str]] = {}
    for node in sorted(summaries):
        for c in summaries[node]:
            if c.checkpoint_id == ckpt_id:
                for start, stop in c.held:
                    for rank in range(start, stop):
                        out.setdefault(rank, []).append(node)
    return out


def plan_fetches(node: str, needed: Iterable[int], holders: Mapping[int, Sequence[str]]) -> dict[int, str]:
    """Which node each writer rank's files that ``node`` needs and lacks come from: pure, so the holder (running the
    same function for each node that needs its files, from the same map) knows what it will send. Among the nodes
    that hold a rank whole, the choice rotates with the rank, so a lost node's files come from all its copies."""
    out: dict[int, str] = {}
    for rank in sorted(set(needed)):
        there = holders.get(rank, [])
        if not there or node in there:
            continue
        out[rank] = there[rank % len(there)]
    return out
