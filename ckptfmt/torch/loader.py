"""A resumable DataLoader: the data position of the trainer's loader, exact across a mid-epoch resume. (The
adapters that save and restore the ``data`` field of any data source are in :mod:`ckptfmt.torch.data_position`.)

:class:`ResumableDataLoader` is a ``torch.utils.data.DataLoader`` whose state is the number of samples it
has **handed to the trainer** — not what its workers prefetched — kept in a :class:`ResumableSampler` as a
global position (so a run saved on N ranks resumes on M). The trainer writes no ``advance()`` call::

    loader = ResumableDataLoader(dataset, batch_size=32, seed=1234, num_workers=4)
    for inputs, targets in loader:   # a new iterator continues where the last batch handed out left off
        ...
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..errors import UsageError
from ..quarantine import QuarantineEntry
from .sampler import DatasetIdentity, Plan, ResumableSampler, default_rank_world

log = logging.getLogger("ckptfmt")
T = TypeVar("T")
LOADER_KIND = "ckptfmt.ResumableDataLoader"
_MASK63 = (1 << 63) - 1


class InexactResumeWarning(UserWarning):
    """A resume (or a save) that will not reproduce the uninterrupted run; the message says why and the fix."""


class ResumableDataLoader(DataLoader[T]):
    """A ``DataLoader`` that resumes mid-epoch exactly, with no ``advance()`` call in the training loop.

    Takes the DataLoader's own arguments plus ``seed`` (the shuffling order and the workers' seeds),
    ``rank``/``world_size`` (default: the initialized ``torch.distributed`` process group, else 0/1),
    ``shard_size`` and ``dataset_identity`` (see :class:`ResumableSampler`). Not accepted: ``sampler``,
    ``batch_sampler``, ``generator`` (it seeds its own) and ``in_order=False`` (the position is a prefix
    of the order). It never draws from torch's global RNG.

    State (:meth:`state_dict`) is the ``data`` field: epoch, samples of the global order consumed by all
    ranks together, seed. Each batch counts as consumed when ``next()`` returns it. A new iterator
    continues at the position; an epoch ends when no further batch can be made from it. One live
    iterator at a time (:class:`UsageError` otherwise). Randomness drawn in ``__getitem__`` in worker
    processes comes from RNGs seeded per (seed, epoch, sample), so it is exact across a mid-epoch resume
    and the same for any number of workers > 0; randomness drawn in the main process (``num_workers=0``)
    is in the checkpoint's ``rng`` field. ``loader.dataset`` is a thin wrapper: the trainer's dataset is
    ``loader.user_dataset``.
    """

    def __init__(
        self,
        dataset: Dataset[T],
        batch_size: int | None = 1,
        shuffle: bool = True,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        shard_size: int | None = None,
        dataset_identity: DatasetIdentity | None = None,
        **refused: Any,
    ) -> None:
        for name in ("sampler", "batch_sampler", "generator"):
            if refused.pop(name, None) is not None:
                raise UsageError(
                    f"ResumableDataLoader does not take {name}=: it builds its own seeded ResumableSampler and "
                    "generator (pass seed=, shuffle=, rank=, world_size=); for a custom sampler use a DataLoader "
                    "with a ResumableSampler and call sampler.advance() after every step. Under Lightning's DDP pass "
                    "Trainer(use_distributed_sampler=False): this loader takes its rank's share itself"
                )
        if refused:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(refused))}")
        if not in_order:
            raise UsageError("ResumableDataLoader needs in_order=True: its position is a prefix of the sample order")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise UsageError("ResumableDataLoader needs a map-style dataset with __len__")
        if rank is None or world_size is None:
            default_rank, default_world = default_rank_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        sampler = ResumableSampler(
            len(dataset),
            seed=seed,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            shard_size=shard_size,
            dataset=dataset_identity,
        )
        per_batch = batch_size or 1
        if drop_last and len(sampler) < per_batch:
            raise UsageError(
                f"with drop_last=True no batch of {per_batch} fits in {len(sampler)} samples per rank: every epoch "
                "would be empty"
            )
        self._generator = torch.Generator()
        super().__init__(
            _seeded(dataset, seed),
            batch_size=batch_size,
            sampler=_EpochTagged(sampler),
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=self._generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        self.resumable_sampler = sampler
        self.user_dataset = dataset
        self.seed = seed
        self._per_batch = per_batch
        self._last_batch: list[int] = []

    @property
    def epoch(self) -> int:
        return self.resumable_sampler.epoch

    @property
    def rank(self) -> int:
        return self.resumable_sampler.rank

    @property
    def world_size(self) -> int:
        return self.resumable_sampler.world_size

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]
        sampler = self.resumable_sampler
        previous = self._iterator  # kept by the DataLoader only with persistent workers: it is reused, not a rival
        if previous is not None:
            previous._sampler_iter = None
        plan = sampler.plan
        if plan is not None and plan.epoch != sampler.epoch:
            # The iterator in flight handed out its epoch's last batch: it is spent, not a rival. A trainer that
            # knows the epoch's length (Lightning) never asks it for the StopIteration that would end it.
            sampler.end_iterator()
        if sampler.live:
            sampler.__iter__()  # raises the two-live-iterators error, naming the fix
        sampler._spent = None  # this loader ends epochs itself (_handed, _finished), knowing its batch size
        # The workers' base seed is drawn from this generator, never from torch's global one; seeded per
        # (seed, epoch, rank) so that a resumed process gives an epoch's workers the seed they had before.
        self._generator.manual_seed(_mix("workers", self.seed, sampler.epoch, sampler.rank))
        return _Handed(self, super().__iter__())

    def __len__(self) -> int:
        """Batches of the current epoch on this rank, those already handed out included (as a ``DataLoader``'s
        and a ``StatefulDataLoader``'s: Lightning counts a resumed epoch's batches against it)."""
        sampler = self.resumable_sampler
        handed = sampler.consumed // sampler.world_size // self._per_batch
        left = len(sampler)
        return handed + (left // self._per_batch if self.drop_last else -(-left // self._per_batch))

    def _handed(self, it: _Handed[T]) -> None:
        """``it`` gave the trainer one more batch: the position moves past it."""
        sampler = self.resumable_sampler
        plan = sampler.plan
        if plan is None:  # cannot happen: a batch needs indices, which make a plan
            return
        if it.plan is not plan:
            it.plan, it.batches = plan, 0
        before = min(it.batches * self._per_batch, plan.per_rank)
        it.batches += 1
        taken = min(it.batches * self._per_batch, plan.per_rank)
        # Every rank took its share of the plan's positions [before, taken) * world_size, round-robin: together,
        # that slice of the global order (read before move_to, which may end the epoch).
        positions = plan.positions[before * plan.world_size : taken * plan.world_size]
        self._last_batch = sampler._permutation()[positions].tolist() if plan.epoch == sampler.epoch else []
        sampler.move_to(plan, taken)
        left = plan.per_rank - taken
        if plan.epoch == sampler.epoch and (left == 0 or (self.drop_last and left < self._per_batch)):
            sampler.next_epoch()  # no further batch can be made from this epoch

    def _finished(self, it: _Handed[T]) -> None:
        sampler = self.resumable_sampler
        plan = sampler.plan
        if plan is not None and plan.epoch == sampler.epoch:  # an epoch that had no (further) batch to give
            sampler.next_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The ``data`` field: the sampler's global position plus what this loader is."""
        state = self.resumable_sampler.state_dict()
        state["loader"] = {"kind": LOADER_KIND, "batch_size": self._per_batch, "drop_last": self.drop_last}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at a saved global position (written on any number of ranks, by this loader or a
        :class:`ResumableSampler`); the batch size may differ."""
        self.resumable_sampler.load_state_dict(state)
        self._last_batch = []

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse, changing nothing, a data field :meth:`load_state_dict` would refuse."""
        self.resumable_sampler.check_state_dict(state)

    def last_batch_samples(self) -> list[int]:
        """The dataset indices of the global batch handed out last, every rank's part together, in the global order
        (rank ``r``'s samples are every ``world_size``-th from ``r``); empty before the first batch and after a
        :meth:`load_state_dict`. Every rank computes the same list, from the plan, without communicating."""
        return list(self._last_batch)

    def quarantine_samples(
        self, indices: Sequence[int], *, step: int, reason: str, values: Mapping[str, float] | None = None
    ) -> None:
        """Leave ``indices`` out from the next iterator on (the epoch in flight keeps its order), and record it
        (:meth:`ResumableSampler.quarantine_samples`)."""
        self.resumable_sampler.quarantine_samples(indices, step=step, reason=reason, values=values)

    def quarantine(
        self,
        shard: str | int,
        *,
        step: int | None = None,
        reason: str | None = None,
        values: Mapping[str, float] | None = None,
    ) -> None:
        """Leave ``shard`` out from the next iterator on (:meth:`ResumableSampler.quarantine`)."""
        self.resumable_sampler.quarantine(shard, step=step, reason=reason, values=values)

    @property
    def quarantine_record(self) -> tuple[QuarantineEntry, ...]:
        """Every quarantine recorded so far, oldest first (the ``data`` field's ``quarantine``)."""
        return self.resumable_sampler.quarantine_record

    def adopt_record(self, record: Sequence[QuarantineEntry]) -> None:
        """Replay another run's quarantine record from an earlier position (:meth:`ResumableSampler.adopt_record`)."""
        self.resumable_sampler.adopt_record(record)


class _Handed(Iterator[T]):
    """The DataLoader's iterator, telling the loader about every batch it hands to the trainer."""

    def __init__(self, loader: ResumableDataLoader[T], inner: Iterator[T]) -> None:
        self._loader = loader
        self._inner = inner
        self.plan: Plan | None = None
        self.batches = 0

    def __next__(self) -> T:
        try:
            batch = next(self._inner)
        except StopIteration:
            self._loader._finished(self)
            raise
        self._loader._handed(self)
        return batch

    def __len__(self) -> int:
        return len(self._loader)


def _mix(*parts: object) -> int:
    digest = hashlib.sha256(("ckptfmt.loader:" + ":".join(map(str, parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


class _EpochTagged:
    """The sampler's indices as (epoch, index), so that a worker knows which epoch a sample is drawn for."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _Seeded(Dataset[T]):
    """The trainer's dataset, fetched with a worker process's RNGs (torch, random, numpy) seeded per
    (seed, epoch, sample): randomness drawn in ``__getitem__`` is then the same whichever worker fetches
    the sample, how far it prefetched, and whether the run was resumed mid-epoch. In the main process
    (``num_workers=0``) nothing is seeded: its RNG state is in the checkpoint's ``rng`` field."""

    def __init__(self, dataset: Dataset[T], seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> T:
        epoch, index = key
        _seed_worker(self.seed, epoch, index)
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling): never recurse
        return getattr(self.dataset, name)


class _SeededBatched(_Seeded[T]):
    """For a dataset with ``__getitems__`` (batched fetching): the RNGs are seeded per batch."""

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        epoch, first = keys[0]
        _seed_worker(self.seed, epoch, first)
        return self.dataset.__getitems__([index for _, index in keys])  # type: ignore[attr-defined]


def _seeded(dataset: Dataset[T], seed: int) -> _Seeded[T]:
    return _SeededBatched(dataset, seed) if hasattr(dataset, "__getitems__") else _Seeded(dataset, seed)


def _seed_worker(seed: int, epoch: int, index: int) -> None:
    if get_worker_info() is None:
        return
    value = _mix("sample", seed, epoch, index)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)
