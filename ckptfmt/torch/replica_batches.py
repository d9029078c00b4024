"""Exact data sharding across torchft replica groups that leave and join the run: :class:`ReplicaBatches`.

The rule. The global sample order is :class:`~ckptfmt.torch.ResumableSampler`'s: each epoch a permutation seeded by
``np.random.PCG64([seed, epoch])`` (the identity without ``shuffle``), quarantined ones left out. A *global batch*
is ``batch_size * group_size`` consecutive samples of that order. A step that commits with ``P`` participating replica
groups consumes exactly ``P`` global batches: the group of participating rank ``r`` (``0 <= r < P``) takes global batch
``committed_batches + r``, and rank ``g`` of that group takes its samples ``[g * batch_size, (g + 1) * batch_size)``.
A step that does not commit consumes nothing: the next step's participants take its batches again. A group that does
not participate (``replica_rank=None``: torchft is healing it and zeroes its gradients) is handed rank 0's batch and
consumes nothing by itself; when the step commits it moves with everyone, since every group that commits calls
:meth:`~ReplicaBatches.commit` with the same ``P``. When fewer than ``P`` global batches remain in an epoch, that tail
is dropped and the step takes its batches from the start of the next epoch: decided from the position and ``P``
alone, so every group decides the same. The position is global and the same on every group, so a group that heals
takes the sender's (:meth:`~ReplicaBatches.load_state_dict`) and continues exactly. Over the committed steps the job
as a whole takes every sample of the order once: none twice, none skipped but the dropped tails.

``committed_batches`` counts what torchft's ``Manager.batches_committed()`` counts. Each group records the steps
committed since the last durable save (:class:`StepRecord`), so the run can be replayed from the checkpoint before
them. A quarantine takes effect from the next step on (the step in flight keeps what it was handed) and, like every
input to the rule, must be the same on every group.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..errors import ContextError, UsageError
from ..quarantine import QuarantineEntry
from .sampler import DatasetIdentity, ResumableSampler

log = logging.getLogger(__name__)

KIND = "ckptfmt.replica_batches"
MAX_RECORD = 100_000  # steps kept between durable saves; a longer record from a peer is refused
_MAX_COUNT = 1 << 62


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value < _MAX_COUNT


def _show(value: object) -> str:
    return repr(value) if value is None or isinstance(value, (bool, int)) else type(value).__name__


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One committed step: ``participants`` groups took global batches ``first_batch`` to ``first_batch + participants
    - 1``; ``replica_rank`` is the recording group's participating rank (None: it was not participating)."""

    step: int
    participants: int
    replica_rank: int | None
    first_batch: int

    def to_list(self) -> list[int | None]:
        return [self.step, self.participants, self.replica_rank, self.first_batch]

    @classmethod
    def from_list(cls, value: object, index: int) -> StepRecord:
        """Parse entry ``index`` of a peer's record, ``[step, participants, replica_rank or null, first_batch]``."""
        if isinstance(value, list) and len(value) == 4:
            step, participants, rank, first = value
            ok = _count(step) and _count(participants) and participants >= 1 and _count(first)
            if ok and (rank is None or (_count(rank) and rank < participants)):
                return cls(step=step, participants=participants, replica_rank=rank, first_batch=first)
        raise ContextError(
            f"sampler.record[{index}] must be [step, participants >= 1, replica_rank < participants or null, "
            "first_batch] of non-negative integers",
            field="data",
        )


class ReplicaBatches:
    """This rank's batches under torchft, by the module's rule. Each step, on every rank of every replica group::

        participants, rank = manager.num_participants(), manager.participating_rank()
        batch = batches.indices(rank, participants)
        ...  # forward, backward, optimizer.step()
        if manager.should_commit():
            batches.commit(participants, step=manager.current_step(), replica_rank=rank)

    ``group_rank``/``group_size``: this process's rank in its replica group and the group's size.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        seed: int = 0,
        group_rank: int = 0,
        group_size: int = 1,
        shuffle: bool = True,
        shard_size: int | None = None,
        dataset: DatasetIdentity | None = None,
    ) -> None:
        if batch_size <= 0 or group_size <= 0 or not 0 <= group_rank < group_size:
            raise UsageError("need batch_size > 0, group_size > 0 and 0 <= group_rank < group_size")
        self._order = ResumableSampler(
            num_samples, seed=seed, rank=0, world_size=1, shuffle=shuffle, shard_size=shard_size, dataset=dataset
        )
        self.batch_size, self.group_rank, self.group_size = batch_size, group_rank, group_size
        self._committed = 0
        self._record: list[StepRecord] = []
        self._step_quarantine: tuple[frozenset[str], int] | None = None  # what the step in flight was handed under

    @property
    def dataset(self) -> DatasetIdentity | None:
        return self._order.dataset

    @property
    def committed_batches(self) -> int:
        """Global batches consumed so far (what torchft's ``Manager.batches_committed()`` counts)."""
        return self._committed

    @property
    def record(self) -> tuple[StepRecord, ...]:
        """One entry per step committed since the last :meth:`trim_record`, oldest first."""
        return tuple(self._record)

    def indices(self, replica_rank: int | None, participants: int) -> list[int]:
        """This rank's sample indices for the step about to run (rank 0's batch when ``replica_rank`` is None).
        Nothing moves."""
        self._check(replica_rank, participants)
        self._step_quarantine = self._order._exclusion()
        _, window = self._window(participants)
        first = ((replica_rank or 0) * self.group_size + self.group_rank) * self.batch_size
        return window[first : first + self.batch_size]

    def commit(self, participants: int, *, step: int, replica_rank: int | None = None) -> None:
        """The step committed (torchft's ``should_commit()`` was True): move by ``participants`` global batches and
        record the step. Every group that commits calls this with the same ``participants``."""
        self._check(replica_rank, participants)
        if not _count(step) or (self._record and step <= self._record[-1].step):
            raise UsageError(f"step {_show(step)} is not after the last committed one: each step commits once")
        order = self._order
        # exactly what the step was handed, not what a later quarantine leaves
        with order._excluding(self._step_quarantine or order._exclusion()):
            next_epoch, _ = self._window(participants)
            if next_epoch:
                order.next_epoch()
            order.advance(participants * self.batch_size * self.group_size)
        self._step_quarantine = None
        self._record.append(
            StepRecord(step=step, participants=participants, replica_rank=replica_rank, first_batch=self._committed)
        )
        self._committed += participants
        if len(self._record) > MAX_RECORD:  # never trimmed: keep the newest, as a peer's longer record is refused
            log.warning(
                "step record over %d entries: dropped the oldest; trim_record() after a durable save", MAX_RECORD
            )
            del self._record[0]

    def trim_record(self, through_step: int) -> None:
        """Drop the entries of steps up to ``through_step`` (a durable save holds the state after them)."""
        self._record = [r for r in self._record if r.step > through_step]

    def quarantine(
        self,
        shard: str | int,
        *,
        step: int | None = None,
        reason: str | None = None,
        values: Mapping[str, float] | None = None,
    ) -> None:
        """Leave every remaining sample of ``shard`` (``str(index // shard_size)``) out, from the next step on; with
        ``step`` and ``reason``, recorded (:meth:`ResumableSampler.quarantine`)."""
        name = str(shard)
        if not (name.isascii() and name.isdigit()) or int(name) * self._order.shard_size >= self._order.num_samples:
            raise UsageError(f"no shard {name!r}: shards are named str(index // shard_size)")
        self._order.quarantine(name, step=step, reason=reason, values=values)

    def quarantine_samples(
        self, indices: Sequence[int], *, step: int, reason: str, values: Mapping[str, float] | None = None
    ) -> None:
        """Leave the dataset indices ``indices`` out from the next step on, and record it
        (:meth:`ResumableSampler.quarantine_samples`). Like every input to the rule, the same on every group."""
        self._order.quarantine_samples(indices, step=step, reason=reason, values=values)

    @property
    def quarantine_record(self) -> tuple[QuarantineEntry, ...]:
        """Every quarantine recorded so far, oldest first (the ``data`` field's ``quarantine``)."""
        return self._order.quarantine_record

    def adopt_record(self, record: Sequence[QuarantineEntry]) -> None:
        """Replay another run's quarantine record from an earlier position (:meth:`ResumableSampler.adopt_record`)."""
        self._order.adopt_record(record)

    def _check(self, replica_rank: int | None, participants: int) -> None:
        if type(participants) is not int or participants < 1:
            raise UsageError(f"participants must be a positive integer, got {_show(participants)}")
        if replica_rank is not None and (type(replica_rank) is not int or not 0 <= replica_rank < participants):
            raise UsageError(f"replica_rank must be None or in [0, {participants}), got {_show(replica_rank)}")

    def _window(self, participants: int) -> tuple[bool, list[int]]:
        """The ``participants`` global batches of the step, and whether they start the next epoch (this one's tail
        being too short)."""
        need = participants * self.batch_size * self.group_size
        for next_epoch in (False, True):
            window = self._order.upcoming(need, from_next_epoch=next_epoch)
            if len(window) == need:
                return next_epoch, window
        raise UsageError(f"{participants} global batches ({need} samples) are more than an epoch holds")

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The ``data`` field's content (spec/fields.md): the global position, the same on every group."""
        state = self._order.state_dict()
        inner = state["sampler"]
        state["sampler"] = {
            "kind": KIND,
            **{key: inner[key] for key in ("seed", "shuffle", "num_samples", "shard_size", "position")},
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "committed_batches": self._committed,
            "record": [r.to_list() for r in self._record],
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a peer's or a checkpoint's position; everything is checked before anything changes (ContextError
        naming the key). ``group_rank`` stays this process's own."""
        inner, committed, record = self._parse(state)
        self._order.load_state_dict(inner)  # checked by _parse: cannot fail
        self._committed, self._record, self._step_quarantine = committed, record, None

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse, changing nothing, a data field :meth:`load_state_dict` would refuse."""
        self._parse(state)

    def _parse(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], int, list[StepRecord]]:
        sampler = state.get("sampler")
        if not isinstance(sampler, Mapping) or sampler.get("kind") != KIND:
            raise ContextError(
                f"sampler.kind: the data field was not written by a ReplicaBatches ({KIND})", field="data"
            )
        for key, mine in (("batch_size", self.batch_size), ("group_size", self.group_size)):
            if type(sampler.get(key)) is not int or sampler.get(key) != mine:
                theirs = _show(sampler.get(key))
                raise ContextError(f"sampler {key} is {mine} here but {theirs} in the checkpoint", field="data")
        committed, entries = sampler.get("committed_batches"), sampler.get("record")
        if not _count(committed):
            raise ContextError(
                f"sampler.committed_batches must be a non-negative integer, got {_show(committed)}", field="data"
            )
        if not isinstance(entries, list) or len(entries) > MAX_RECORD:
            raise ContextError(f"sampler.record must be a list of at most {MAX_RECORD} entries", field="data")
        record = [StepRecord.from_list(entry, i) for i, entry in enumerate(entries)]
        end = record[0].first_batch if record else committed
        for i, entry in enumerate(record):
            if entry.first_batch != end or (i and entry.step <= record[i - 1].step):
                raise ContextError(f"sampler.record[{i}] does not follow on from the entry before", field="data")
            end = entry.first_batch + entry.participants
        if end != committed:
            raise ContextError("sampler.record does not end at committed_batches", field="data")
        quarantined = state.get("quarantined_shards", [])
        if isinstance(quarantined, list) and not all(
            isinstance(s, str) and s.isascii() and s.isdigit() and len(s) < 20 for s in quarantined
        ):
            raise ContextError("quarantined_shards must name shards as decimal integers", field="data")
        keys = ("seed", "shuffle", "num_samples", "shard_size", "position")
        copied = ("epoch", "global_sample_offset", "quarantined_shards", "quarantine")
        inner = {key: state[key] for key in copied if key in state}
        inner["sampler"] = {"kind": "ckptfmt.resumable", **{key: sampler[key] for key in keys if key in sampler}}
        # The rest is ResumableSampler's own check, run on a scratch copy so that nothing here changes.
        order = self._order
        scratch = ResumableSampler(order.num_samples, seed=order.seed, rank=0, world_size=1, shuffle=order.shuffle)
        scratch.check_state_dict(inner)
        return inner, committed, record
