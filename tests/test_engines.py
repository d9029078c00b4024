"""The manager's parts alone: option groups and the combinations refused at construction
(ckptfmt/torch/options.py), the save engines (ckptfmt/torch/durable.py, memory_engine.py) and the restorer
(ckptfmt/torch/restorer.py), each driven without the manager where it can be."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptfmt.errors import UsageError
from ckptfmt.run import RunDirectory
from ckptfmt.torch import CheckpointManager, ResumableSampler
from ckptfmt.torch.durable import DurableEngine
from ckptfmt.torch.engines import Due, SaveEngine
from ckptfmt.torch.memory_engine import MemoryEngine
from ckptfmt.torch.options import (
    DurableOptions,
    MemoryOptions,
    PreemptionOptions,
    RestoreOptions,
    RetentionOptions,
)
from ckptfmt.torch.restorer import Restorer
from ckptfmt.torch.training_state import Lineage, Stateful, TrainingState


def live() -> TrainingState:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    sampler = ResumableSampler(16, seed=1)
    sampler.advance(2)
    return TrainingState(model=model, optimizer=optimizer, config={"lr": 0.1}, sampler=sampler)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"async_save": True}, "async_save=True"),
        ({"async_save": True, "incremental": True}, "async_save=True"),
    ],
)
def test_durable_options_the_memory_tier_cannot_honour_are_refused_by_name(
    tmp_path: Path, options: dict[str, object], named: str
) -> None:
    with pytest.raises(UsageError, match=named) as caught:
        CheckpointManager(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", **options)  # type: ignore[arg-type]
    assert "memory_every=" in str(caught.value)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"frozen": ("w",)}, "incremental=True"),
        ({"full_every": 3}, "incremental=True"),
        ({"replicate": True}, "replicate"),
        ({"memory_slots": 3}, "memory_slots"),
        ({"close_timeout": 1.0}, "close_timeout"),
        ({"memory_every": -1}, "memory_every"),
        ({"keep_last": 0}, "keep_last"),
    ],
)
def test_options_that_would_do_nothing_are_refused_at_construction(
    tmp_path: Path, options: dict[str, object], named: str
) -> None:
    with pytest.raises(UsageError, match=named):
        CheckpointManager(tmp_path / "run", **options)  # type: ignore[arg-type]


def test_an_option_group_and_its_keywords_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="retention= or keep_last="):
        CheckpointManager(tmp_path / "run", keep_last=5, retention=RetentionOptions(keep_last=2))
    with pytest.raises(UsageError, match="takes a DurableOptions"):
        CheckpointManager(tmp_path / "run", durable=RetentionOptions())  # type: ignore[arg-type]


def test_option_groups_are_the_same_manager_as_keywords(tmp_path: Path) -> None:
    grouped = CheckpointManager(
        tmp_path / "a",
        retention=RetentionOptions(keep_last=2, keep_every=10),
        durable=DurableOptions(incremental=True, full_every=4),
        preemption=PreemptionOptions(signals=()),
        restore=RestoreOptions(on_mismatch="warn"),
    )
    keywords = CheckpointManager(
        tmp_path / "b",
        keep_last=2,
        keep_every=10,
        incremental=True,
        full_every=4,
        preemption_signals=(),
        on_mismatch="warn",
    )
    for mgr in (grouped, keywords):
        assert (mgr.keep_last, mgr.keep_every) == (2, 10)
        assert mgr.durable == DurableOptions(incremental=True, full_every=4)
        mgr.close()
    with pytest.raises(dataclasses.FrozenInstanceError):
        grouped.durable.incremental = False  # type: ignore[misc]


def test_the_durable_engine_alone_saves_and_the_restorer_alone_restores(tmp_path: Path) -> None:
    run = RunDirectory(str(tmp_path / "run"))
    lineage = Lineage.start(data_policy="strict", loader=None)
    engine: SaveEngine = DurableEngine(
        run, collective=None, lineage=lineage, retention=RetentionOptions(), options=DurableOptions()
    )
    assert engine.due(3, every=2, preempted=False) == Due(write=False, durable=False)
    assert engine.due(3, every=2, preempted=True).write
    state = live()
    engine.save(4, state, persist=True)
    saved_id = engine.wait()
    assert saved_id is not None and run.latest() is not None
    engine.close(persist=True)

    fresh = live()
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    restorer = Restorer(
        run, collective=None, lineage=Lineage.start(data_policy="strict", loader=None), options=RestoreOptions()
    )
    report = restorer.restore(fresh)
    assert report is not None and report.step == 4 and report.tier == "durable" and report.checkpoint_id == saved_id
    for a, b in zip(state.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert restorer.lineage.step == 4 and restorer.lineage.last_checkpoint_id == saved_id


def test_the_restorer_finds_nothing_in_an_empty_run(tmp_path: Path) -> None:
    restorer = Restorer(
        RunDirectory(str(tmp_path / "run")),
        collective=None,
        lineage=Lineage.start(data_policy="strict", loader=None),
        options=RestoreOptions(),
    )
    assert restorer.candidates() == [] and restorer.restore(live()) is None


def test_the_memory_engine_alone_snapshots_and_persists(tmp_path: Path) -> None:
    run = RunDirectory(str(tmp_path / "run"))
    lineage = Lineage.start(data_policy="strict", loader=None)
    engine = MemoryEngine(
        run,
        options=MemoryOptions(every=1, memory_dir=tmp_path / "shm"),
        codec=None,
        lineage=lineage,
        retention=RetentionOptions(),
        collective=None,
        process_group=None,
    )
    try:
        assert engine.due(3, every=2, preempted=False) == Due(write=True, durable=False)
        state = live()
        engine.save(1, state, persist=False)
        engine.wait_written()
        assert engine.snapshots.newest is not None and engine.snapshots.newest.step == 1
        engine.save(2, state, persist=True)
        engine.wait()
        assert run.latest() is not None
    finally:
        engine.close(persist=False)


def test_a_training_state_record_or_keywords_but_not_both(tmp_path: Path) -> None:
    state = live()
    assert isinstance(state.sampler, Stateful) and isinstance(state.optimizer, Stateful)
    with CheckpointManager(tmp_path / "run", preemption_signals=()) as mgr:
        mgr.save(1, state)
        assert mgr.checkpoint_if_due(2, state, every=2)
        with pytest.raises(UsageError, match="not both"):
            mgr.save(3, state, model=state.model)
    with CheckpointManager(tmp_path / "run", preemption_signals=()) as mgr:
        assert mgr.restore_latest(live()) == 2
