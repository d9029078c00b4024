"""The data position of whatever feeds the trainer: a resumable DataLoader, and the adapters that save and
restore the ``data`` field from it, a :class:`ResumableSampler`, a plain ``DataLoader`` or a stateful loader
such as torchdata's ``StatefulDataLoader``.

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
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..errors import ContextError, UsageError
from .sampler import DatasetIdentity, Plan, ResumableSampler, default_rank_world

log = logging.getLogger("ckptfmt")
T = TypeVar("T")
Policy = Literal["strict", "warn", "ignore"]
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
        it.batches += 1
        taken = min(it.batches * self._per_batch, plan.per_rank)
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


# ------------------------------------------------------------------ the data field of any data source


def _inner_sampler(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, ResumableSampler) and batch_sampler is not None:
        sampler = getattr(batch_sampler, "sampler", sampler)  # DataLoader(batch_sampler=BatchSampler(sampler))
    return sampler


def _is_plain_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and not isinstance(obj, ResumableDataLoader) and not hasattr(obj, "state_dict")


def dataset_identity(source: Any) -> DatasetIdentity | None:
    """The dataset identity a data source declares (compared with the checkpoint's on resume)."""
    if isinstance(source, ResumableDataLoader):
        return source.resumable_sampler.dataset
    if _is_plain_loader(source):
        source = _inner_sampler(source)
    identity = getattr(source, "dataset", None)
    return identity if isinstance(identity, DatasetIdentity) else None


def _warn(message: str) -> None:
    """An :class:`InexactResumeWarning` attributed to the caller's line, not to ckptfmt's internals."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 2  # stacklevel 2 is the frame that called _warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, InexactResumeWarning, stacklevel=level)


def _refuse_or_warn(message: str, policy: Policy) -> None:
    if policy == "strict":
        raise UsageError(message + ' (CheckpointManager(on_mismatch="warn") saves anyway, with a warning)')
    if policy == "warn":
        _warn(message)


def data_field(source: Any, *, policy: Policy = "strict", steps_passed: bool = True) -> dict[str, Any]:
    """The ``data`` field from a data source; a source that would write a wrong position is refused under
    ``policy="strict"`` (warned about under ``"warn"``).

    ``steps_passed``: whether training steps ran since the last restore or save (a sampler that handed
    out samples but never moved matters only then).
    """
    from . import state as torch_state

    if isinstance(source, ResumableDataLoader):
        return source.state_dict()
    if _is_plain_loader(source):
        inner = _inner_sampler(source)
        if not isinstance(inner, ResumableSampler) and not hasattr(inner, "state_dict"):
            _refuse_or_warn(
                f"the DataLoader's sampler ({type(inner).__name__}) cannot report its position, so the resumed run "
                "would restart the epoch and re-read samples already trained on. Use "
                "ckptfmt.torch.ResumableDataLoader(dataset, batch_size=…, seed=…), or a DataLoader with "
                "sampler=ResumableSampler(…) and sampler.advance(len(batch)) after every step",
                policy,
            )
            return {"epoch": 0, "global_sample_offset": 0, "loader": {"kind": "torch.DataLoader", "exact": False}}
        source = inner
    if isinstance(source, ResumableSampler):
        problem = source.position_problem() if steps_passed else None
        if problem:
            _refuse_or_warn(problem, policy)
        return source.state_dict()
    if not hasattr(source, "state_dict"):
        raise UsageError(f"a {type(source).__name__} has no state_dict(): pass a ResumableDataLoader as loader=")
    data = source.state_dict()
    if isinstance(data, Mapping) and "epoch" in data and "global_sample_offset" in data:
        return dict(data)
    # A stateful loader with its own state shape (torchdata's StatefulDataLoader): kept whole under
    # "loader", next to the required keys, filled in as well as the loader lets us.
    yielded = _num_yielded(data)
    size = getattr(source, "batch_size", None) or 1
    offset = int(getattr(source, "consumed", 0)) or (yielded * size if isinstance(yielded, int) else 0)
    epoch = data.get("epoch", 0) if isinstance(data, Mapping) else 0
    kind = f"{type(source).__module__}.{type(source).__qualname__}"
    return {
        "epoch": epoch if isinstance(epoch, int) and epoch >= 0 else 0,
        "global_sample_offset": max(0, offset),
        "loader": {"kind": kind, "state": torch_state._plain(data, "data.loader")},
    }


def _num_yielded(data: object) -> int:
    """Batches a StatefulDataLoader handed out this epoch (kept in its main snapshot with workers)."""
    if not isinstance(data, Mapping):
        return 0
    snapshot = data.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, Mapping) else None
    count = main.get("_sampler_iter_yielded") if isinstance(main, Mapping) else data.get("_num_yielded")
    return count if isinstance(count, int) and count >= 0 else 0


def inexact_resume_reasons(source: Any) -> list[str]:
    """Why resuming into ``source`` would not reproduce the uninterrupted run (empty when it would)."""
    if isinstance(source, (ResumableDataLoader, ResumableSampler)):
        return []
    reasons = []
    if isinstance(source, DataLoader) and source.generator is None:
        reasons.append(
            f"the {type(source).__name__} has generator=None, so every iter(loader) draws its workers' base seed "
            "(and a shuffling sampler's order) from torch's global RNG; the resumed process creates its iterator "
            "at another step than the original did, so dropout masks and every other global draw after the resume "
            "differ. Pass generator=torch.Generator().manual_seed(SEED), or use ckptfmt.torch.ResumableDataLoader"
        )
    shared = getattr(_inner_sampler(source), "generator", None)
    stateful = isinstance(source, DataLoader) and not _is_plain_loader(source)
    if stateful and shared is not None and shared is source.generator:
        reasons.append(
            f"the {type(source).__name__}'s shuffling sampler and its workers' base seed draw from one generator "
            "(shuffle=True with generator=…), so the epoch after a mid-epoch resume gets another order. Pass "
            "sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(SEED)) and a separate "
            "generator=, or use ckptfmt.torch.ResumableDataLoader"
        )
    if _is_plain_loader(source):
        inner = _inner_sampler(source)
        if not isinstance(inner, ResumableSampler) and not hasattr(inner, "load_state_dict"):
            reasons.append(
                f"the DataLoader's sampler ({type(inner).__name__}) cannot report its position, so the run restarts "
                "the epoch and re-reads samples it already trained on. Use ckptfmt.torch.ResumableDataLoader, or "
                "sampler=ResumableSampler(…) with sampler.advance(len(batch)) after every step"
            )
    return reasons


def check_restorable(source: Any, data: Mapping[str, Any]) -> None:
    """Refuse, before anything is applied, a data field that ``source`` cannot take; warn about inexact resumes."""
    for reason in inexact_resume_reasons(source):
        _warn("resume will not be exact: " + reason)
    target = _inner_sampler(source) if _is_plain_loader(source) else source
    ours = isinstance(target, (ResumableDataLoader, ResumableSampler))
    sampler = data.get("sampler")
    written_by_us = isinstance(sampler, Mapping) and sampler.get("kind") == "ckptfmt.resumable"
    if written_by_us and not ours and hasattr(target, "load_state_dict"):
        raise UsageError(
            f"the data field was written by a ResumableSampler/ResumableDataLoader; a {type(target).__name__} "
            "cannot take it: resume with a ResumableDataLoader (or a ResumableSampler) with the same seed"
        )
    if ours and not written_by_us:
        raise ContextError("data field was not written by a ResumableSampler or ResumableDataLoader", field="data")


def restore_data(source: Any, data: Mapping[str, Any]) -> None:
    """Put the data position back into ``source`` (after :func:`check_restorable`)."""
    from ..arrays import torchify

    if _is_plain_loader(source):
        source = _inner_sampler(source)
        if not hasattr(source, "load_state_dict"):
            return  # warned about in check_restorable: nothing can take the position
    if isinstance(source, (ResumableDataLoader, ResumableSampler)):
        source.load_state_dict(data)
        return
    loader = data.get("loader")
    if isinstance(loader, Mapping) and "state" in loader and "kind" in loader:
        source.load_state_dict(torchify(loader["state"]))
    elif loader is not None:
        source.load_state_dict(torchify(loader))  # written before "loader" had kind and state
    else:
        source.load_state_dict(torchify(dict(data)))
