"""ResumableDataLoader: its position is what it handed to the trainer (workers, prefetch, drop_last, persistent
workers, epochs), a resume continues the global order on any world size, it never touches the global RNG;
the loud misuse errors and warnings; torchdata's StatefulDataLoader through the same API."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptfmt.errors import UsageError
from ckptfmt.torch import CheckpointManager, InexactResumeWarning, ResumableDataLoader, ResumableSampler, api

N = 23  # not a multiple of any batch size used here: every epoch ends in a partial (or dropped) batch


class Indices(Dataset[int]):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def make(**kwargs: Any) -> ResumableDataLoader[int]:
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("seed", 3)
    return ResumableDataLoader(Indices(kwargs.pop("n", N)), **kwargs)


def epochs(loader: ResumableDataLoader[int], until: int) -> list[list[int]]:
    out: list[list[int]] = []
    while loader.epoch < until:
        out += [b.tolist() for b in loader]
    return out


def take(loader: ResumableDataLoader[int], k: int) -> list[list[int]]:
    """``k`` batches the way a trainer loops: ``for batch in loader`` again whenever an epoch ends."""
    out: list[list[int]] = []
    it = iter(loader)
    while len(out) < k:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            it = iter(loader)
    return out


CONFIGS = {
    "plain": {},
    "drop_last": {"drop_last": True},
    "workers2-prefetch4": {"num_workers": 2, "prefetch_factor": 4},
    "workers2-persistent-drop_last": {"num_workers": 2, "persistent_workers": True, "drop_last": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resumes_at_any_batch_without_repeating_or_skipping(name: str) -> None:
    config = CONFIGS[name]
    reference = epochs(make(**config), 3)
    assert len(reference) == 3 * (5 if config.get("drop_last") else 6)
    for epoch in range(3):  # each epoch: every sample once, in a new order
        batches = reference[epoch * len(reference) // 3 : (epoch + 1) * len(reference) // 3]
        seen = [i for b in batches for i in b]
        assert len(seen) == len(set(seen)) and len(seen) == (20 if config.get("drop_last") else N)
    workers = bool(config.get("num_workers"))
    # with workers, a few cut points (mid-epoch, last batch of an epoch, first of the next); without, all
    cuts = [3, 5, 6, 8] if workers else range(1, len(reference))
    for k in cuts:
        first = make(**config)
        head = take(first, k)
        state = first.state_dict()
        per_epoch = len(reference) // 3
        assert state["epoch"] == k // per_epoch  # an epoch ends with its last batch handed out
        assert state["global_sample_offset"] == sum(len(b) for b in head[k - k % per_epoch :])
        resumed = make(**{**config, "num_workers": 0, "persistent_workers": False, "prefetch_factor": None})
        resumed.load_state_dict(state)
        assert head + epochs(resumed, 3) == reference, f"{name}: resumed after batch {k}"


def test_position_is_what_the_trainer_got_not_what_workers_prefetched() -> None:
    loader = make(num_workers=2, prefetch_factor=4, batch_size=2)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    sampler = loader.resumable_sampler
    assert sampler.handed_out > 6  # the workers' indices ran ahead of the trainer
    assert loader.state_dict()["global_sample_offset"] == 6
    del it
    resumed = make(batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert [i for b in got for i in b] + [i for b in resumed for i in b.tolist()] == [
        i for b in make(batch_size=2) for i in b.tolist()
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_never_draws_from_the_global_rng(workers: int) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    loader = make(num_workers=workers)
    epochs(loader, 2)
    take(loader, 2)
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
    # a plain DataLoader does draw, which is what breaks dropout masks after a resume
    list(DataLoader(Indices(), batch_size=4, shuffle=True))
    assert not torch.equal(before[0], torch.get_rng_state())


class Noisy(Indices):
    """A random augmentation drawn in __getitem__, from all three global RNGs of the fetching process."""

    def __getitem__(self, index: int) -> int:
        return int(torch.randint(0, 1 << 20, ()).item()) ^ random.getrandbits(20) ^ int(np.random.randint(1 << 20))


def test_worker_side_randomness_resumes_exactly() -> None:
    """Seeded per (seed, epoch, sample) in the workers: the same for any worker count, persistent or not,
    and after a mid-epoch resume into another worker count."""

    def noisy(**kwargs: Any) -> ResumableDataLoader[int]:
        return ResumableDataLoader(Noisy(), batch_size=4, seed=5, **kwargs)

    reference = epochs(noisy(num_workers=2), 2)
    assert epochs(noisy(num_workers=1), 2) == reference
    assert epochs(noisy(num_workers=2, persistent_workers=True), 2) == reference
    first = noisy(num_workers=2)
    head = take(first, 3)
    resumed = noisy(num_workers=1)
    resumed.load_state_dict(first.state_dict())
    assert head + epochs(resumed, 2) == reference
    assert reference[:6] != reference[6:12]  # each epoch draws anew
    assert noisy().user_dataset.n == N and len(noisy().dataset) == N  # type: ignore[attr-defined,arg-type]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_world_size_change_continues_the_global_order(before: int, after: int) -> None:
    """Simulated ranks (explicit rank/world_size): saved on ``before`` ranks, resumed on ``after``; the
    samples consumed by all ranks together follow one global order, none repeated, none skipped."""
    n, per_rank = 96, 2

    def ranks(world: int) -> list[ResumableDataLoader[int]]:
        return [make(n=n, batch_size=per_rank, rank=r, world_size=world) for r in range(world)]

    def steps(loaders: list[ResumableDataLoader[int]], count: int) -> list[int]:
        its = [iter(loader) for loader in loaders]
        out: list[int] = []
        for _ in range(count):
            batches = [next(it).tolist() for it in its]
            for i in range(per_rank):  # rank r's i-th sample of a step is global sample i * world + r
                out += [b[i] for b in batches]
        return out

    (single,) = [make(n=n, batch_size=1, rank=0, world_size=1)]
    reference = [i for b in single for i in b.tolist()]
    old = ranks(before)
    head = steps(old, 12 // before)
    state = old[0].state_dict()
    assert all(loader.state_dict() == state for loader in old)  # one global position, whatever the rank
    assert state["global_sample_offset"] == len(head) == 12 * per_rank
    new = ranks(after)
    for loader in new:
        loader.load_state_dict(state)
    tail = steps(new, (n - len(head)) // (per_rank * after))
    assert head + tail == reference[: len(head) + len(tail)]
    assert len(set(head + tail)) == len(head + tail)


def test_one_live_iterator_at_a_time() -> None:
    loader = make()
    it = iter(loader)
    next(it)
    with pytest.raises(UsageError, match="two loops over one sampler"):
        next(iter(loader))
    del it
    # a loop left with break is over: the next one continues where it stopped
    for config in ({}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}):
        loader = make(**config)
        got = []
        for batch in loader:
            got.append(batch.tolist())
            break
        got += [b.tolist() for b in loader]
        assert got == [b.tolist() for b in make()]
    # next(iter(loader)) every step, a common idiom, gives consecutive batches
    loader = make()
    assert [next(iter(loader)).tolist() for _ in range(3)] == take(make(), 3)


@pytest.mark.parametrize("config", [{}, {"drop_last": True}, {"num_workers": 2}])
def test_an_iterator_that_handed_out_its_epoch_is_not_a_rival(config: dict[str, Any]) -> None:
    """A trainer that knows the epoch's length (Lightning) never asks the iterator for its StopIteration: the
    next epoch's iterator starts while the spent one is still referenced."""
    loader = make(**config)
    per_epoch = 5 if config.get("drop_last") else 6
    reference = epochs(make(**config), 2)
    got: list[list[int]] = []
    spent = []
    for _ in range(2):
        it = iter(loader)
        got += [next(it).tolist() for _ in range(per_epoch)]
        spent.append(it)  # kept alive, never exhausted
    assert got == reference
    it = iter(loader)
    next(it)
    with pytest.raises(UsageError, match="two loops over one sampler"):  # mid-epoch, a second loop still is
        iter(loader)


@pytest.mark.parametrize("config", [{}, {"drop_last": True}])
def test_len_counts_the_whole_epoch_after_a_mid_epoch_resume(config: dict[str, Any]) -> None:
    """``len(loader)`` is the epoch's batches on this rank, those handed out included, as a DataLoader's: what
    Lightning counts a resumed epoch against (it skips none itself: the loader continues at its position)."""
    per_epoch = 5 if config.get("drop_last") else 6
    first = make(**config)
    it = iter(first)
    for k in range(per_epoch):
        assert len(first) == per_epoch, k
        next(it)
    assert len(first) == per_epoch and first.epoch == 1
    first = make(**config)
    take(first, 3)
    resumed = make(**config)
    resumed.load_state_dict(first.state_dict())
    assert len(resumed) == per_epoch
    assert len(list(resumed)) == per_epoch - 3
    assert len(make(**config, rank=1, world_size=2)) == (2 if config.get("drop_last") else 3)


def test_sampler_refuses_two_live_iterators() -> None:
    sampler = ResumableSampler(N, seed=1)
    first = iter(sampler)
    next(first)
    with pytest.raises(UsageError, match=r"ResumableSampler.__iter__ called while another iterator"):
        iter(sampler)
    first = iter([])  # the first one is gone: a new loop may start
    assert len(list(sampler)) == N


def test_refused_arguments_name_the_fix() -> None:
    for kwargs in ({"sampler": ResumableSampler(N)}, {"generator": torch.Generator()}, {"batch_sampler": [[0]]}):
        with pytest.raises(UsageError, match="builds its own seeded ResumableSampler"):
            make(**kwargs)
    with pytest.raises(UsageError, match="in_order=True"):
        make(in_order=False)

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(UsageError, match="map-style dataset"):
        ResumableDataLoader(Stream(), batch_size=2)
    with pytest.raises(UsageError, match="every epoch would be empty"):
        make(n=3, drop_last=True)


# ---------------------------------------------------------------- through the manager and api


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_manager_saves_and_restores_the_loader(tmp_path: Path) -> None:
    model, opt = _model()
    loader = make(num_workers=2)
    mgr = CheckpointManager(tmp_path / "run", loader=loader)
    assert mgr.restore_latest(model=model, optimizer=opt) is None
    head = take(loader, 8)  # into the second epoch
    mgr.save(8, model=model, optimizer=opt, config={})
    mgr.close()
    resumed = make()
    model, opt = _model()
    assert CheckpointManager(tmp_path / "run").restore_latest(model=model, optimizer=opt, loader=resumed) == 8
    assert head + take(resumed, 10) == take(make(), 18)
    with pytest.raises(UsageError, match="not both"):
        api.save(
            tmp_path / "x", step=1, model=model, optimizer=opt, config={}, loader=resumed, sampler=ResumableSampler(1)
        )
    with pytest.raises(UsageError, match="needs the data position"):
        api.save(tmp_path / "x", step=1, model=model, optimizer=opt, config={})


def test_a_sampler_never_advanced_is_refused_at_save(tmp_path: Path) -> None:
    model, opt = _model()
    sampler = ResumableSampler(N, seed=1)
    loader = DataLoader(Indices(), batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(1))  # type: ignore[arg-type]
    mgr = CheckpointManager(tmp_path / "run")
    for _ in range(2):
        for _batch in loader:  # the README's old loop without sampler.advance(len(batch))
            pass
    with pytest.raises(UsageError, match=r"never moved \(sampler.advance\(\) was never called\)") as err:
        mgr.save(12, model=model, optimizer=opt, sampler=sampler, config={})
    assert "ResumableDataLoader" in str(err.value) and 'on_mismatch="warn"' in str(err.value)
    with pytest.raises(UsageError, match="never moved"):  # the DataLoader itself, as loader=
        mgr.save(12, model=model, optimizer=opt, loader=loader, config={})
    with pytest.raises(UsageError, match="never moved"):
        api.save(tmp_path / "direct", step=12, model=model, optimizer=opt, sampler=sampler, config={})
    with pytest.warns(InexactResumeWarning, match="re-read the samples it already trained on"):
        CheckpointManager(tmp_path / "run2", on_mismatch="warn").save(
            12, model=model, optimizer=opt, sampler=sampler, config={}
        )
    sampler.advance(4)  # used as documented: no complaint
    mgr.save(13, model=model, optimizer=opt, sampler=sampler, config={})
    mgr.close()


def test_a_sampler_with_no_position_is_refused_at_save(tmp_path: Path) -> None:
    model, opt = _model()
    loader = DataLoader(Indices(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(UsageError, match=r"sampler \(RandomSampler\) cannot report its position"):
        api.save(tmp_path / "c", step=1, model=model, optimizer=opt, loader=loader, config={})


def test_restoring_into_a_plain_dataloader_warns_why_it_is_not_exact(tmp_path: Path) -> None:
    model, opt = _model()
    sampler = ResumableSampler(N, seed=1)
    sampler.advance(4)
    api.save(tmp_path / "c", step=1, model=model, optimizer=opt, sampler=sampler, config={})
    target = ResumableSampler(N, seed=1)
    no_generator = DataLoader(Indices(), batch_size=4, sampler=target)  # type: ignore[arg-type]
    with pytest.warns(InexactResumeWarning, match=r"generator=None.*generator=torch.Generator\(\).manual_seed"):
        api.load(tmp_path / "c", model=model, optimizer=opt, loader=no_generator)
    assert target.consumed == 4  # the position still went into its ResumableSampler
    random_sampler = DataLoader(Indices(), batch_size=4, shuffle=True, generator=torch.Generator())
    with pytest.warns(InexactResumeWarning, match=r"RandomSampler\) cannot report its position"):
        api.load(tmp_path / "c", model=model, optimizer=opt, sampler=random_sampler)
    exact = DataLoader(Indices(), batch_size=4, sampler=ResumableSampler(N, seed=1), generator=torch.Generator())  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.load(tmp_path / "c", model=model, optimizer=opt, loader=exact)
        api.load(tmp_path / "c", model=model, optimizer=opt, loader=make(seed=1))  # the sampler's state fits


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader(tmp_path: Path, workers: int) -> None:
    def build() -> StatefulDataLoader:
        order = RandomSampler(Indices(), generator=torch.Generator().manual_seed(4))
        return StatefulDataLoader(
            Indices(), batch_size=4, sampler=order, num_workers=workers, generator=torch.Generator().manual_seed(5)
        )

    uninterrupted = build()
    reference = [b.tolist() for _ in range(2) for b in uninterrupted]
    model, opt = _model()
    loader = build()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    with CheckpointManager(tmp_path / "run", loader=loader) as mgr:
        mgr.save(3, model=model, optimizer=opt, config={})
    del it
    resumed = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        assert CheckpointManager(tmp_path / "run").restore_latest(model=model, optimizer=opt, loader=resumed) == 3
    tail = [b.tolist() for b in resumed] + [b.tolist() for b in resumed]
    assert head + tail == reference  # the rest of the epoch, then the next epoch's order
    # shuffle=True with generator= shares one generator between the order and the workers' seeds: the
    # epoch after a mid-epoch resume differs (torchdata's behaviour), and the user is told so
    shared = StatefulDataLoader(Indices(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(4))
    with pytest.warns(InexactResumeWarning, match=r"sampler=RandomSampler\(dataset, generator="):
        CheckpointManager(tmp_path / "run").restore_latest(model=model, optimizer=opt, loader=shared)
    # a ResumableDataLoader's state is refused by a StatefulDataLoader, clearly, not garbled into it
    api.save(tmp_path / "ours", step=1, model=model, optimizer=opt, loader=make(), config={})
    with pytest.raises(UsageError, match="written by a ResumableSampler"):
        api.load(tmp_path / "ours", model=model, optimizer=opt, loader=build())


def test_a_quarantine_mid_epoch_resumes_exactly() -> None:
    """A shard quarantined mid-epoch stays in the epoch in flight and is left out from the next one on;
    a resume in between reproduces both."""

    def loader() -> ResumableDataLoader[int]:
        return make(n=40, shard_size=8)

    def run(resume_after: int | None) -> list[list[int]]:
        current = loader()
        it = iter(current)
        out: list[list[int]] = []
        while len(out) < 25:
            if len(out) == 3:
                current.resumable_sampler.quarantine(2)  # e.g. batch 3 held a NaN from shard 2
            if len(out) == resume_after:
                state = current.state_dict()
                del it
                current = loader()
                current.load_state_dict(state)
                it = iter(current)
            try:
                out.append(next(it).tolist())
            except StopIteration:
                it = iter(current)
        return out

    reference = run(None)
    assert any(i // 8 == 2 for b in reference[3:10] for i in b)  # still in the epoch in flight
    assert not any(i // 8 == 2 for b in reference[10:] for i in b)  # left out from the next epoch on
    assert run(resume_after=6) == reference and run(resume_after=12) == reference
