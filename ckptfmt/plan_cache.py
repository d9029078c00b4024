"""A rank's write plan kept from one write to the next: a writer that makes the same calls as the last one (a memory
snapshot every step: the same tensors, shapes and order, new bytes) takes its files from it, not from the planner.

Planning is pure and deterministic (:class:`~ckptfmt.plan.RankPlanner`): the same calls in the same order give the
same file plans, and the same checks pass. So a writer given a :class:`PlanCache` compares each call with the
recorded one (a tuple comparison) and, while they match, submits the recorded files as they fill, the planner
untouched, and writes each raw file's recorded header. At the first call that differs the writer hands the calls
matched so far to its planner (geometry only: the files already submitted are the ones it closes again) and goes on
as any writer does. Each writer records what it planned, and its first flush leaves that in the cache for the next.

What it saves is Python on the writer's thread, per tensor (the planner's checks and records, the header's JSON):
at 680 tensors a snapshot, 7 ms of GIL a step that a trainer's thread waits for (docs/benchmarks.md).

Only raw writes without a base use it (a codec cuts large tensors into chunks; a base makes references): a writer
given a cache otherwise ignores it. One writer at a time uses a cache (a memory tier writes one snapshot at a time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .manifest_template import ManifestTemplate
from .plan import EntryPlan, FilePlan

Shape = tuple[int, ...]
# A tensor call: (field, name, dtype, shape, global shape or None, offsets or None); a field declaration: (field,)
Call = tuple[str, str, str, Shape, Shape | None, Shape | None] | tuple[str]
Header = tuple[bytes, list[int]]  # a raw data file's header and its entries' absolute starts


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """One call and what the planner made of it: its entry (None: a field declaration) and the files it closed."""

    call: Call
    entry: EntryPlan | None
    full: tuple[FilePlan, ...]


@dataclass(frozen=True, slots=True)
class RecordedPlan:
    """A writer's calls up to its first flush, the files that flush closed, and its raw files' headers."""

    calls: tuple[PlannedCall, ...]
    tail: tuple[FilePlan, ...]
    headers: Mapping[str, Header] = field(default_factory=dict)


class PlanCache:
    """The plan of the last writer that flushed with it, and the template of the manifest a writer of one rank
    committed with it (manifest_template.py: filled, not built, by the next such writer); :attr:`replayed` and
    :attr:`planned` count writers that took all their files from it and those whose planner ran (tests, benches)."""

    def __init__(self) -> None:
        self.recorded: RecordedPlan | None = None
        self.template: ManifestTemplate | None = None
        self.replayed = 0
        self.planned = 0


class PlanReplay:
    """One writer's use of a :class:`PlanCache`: the recorded calls matched in order, and the calls recorded anew.

    Call sequence (the writer's): :meth:`match` per call while :attr:`matching`; once matching ends (a call that
    differs, or :meth:`tail` giving None), :meth:`handover` gives the calls matched, once, to hand the planner, and
    :meth:`record` takes every later call; at the first flush :meth:`tail` (the recorded files still open, or None)
    and then :meth:`keep`.
    """

    def __init__(self, cache: PlanCache) -> None:
        self.cache = cache
        self._known = cache.recorded
        self._calls: list[PlannedCall] = []  # this writer's, matched or planned
        self._index = 0  # recorded calls matched so far
        self.matching = self._known is not None
        self.flushed = False
        self.fields: set[str] = set()  # tensor fields of the matched calls (the planner holds the others')

    def match(self, call: Call) -> PlannedCall | None:
        """The recorded call, when ``call`` is the next one recorded; else None, and matching ends."""
        known = self._known
        if self.matching and known is not None and not self.flushed and self._index < len(known.calls):
            planned = known.calls[self._index]
            if planned.call == call:
                self._index += 1
                self._calls.append(planned)
                self.fields.add(call[0])
                return planned
        self.matching = False
        return None

    def handover(self) -> Sequence[PlannedCall]:
        """The calls matched, in order, for the planner: once, when matching has ended (then none)."""
        self.matching = False
        matched, self._index = self._calls[: self._index], 0
        self.fields.clear()  # the planner holds them from now on
        return matched

    def header(self, path: str) -> Header | None:
        """The recorded header of a raw data file of the recorded plan."""
        return None if self._known is None else self._known.headers.get(path)

    def record(self, call: Call, entry: EntryPlan | None, full: Sequence[FilePlan]) -> None:
        self._calls.append(PlannedCall(call, entry, tuple(full)))

    def tail(self) -> tuple[FilePlan, ...] | None:
        """At the first flush while matching: the recorded files still open, when every recorded call was made."""
        known = self._known
        if not self.matching or self.flushed or known is None or self._index != len(known.calls):
            self.matching = False
            return None
        return known.tail

    def keep(self, tail: Sequence[FilePlan], headers: Mapping[str, Header]) -> None:
        """At the first flush: leave this writer's plan in the cache for the next writer."""
        if self.flushed:
            return
        self.flushed = True
        if self.matching:  # the recorded plan, all of it: it stays
            self.cache.replayed += 1
            return
        self.cache.planned += 1
        names = {p.path for c in self._calls for p in c.full} | {p.path for p in tail}
        self.cache.recorded = RecordedPlan(
            calls=tuple(self._calls), tail=tuple(tail), headers={k: v for k, v in headers.items() if k in names}
        )


__all__ = ["Call", "PlanCache", "PlanReplay", "PlannedCall", "RecordedPlan"]
