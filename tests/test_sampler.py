"""ResumableSampler: exact resumption, world-size changes, DataLoader prefetching, quarantine, dataset identity."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ckptfmt.errors import ContextError, ResumeMismatchError
from ckptfmt.torch import DatasetIdentity, ResumableSampler, api

N = 96


def consume(samplers: list[ResumableSampler], steps: int, per_rank: int) -> list[int]:
    """``steps`` synchronous steps of ``per_rank`` samples on every rank; the global order consumed.

    Within a step, rank r's i-th sample is global sample i * world_size + r (round robin), so the
    global order is rebuilt by interleaving the ranks.
    """
    out: list[int] = []
    for _ in range(steps):
        batches = [list(_take(iter(s), per_rank)) for s in samplers]
        for i in range(per_rank):
            out.extend(b[i] for b in batches if i < len(b))
        for s in samplers:
            s.advance(per_rank)
    return out


def _take(it: Iterator[int], n: int) -> Iterator[int]:
    for _ in range(n):
        yield next(it)


def ranks(world_size: int, **kwargs: object) -> list[ResumableSampler]:
    return [ResumableSampler(N, seed=7, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]  # type: ignore[arg-type]


def test_epoch_is_a_seeded_permutation() -> None:
    (s,) = ranks(1)
    first = list(s)
    assert sorted(first) == list(range(N)) and first != list(range(N))
    assert list(ResumableSampler(N, seed=7)) == first  # same seed, same order
    assert list(ResumableSampler(N, seed=8)) != first
    assert list(ResumableSampler(N, seed=7, shuffle=False)) == list(range(N))


def test_resumes_exactly_across_epochs() -> None:
    (ref,) = ranks(1)
    reference = consume([ref], 20, 8)  # 160 samples: one epoch and most of the next
    (a,) = ranks(1)
    head = consume([a], 7, 8)
    state = a.state_dict()
    assert state["epoch"] == 0 and state["global_sample_offset"] == 56
    (b,) = ranks(1)
    b.load_state_dict(state)
    assert head + consume([b], 13, 8) == reference
    assert b.state_dict() == ref.state_dict()
    assert sorted(reference[:N]) == list(range(N))  # the first epoch has every sample once
    assert reference[N:] != reference[: len(reference) - N]  # the next epoch has another order


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 1), (3, 2)])
def test_world_size_change_keeps_the_global_order(before: int, after: int) -> None:
    """Each epoch's global order is the same whatever the world size; a resume under another world
    size continues it: no sample repeated, none skipped."""
    (single,) = ranks(1)
    reference = consume([single], N // 12, 12)  # one epoch, 12 samples a step
    old = ranks(before)
    head = consume(old, 5, 12 // before)
    state = old[0].state_dict()
    assert all(s.state_dict() == state for s in old)  # every rank records the same global position
    new = ranks(after)
    for s in new:
        s.load_state_dict(state)
    tail = consume(new, (N - 60) // 12, 12 // after)
    assert head + tail == reference
    assert sorted(head + tail) == list(range(N))


def test_state_records_the_position_not_the_rank() -> None:
    s = ResumableSampler(N, seed=1, rank=1, world_size=2)
    s.advance(5)
    state = s.state_dict()
    assert state["global_sample_offset"] == 10 and state["sampler"]["world_size"] == 2
    other = ResumableSampler(N, seed=1, rank=0, world_size=3)
    other.load_state_dict(state)
    assert (other.rank, other.world_size, other.consumed) == (0, 3, 10)


def test_load_refuses_a_different_order() -> None:
    s = ResumableSampler(N, seed=1)
    for changed in (
        ResumableSampler(N, seed=2),
        ResumableSampler(N + 1, seed=1),
        ResumableSampler(N, seed=1, shuffle=False),
    ):
        with pytest.raises(ContextError, match="data order would differ"):
            changed.load_state_dict(s.state_dict())
    with pytest.raises(ContextError, match="not written by a ResumableSampler"):
        s.load_state_dict({"epoch": 0, "global_sample_offset": 0})


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetching_workers_do_not_move_the_position(workers: int) -> None:
    sampler = ResumableSampler(N, seed=3)
    reference = list(ResumableSampler(N, seed=3))
    loader = DataLoader(
        Indices(), batch_size=8, sampler=sampler, num_workers=workers, prefetch_factor=4 if workers else None
    )  # type: ignore[arg-type]
    it = iter(loader)
    consumed: list[int] = []
    for _ in range(3):
        batch = next(it)
        consumed += batch.tolist()
        sampler.advance(len(batch))
    # the workers have fetched ahead of the trainer; the position is what the trainer consumed
    assert sampler.state_dict()["global_sample_offset"] == 24 and sampler.position == 24
    state = sampler.state_dict()
    del it
    resumed = ResumableSampler(N, seed=3)
    resumed.load_state_dict(state)
    rest = [i for batch in DataLoader(Indices(), batch_size=8, sampler=resumed) for i in batch.tolist()]  # type: ignore[arg-type]
    assert consumed + rest == reference


def test_quarantined_shards_are_skipped_deterministically_after_resume() -> None:
    def run(resume_at: int | None) -> list[int]:
        s = ResumableSampler(N, seed=5, shard_size=16)
        order: list[int] = []
        for step in range(10):
            if resume_at is not None and step == resume_at:
                state = s.state_dict()
                s = ResumableSampler(N, seed=5, shard_size=16)
                s.load_state_dict(state)
            if step == 2:
                s.quarantine(3)  # e.g. a sample of shard 3 yielded NaN
            if step == 4:
                s.quarantine("1")
            order.extend(_take(iter(s), 6))
            s.advance(6)
        return order

    reference = run(None)
    assert run(resume_at=3) == reference and run(resume_at=7) == reference
    after = reference[12:]  # consumed once shard 3 was quarantined
    assert not any(i // 16 == 3 for i in after)
    assert not any(i // 16 == 1 for i in reference[24:])
    s = ResumableSampler(N, seed=5, shard_size=16)
    s.quarantine(3)
    s.quarantine(11)
    assert s.state_dict()["quarantined_shards"] == ["3", "11"]


def test_quarantine_never_repeats_a_sample() -> None:
    s = ResumableSampler(N, seed=9, shard_size=10)
    seen: list[int] = []
    for step in range(12):
        if step == 1:
            s.quarantine(0)
        if s.epoch:
            break
        batch = list(_take(iter(s), min(4, len(s)))) if len(s) else []
        seen += batch
        s.advance(len(batch))
    assert len(seen) == len(set(seen))


def test_dataset_identity_is_recorded_and_checked() -> None:
    identity = DatasetIdentity(name="corpus", version="v2", shards=("a.bin", "b.bin"))
    assert identity.digest.startswith("sha256:")
    assert identity.digest != DatasetIdentity(name="corpus", version="v2", shards=("a.bin", "c.bin")).digest
    sampler = ResumableSampler(N, seed=1, dataset=identity)
    assert sampler.state_dict()["dataset"] == identity.to_dict()

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = api.capture(step=1, model=model, optimizer=opt, sampler=sampler, config={"a": 1})
    same = ResumableSampler(N, seed=1, dataset=identity)
    assert api.resume_mismatches(snap, sampler=same) == []
    other = ResumableSampler(N, seed=1, dataset=DatasetIdentity(name="corpus", version="v3", shards=("a.bin",)))
    differences = api.resume_mismatches(snap, sampler=other)
    assert any("dataset version 'v2' in the checkpoint, 'v3' now" in d for d in differences)
    assert any(d.startswith("dataset digest") for d in differences)
    assert ResumeMismatchError.code == "resume_mismatch"


def test_torch_sampler_protocol() -> None:
    s = ResumableSampler(N, seed=0, world_size=4, rank=2)
    assert len(s) == N // 4 and len(list(s)) == N // 4
    s.set_epoch(3)
    assert s.epoch == 3 and list(s) != list(ResumableSampler(N, seed=0, world_size=4, rank=2))
    assert isinstance(np.asarray(list(s)), np.ndarray)


def test_rank_and_world_size_default_to_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ckptfmt.torch import ResumableDataLoader

    assert (ResumableSampler(N).rank, ResumableSampler(N).world_size) == (0, 1)  # no process group: one process
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    s = ResumableSampler(N, seed=7)
    assert (s.rank, s.world_size) == (2, 3)
    assert list(s) == list(ResumableSampler(N, seed=7, rank=2, world_size=3))
    loader = ResumableDataLoader(Indices(), batch_size=4, seed=7)
    assert (loader.rank, loader.world_size) == (2, 3)
    assert ResumableSampler(N, rank=0).rank == 0  # explicit values win


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_tail_ends_the_epoch(workers: int) -> None:
    """DataLoader(drop_last=True) over a ResumableSampler: the tail smaller than a batch is dropped and the
    next loop starts the next epoch (it used to yield nothing, forever); a resume between keeps the order."""

    def loop(sampler: ResumableSampler, batches: int) -> list[list[int]]:
        loader = DataLoader(Indices(), batch_size=10, sampler=sampler, drop_last=True, num_workers=workers)  # type: ignore[arg-type]
        out: list[list[int]] = []
        while len(out) < batches:
            for batch in loader:
                out.append(batch.tolist())
                sampler.advance(len(batch))
                if len(out) == batches:
                    break
        return out

    reference = loop(ResumableSampler(N, seed=2), 27)  # 96 samples, 9 batches an epoch: three epochs
    assert [len(set(i for b in reference[e * 9 : e * 9 + 9] for i in b)) for e in range(3)] == [90, 90, 90]
    first = ResumableSampler(N, seed=2)
    head = loop(first, 9)  # the epoch's last full batch: its 6-sample tail is still ahead
    resumed = ResumableSampler(N, seed=2)
    resumed.load_state_dict(first.state_dict())
    assert head + loop(resumed, 18) == reference
