"""A deterministic, resumable, rank-aware sampler whose position is what the trainer consumed.

Each epoch's global order is a seeded permutation of the dataset (identity when not shuffling),
with quarantined samples and the samples of quarantined shards left out from the moment they are
quarantined (the quarantine record, :mod:`ckptfmt.quarantine`, says which, from which step and why). Ranks take
that global order round-robin, so the order survives a change of world size on resume: the
position on disk is global (samples of the global order consumed by all ranks together, plus
epoch and seed), never a rank's own. The position advances only when the trainer says it
consumed samples (:meth:`advance`) — or, inside :class:`~ckptfmt.torch.ResumableDataLoader`,
when the loader hands a batch to the trainer — never when a DataLoader's workers prefetch indices.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import inspect
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..canonical import canonical_json
from ..errors import ContextError, UsageError
from ..quarantine import QuarantineEntry, new_entry, parse_record, samples_of


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetIdentity:
    """What the data field records of the dataset: checked on resume."""

    name: str
    version: str
    shards: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(canonical_json(list(self.shards))).hexdigest()

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "digest": self.digest}


def default_rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the initialized default process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True, slots=True)
class Plan:
    """What one iterator over the sampler hands out: the global positions (into the epoch's
    permutation) of every rank's samples, in global order, truncated so that all ranks take as many."""

    epoch: int
    positions: np.ndarray[Any, Any]
    start_consumed: int
    world_size: int
    quarantined: frozenset[str] = frozenset()  # the shards left out of this plan
    record_length: int = 0  # the entries of the quarantine record whose samples this plan leaves out

    @property
    def per_rank(self) -> int:
        return len(self.positions) // self.world_size


class ResumableSampler:
    """A ``torch.utils.data.Sampler``-compatible iterable of sample indices (duck-typed).

    ``rank`` and ``world_size`` default to the initialized ``torch.distributed`` process group, else 0 and 1.
    One live iterator at a time: a second loop over the same sampler while the first is unfinished
    would move one position for two streams of samples, so it is an error.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        shard_size: int | None = None,
        dataset: DatasetIdentity | None = None,
    ) -> None:
        if rank is None or world_size is None:
            default_rank, default_world = default_rank_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        if num_samples <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise UsageError("need num_samples > 0, world_size > 0 and 0 <= rank < world_size")
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.shard_size = shard_size or num_samples
        self.dataset = dataset
        self.epoch = 0
        self.position = 0  # index into this epoch's permutation of the next unconsumed sample
        self.consumed = 0  # samples consumed this epoch, all ranks together
        self.quarantined: set[str] = set()
        # Misuse detection: indices handed out by iterators vs. position moves, in this process since
        # construction or the last load_state_dict (see position_problem()).
        self.handed_out = 0
        self.moves = 0
        self.plan: Plan | None = None  # the plan of the newest iterator
        # Shards a quarantine added after the plan in flight was made still appear in it; a resume into
        # that plan must leave out only what it left out (see state_dict's "plan_quarantined").
        self._next_plan_quarantined: set[str] | None = None
        self._record: list[QuarantineEntry] = []  # the quarantine record, oldest first
        self._bad_samples: np.ndarray[Any, Any] = np.empty(0, np.int64)  # every sample the record names, ascending
        self._next_plan_record: int | None = None  # as _next_plan_quarantined, for the record's samples
        self._record_limit: int | None = None  # while set (_excluding), only that many entries' samples count
        self._spent: tuple[Plan, int] | None = None  # a plan handed out to its end, and the moves count then
        self._live: weakref.ReferenceType[Generator[int, None, None]] | None = None
        self._perm_epoch = -1
        self._perm: np.ndarray[Any, Any] = np.empty(0, np.int64)

    # ---------------------------------------------------------------- order

    def _permutation(self) -> np.ndarray[Any, Any]:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                gen = np.random.Generator(np.random.PCG64([self.seed, self.epoch]))
                self._perm = gen.permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def shard_of(self, index: int) -> str:
        return str(int(index) // self.shard_size)

    def _samples_left_out(self, entries: int | None = None) -> tuple[np.ndarray[Any, Any], list[QuarantineEntry]]:
        """Of the first ``entries`` entries of the record (default: all, or the _excluding limit): the samples left
        out at every position of this epoch (entries from an earlier epoch, or waiting for the next pass), and the
        entries that take effect at a position of this epoch (their ``since``). Entries of a later epoch (a replay
        that adopted another run's record, :meth:`adopt_record`) are not in effect yet."""
        if entries is None:
            entries = len(self._record) if self._record_limit is None else self._record_limit
        chosen = self._record[:entries]
        if all(e.since is None or e.since[0] < self.epoch for e in chosen):
            return (self._bad_samples if entries >= len(self._record) else samples_of(chosen)), []
        everywhere = [e for e in chosen if e.since is None or e.since[0] < self.epoch]
        partial = [e for e in chosen if e.since is not None and e.since[0] == self.epoch and e.samples]
        return samples_of(everywhere), partial

    def _remaining_positions(
        self, quarantined: set[str] | frozenset[str] | None = None, entries: int | None = None
    ) -> np.ndarray[Any, Any]:
        """Positions (into the permutation) from the current one on, quarantined shards and samples left out."""
        return self._positions_from(self.position, len(self._permutation()), quarantined, entries)

    def _first_remaining(self, count: int) -> np.ndarray[Any, Any]:
        """The first ``count`` of :meth:`_remaining_positions` (fewer at the end of the epoch), looking at about as
        many positions as it returns: once per step, on a dataset of any size."""
        end, start, window = len(self._permutation()), self.position, max(2 * count, 1024)
        found: list[np.ndarray[Any, Any]] = []
        have = 0
        while start < end and have < count:
            stop = min(end, start + window)
            found.append(self._positions_from(start, stop))
            start, window, have = stop, 2 * window, have + len(found[-1])
        return np.concatenate(found)[:count] if found else np.empty(0, np.int64)

    def _positions_from(
        self, start: int, stop: int, quarantined: set[str] | frozenset[str] | None = None, entries: int | None = None
    ) -> np.ndarray[Any, Any]:
        perm = self._permutation()
        positions = np.arange(start, stop, dtype=np.int64)
        quarantined = self.quarantined if quarantined is None else quarantined
        if quarantined:
            bad = np.array(sorted(int(s) for s in quarantined), dtype=np.int64)
            positions = positions[~np.isin(perm[positions] // self.shard_size, bad)]
        samples, partial = self._samples_left_out(entries)
        if len(samples):  # both sides hold each index once: a permutation's values, the record's samples
            positions = positions[~np.isin(perm[positions], samples, assume_unique=True)]
        for entry in partial:  # in effect from a position of this epoch on
            assert entry.since is not None
            late = (positions >= entry.since[1]) & np.isin(perm[positions], np.asarray(entry.samples, np.int64))
            positions = positions[~late]
        return positions

    def __iter__(self) -> Iterator[int]:
        if self.live:
            raise UsageError(
                "ResumableSampler.__iter__ called while another iterator over it is still live (mid-epoch): two "
                "loops over one sampler would move one data position for two streams of samples. Use one "
                "sampler per loop (e.g. a separate one for evaluation), or finish or delete the first iterator "
                "before starting another"
            )
        previous = self.plan
        if previous is not None and previous.epoch == self.epoch and self._spent == (previous, self.moves):
            # The last iterator of this epoch handed out all it had and nothing was consumed since: what is
            # left is a tail its consumer drops (DataLoader(drop_last=True)), so this is the next epoch, not
            # an empty one forever.
            self.next_epoch()
        quarantined = self.quarantined if self._next_plan_quarantined is None else self._next_plan_quarantined
        entries = len(self._record) if self._next_plan_record is None else self._next_plan_record
        self._next_plan_quarantined = self._next_plan_record = None
        self._stamp(entries)  # the entries this pass leaves out take effect here
        positions = self._remaining_positions(quarantined, entries)
        usable = len(positions) - len(positions) % self.world_size  # every rank takes the same number of steps
        self.plan = Plan(
            epoch=self.epoch,
            positions=positions[:usable],
            start_consumed=self.consumed,
            world_size=self.world_size,
            quarantined=frozenset(quarantined),
            record_length=entries,
        )
        mine = self._permutation()[positions[self.rank : usable : self.world_size]].tolist()
        gen = self._hand_out(mine, self.plan)
        self._live = weakref.ref(gen)
        return gen

    def _hand_out(self, indices: list[int], plan: Plan) -> Generator[int, None, None]:
        for index in indices:
            self.handed_out += 1
            yield index
        self._spent = (plan, self.moves)

    @property
    def live(self) -> bool:
        """Whether an iterator over this sampler is started or referenced and not finished."""
        for attempt in range(2):
            gen = self._live() if self._live is not None else None
            if gen is None or inspect.getgeneratorstate(gen) == inspect.GEN_CLOSED:  # collected, or ran to its end
                return False
            if attempt == 0:
                del gen
                gc.collect()  # an abandoned iterator caught in a reference cycle is not live
        return True

    def end_iterator(self) -> None:
        """End the iterator in flight, if any: its consumer is done with it (it hands out nothing more)."""
        gen = self._live() if self._live is not None else None
        if gen is not None:
            gen.close()

    def __len__(self) -> int:
        return len(self._remaining_positions()) // self.world_size

    def upcoming(self, count: int, *, from_next_epoch: bool = False) -> list[int]:
        """Read-only: the sample indices of the next ``count`` samples of the global order, quarantined samples and
        shards left out (fewer where the epoch ends first); with ``from_next_epoch``, the first ``count`` of the next
        epoch."""
        if not from_next_epoch:
            return list(self._permutation()[self._remaining_positions()[:count]].tolist())
        saved = self.epoch, self.position, self.consumed
        self.next_epoch()
        try:
            return list(self._permutation()[self._remaining_positions()[:count]].tolist())
        finally:
            self.epoch, self.position, self.consumed = saved

    # ---------------------------------------------------------------- position

    def advance(self, samples_per_rank: int) -> None:
        """Record that every rank consumed ``samples_per_rank`` samples (call once per optimizer step)."""
        if samples_per_rank < 0:
            raise UsageError("cannot advance by a negative count")
        self.moves += 1
        needed = samples_per_rank * self.world_size
        if needed:
            positions = self._first_remaining(needed)
            taken = len(positions)
            self.position = int(positions[-1]) + 1 if taken == needed else len(self._permutation())
            self.consumed += taken
        if len(self._first_remaining(self.world_size)) < self.world_size:  # the epoch is used up
            self.next_epoch()

    def move_to(self, plan: Plan, per_rank: int) -> None:
        """Every rank has consumed the first ``per_rank`` samples of its share of ``plan`` (exact even if
        shards were quarantined after the plan was made)."""
        if plan.epoch != self.epoch:
            return  # the epoch already ended
        self.moves += 1
        taken = min(per_rank, plan.per_rank) * plan.world_size
        if taken:
            self.position = int(plan.positions[taken - 1]) + 1
        self.consumed = plan.start_consumed + taken

    def next_epoch(self) -> None:
        self.epoch, self.position, self.consumed = self.epoch + 1, 0, 0

    def quarantine(
        self,
        shard: str | int,
        *,
        step: int | None = None,
        reason: str | None = None,
        values: Mapping[str, float] | None = None,
    ) -> None:
        """Skip every remaining sample of ``shard`` from the next iterator on (e.g. it yielded NaN).

        An iterator already running (a ResumableDataLoader's epoch in flight) keeps its order; a resume
        into it does too, and leaves the shard out from the next iterator on, as the original run did.
        With ``step`` and ``reason`` (both or neither) the quarantine record gains an entry for the shard,
        unless one already names it; the shard must then be ``str(index // shard_size)`` of some index.
        """
        name = str(shard)
        if step is None and reason is None:
            self.quarantined.add(name)
            return
        if step is None or reason is None:
            raise UsageError("give both step= and reason= to record a quarantine, or neither")
        if (
            not (name.isascii() and name.isdigit() and len(name) < 20)
            or int(name) * self.shard_size >= self.num_samples
        ):
            raise UsageError(f"no shard {name!r}: shards are named str(index // shard_size)")
        entry = new_entry(step=step, reason=reason, values=values, shard=name)
        self.quarantined.add(name)
        if all(e.shard != name for e in self._record):
            self._record.append(entry)

    def quarantine_samples(
        self, indices: Sequence[int], *, step: int, reason: str, values: Mapping[str, float] | None = None
    ) -> None:
        """Leave the dataset indices ``indices`` out of the global order from the next iterator on, and record it.

        As :meth:`quarantine`: an iterator in flight keeps its order, and so does a resume into it. ``step``: the
        training step whose loss or gradients tripped it; ``reason``: one of :data:`ckptfmt.quarantine.REASONS`;
        ``values``: what tripped it (``{"loss": nan}``), real numbers, NaN and infinities included. A sample already
        quarantined keeps its first entry; a call that adds no new sample adds no entry.
        """
        if isinstance(indices, (str, bytes)) or not all(type(i) is int or isinstance(i, np.integer) for i in indices):
            raise UsageError("indices must be a sequence of integer dataset indices")
        wanted = sorted({int(i) for i in indices})
        if not wanted:
            raise UsageError("quarantine_samples needs at least one index")
        if wanted[0] < 0 or wanted[-1] >= self.num_samples:
            raise UsageError(f"dataset indices must be in [0, {self.num_samples}), got {wanted[0]}..{wanted[-1]}")
        new = np.setdiff1d(np.asarray(wanted, dtype=np.int64), self._bad_samples, assume_unique=True)
        entry = new_entry(step=step, reason=reason, values=values, samples=[int(i) for i in new])
        if not entry.samples:
            return
        self._record.append(entry)
        self._bad_samples = np.union1d(self._bad_samples, new)
        if not self.live:  # no pass in flight: it takes effect at the position the next one starts from
            self._stamp(len(self._record))

    def _stamp(self, entries: int) -> None:
        """Give the first ``entries`` entries that wait for a pass the data position they take effect at."""
        for i, entry in enumerate(self._record[:entries]):
            if entry.since is None and entry.samples:
                self._record[i] = dataclasses.replace(entry, since=(self.epoch, self.position))

    def adopt_record(self, record: Sequence[QuarantineEntry]) -> None:
        """Take another run's quarantine record as it is, to replay that run from an earlier data position: each
        entry's samples are left out from the position it took effect at in that run (its ``since``), not before;
        an entry without one, from now on. The record must not be longer than the dataset allows (ContextError)."""
        if self.live:
            raise UsageError("cannot adopt a quarantine record while an iterator over the sampler is live")
        entries = parse_record(
            [e.to_dict() for e in record],
            quarantined_shards=[e.shard for e in record if e.shard is not None],
            num_samples=self.num_samples,
        )
        self._record = list(entries)
        self._bad_samples = samples_of(entries)
        self.quarantined |= {e.shard for e in entries if e.shard is not None}

    @property
    def quarantine_record(self) -> tuple[QuarantineEntry, ...]:
        """Every quarantine recorded so far, oldest first (what the ``data`` field's ``quarantine`` holds)."""
        return tuple(self._record)

    def _exclusion(self) -> tuple[frozenset[str], int]:
        """What the order leaves out now: the quarantined shards, and how many record entries' samples."""
        return frozenset(self.quarantined), len(self._record)

    @contextmanager
    def _excluding(self, exclusion: tuple[frozenset[str], int]) -> Iterator[None]:
        """Within the block, leave out what ``exclusion`` (an earlier :meth:`_exclusion`) left out, not what is
        quarantined now."""
        saved = self.quarantined, self._record_limit
        self.quarantined, self._record_limit = set(exclusion[0]), exclusion[1]
        try:
            yield
        finally:
            self.quarantined, self._record_limit = saved

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler compatibility: jump to the start of ``epoch`` unless already in it."""
        if epoch != self.epoch:
            self.epoch, self.position, self.consumed = epoch, 0, 0

    def position_problem(self) -> str | None:
        """Why saving the position now would be wrong (samples handed out, position never moved), or None."""
        if self.handed_out and not self.moves:
            return (
                f"the ResumableSampler handed out {self.handed_out} sample indices but its position never moved "
                "(sampler.advance() was never called), so this checkpoint would make the resumed run re-read the "
                "samples it already trained on. Call sampler.advance(len(batch)) after every optimizer step, or "
                "use ckptfmt.torch.ResumableDataLoader, which counts the samples it hands to the trainer"
            )
        return None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The ``data`` field's content (spec/fields.md): a global position, the same on every rank."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "global_sample_offset": self.consumed,
            "sampler": {
                "kind": "ckptfmt.resumable",
                "seed": self.seed,
                "shuffle": self.shuffle,
                "num_samples": self.num_samples,
                "shard_size": self.shard_size,
                "position": self.position,
                "world_size": self.world_size,
            },
            "quarantined_shards": _sorted(self.quarantined),
        }
        if self._record:
            state["quarantine"] = [entry.to_dict() for entry in self._record]
        # What the plan in flight leaves out, where a quarantine came after it (a resume into it leaves out that
        # only); with no plan yet since a resume, what the resumed plan will leave out.
        plan = self.plan
        in_flight = plan is not None and plan.epoch == self.epoch
        shards = plan.quarantined if plan is not None and in_flight else self._next_plan_quarantined
        if shards is not None and shards != self.quarantined:
            state["sampler"]["plan_quarantined"] = _sorted(shards)
        entries = plan.record_length if plan is not None and in_flight else self._next_plan_record
        if entries is not None and any(e.samples for e in self._record[entries:]):
            state["sampler"]["plan_record"] = entries
        if self.dataset is not None:
            state["dataset"] = self.dataset.to_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the recorded global position; rank and world size stay this process's own.

        Everything is checked before anything changes.
        """
        if self.live:
            raise UsageError("cannot load a data position while an iterator over the sampler is live")
        loaded = self._parse(state)
        self.shard_size, self.epoch, self.consumed, self.position = loaded.shard_size, loaded.epoch, *loaded.at
        self.quarantined = loaded.quarantined
        self._next_plan_quarantined = loaded.next_plan
        self._record = list(loaded.record)
        self._bad_samples = samples_of(loaded.record)
        self._next_plan_record = loaded.next_plan_record
        self._record_limit = None
        self.handed_out = self.moves = 0
        self.plan = None
        self._perm_epoch = -1

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse, changing nothing, a data field :meth:`load_state_dict` would refuse (ContextError naming the
        member)."""
        self._parse(state)

    def _parse(self, state: Mapping[str, Any]) -> _Loaded:
        sampler = state.get("sampler")
        if not isinstance(sampler, Mapping) or sampler.get("kind") != "ckptfmt.resumable":
            raise ContextError("data field was not written by a ResumableSampler", field="data")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_samples", self.num_samples)):
            if sampler.get(key) != mine:
                raise ContextError(
                    f"sampler {key} is {mine!r} here but {sampler.get(key)!r} in the checkpoint: the data order "
                    "would differ",
                    field="data",
                )
        shard_size = sampler.get("shard_size", self.num_samples)
        epoch, consumed, position = state.get("epoch"), state.get("global_sample_offset"), sampler.get("position")
        for name, value, high in (
            ("shard_size", shard_size, None),
            ("epoch", epoch, None),
            ("global_sample_offset", consumed, self.num_samples),
            ("sampler.position", position, self.num_samples),
        ):
            if type(value) is not int or value < 0 or (high is not None and value > high):
                raise ContextError(f"{name} must be an integer in range, got {value!r}", field="data")
        assert isinstance(shard_size, int) and isinstance(epoch, int)
        assert isinstance(consumed, int) and isinstance(position, int)
        if shard_size == 0:
            raise ContextError("shard_size must be positive", field="data")
        quarantined = set(_strings(state.get("quarantined_shards", [])))
        in_plan = sampler.get("plan_quarantined")
        next_plan = set(_strings(in_plan)) if in_plan is not None else None
        stored = state.get("quarantine", [])
        record = parse_record(stored, quarantined_shards=quarantined, num_samples=self.num_samples)
        plan_record = sampler.get("plan_record")
        if plan_record is not None and (type(plan_record) is not int or not 0 <= plan_record <= len(record)):
            raise ContextError(
                f"sampler.plan_record must be an integer in [0, {len(record)}] (entries of quarantine), "
                f"got {plan_record!r}",
                field="data",
            )
        return _Loaded(
            shard_size=shard_size,
            epoch=epoch,
            at=(consumed, position),
            quarantined=quarantined,
            next_plan=next_plan,
            record=record,
            next_plan_record=plan_record,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Loaded:
    """A checked ``data`` field, ready to apply."""

    shard_size: int
    epoch: int
    at: tuple[int, int]  # (consumed, position)
    quarantined: set[str]
    next_plan: set[str] | None
    record: tuple[QuarantineEntry, ...]
    next_plan_record: int | None


def _sorted(shards: set[str] | frozenset[str]) -> list[str]:
    return sorted(shards, key=lambda s: (len(s), s))


def _strings(values: object) -> Sequence[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ContextError("'quarantined_shards' must be an array of strings", field="data")
    return values
