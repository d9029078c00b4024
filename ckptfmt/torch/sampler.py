"""A deterministic, resumable, rank-aware sampler whose position is what the trainer consumed.

Each epoch's global order is a seeded permutation of the dataset (identity when not shuffling),
with the samples of quarantined shards left out from the moment they are quarantined. Ranks take
that global order round-robin, so the order survives a change of world size on resume. The
position advances only when the trainer says it consumed samples (:meth:`advance`), never when a
DataLoader's workers prefetch indices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..canonical import canonical_json
from ..errors import ContextError, UsageError


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


class ResumableSampler:
    """A ``torch.utils.data.Sampler``-compatible iterable of sample indices (duck-typed: no torch import)."""

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        shard_size: int | None = None,
        dataset: DatasetIdentity | None = None,
    ) -> None:
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

    def _remaining(self) -> np.ndarray[Any, Any]:
        """Global order from the current position on, quarantined shards left out."""
        rest = self._permutation()[self.position :]
        if self.quarantined:
            bad = np.array(sorted(int(s) for s in self.quarantined), dtype=np.int64)
            rest = rest[~np.isin(rest // self.shard_size, bad)]
        return rest

    def __iter__(self) -> Iterator[int]:
        rest = self._remaining()
        usable = len(rest) - len(rest) % self.world_size  # every rank takes the same number of steps
        return iter(rest[self.rank : usable : self.world_size].tolist())

    def __len__(self) -> int:
        return len(self._remaining()) // self.world_size

    # ---------------------------------------------------------------- position

    def advance(self, samples_per_rank: int) -> None:
        """Record that every rank consumed ``samples_per_rank`` samples (call once per optimizer step)."""
        if samples_per_rank < 0:
            raise UsageError("cannot advance by a negative count")
        needed = samples_per_rank * self.world_size
        perm = self._permutation()
        bad = {int(s) for s in self.quarantined}
        pos = self.position
        while needed and pos < len(perm):
            if not bad or int(perm[pos]) // self.shard_size not in bad:
                needed -= 1
                self.consumed += 1
            pos += 1
        self.position = pos
        if len(self._remaining()) < self.world_size:  # the epoch is used up
            self.epoch += 1
            self.position = 0
            self.consumed = 0

    def quarantine(self, shard: str | int) -> None:
        """Skip every remaining sample of ``shard`` from now on (e.g. it yielded NaN)."""
        self.quarantined.add(str(shard))

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler compatibility: jump to the start of ``epoch`` unless already in it."""
        if epoch != self.epoch:
            self.epoch, self.position, self.consumed = epoch, 0, 0

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The ``data`` field's content (spec/fields.md)."""
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
            "quarantined_shards": sorted(self.quarantined, key=lambda s: (len(s), s)),
        }
        if self.dataset is not None:
            state["dataset"] = self.dataset.to_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the recorded position; rank and world size stay this process's own."""
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
        self.shard_size = int(sampler.get("shard_size", self.num_samples))
        self.epoch = int(state["epoch"])
        self.consumed = int(state["global_sample_offset"])
        self.position = int(sampler["position"])
        self.quarantined = set(_strings(state.get("quarantined_shards", [])))
        self._perm_epoch = -1


def _strings(values: object) -> Sequence[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ContextError("'quarantined_shards' must be an array of strings", field="data")
    return values
