"""The step guard (ckptfmt.torch.guard): a bad step rolls back from memory, is replayed, and bad data is quarantined."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ckptfmt.errors import UsageError
from ckptfmt.quarantine import QuarantineEntry
from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableDataLoader, TrainingState
from ckptfmt.torch.guard import GuardError, GuardEvent, GuardOptions, SpikeRule

Fault = Callable[[int, int, torch.Tensor, list[int]], torch.Tensor]  # (step, attempt, loss, samples) -> loss


def train(
    root: Path,
    *,
    total: int = 12,
    fault: Fault | None = None,
    guard: GuardOptions | None = None,
    quarantined: Iterable[int] = (),
    durable_every: int = 1000,
    adopt: Sequence[QuarantineEntry] = (),
) -> tuple[list[torch.Tensor], list[GuardEvent], CheckpointManager, ResumableDataLoader[Any]]:
    """A tiny run: a linear model, AdamW, a shuffling ResumableDataLoader, a memory snapshot every step."""
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x.sum(1, keepdim=True)
    index = torch.arange(len(x))
    loader: ResumableDataLoader[Any] = ResumableDataLoader(
        TensorDataset(x, y, index), batch_size=8, seed=3, shuffle=True
    )
    for index in quarantined:  # the clean run to compare with: these samples never were in the order
        loader.resumable_sampler.quarantine_samples([index], step=0, reason="manual")
    if adopt:  # a replay of another run with its record: each entry from where it took effect in that run
        loader.adopt_record(adopt)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model=model, optimizer=optimizer, loader=loader, config={"run": "guard"})
    mgr = CheckpointManager(
        root / "run",
        memory=MemoryOptions(every=1, memory_dir=root / "memory"),
        guard=guard or GuardOptions(),
        preemption_signals=(),
    )
    attempts: dict[int, int] = {}
    step = 0
    mgr.checkpoint_if_due(0, state, every=durable_every)  # the state before step 1, for a first step that trips
    while step < total:
        for xb, yb, ib in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            attempts[step + 1] = attempts.get(step + 1, 0) + 1
            if fault is not None:
                loss = fault(step + 1, attempts[step + 1], loss, ib.tolist())
            loss.backward()
            verdict = mgr.guard(step + 1, state, loss=loss)
            if verdict.rolled_back:
                step = verdict.step
                break
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            mgr.checkpoint_if_due(step, state, every=durable_every)
            if step >= total:
                break
    events = mgr.guard_events
    return [p.detach().clone() for p in model.parameters()], events, mgr, loader


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_a_transient_fault_is_rolled_back_replayed_and_the_run_ends_bit_identical(tmp_path: Path) -> None:
    clean, events, mgr, _ = train(tmp_path / "clean")
    mgr.close(persist=False)
    assert events == []

    def once(step: int, attempt: int, loss: torch.Tensor, samples: list[int]) -> torch.Tensor:
        return loss * math.nan if step == 5 and attempt == 1 else loss

    faulty, events, mgr, loader = train(tmp_path / "faulty", fault=once)
    mgr.close(persist=False)
    assert [e.kind for e in events] == ["rolled_back", "transient"]
    assert events[1].step == 5 and events[1].ranks == (0,) and "nonfinite" in events[1].reason
    assert math.isnan(events[0].values["loss@rank0"])
    assert loader.state_dict().get("quarantine", []) == []  # nothing quarantined
    assert same(clean, faulty)


def test_a_spike_rule_judges_against_the_window_of_accepted_losses() -> None:
    rule = SpikeRule(window=10, warmup=5, z=4.0)
    steady = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    assert rule.judge(1.2, steady[:4]) is None  # not warmed up
    assert rule.judge(1.2, steady) is None
    assert rule.judge(5.0, steady) is not None and "stdev" in str(rule.judge(5.0, steady))
    ratio = SpikeRule(window=10, warmup=3, z=None, ratio=3.0)
    assert ratio.judge(2.9, [1.0, 1.0, 1.0]) is None
    assert "median" in str(ratio.judge(3.1, [1.0, 1.0, 1.0]))
    for bad in ({"warmup": 1}, {"warmup": 20, "window": 10}, {"z": None, "ratio": None}, {"ratio": 0.5}):
        with pytest.raises(UsageError):
            SpikeRule(**bad)  # type: ignore[arg-type]


def test_a_guard_without_the_memory_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="memory tier"):
        CheckpointManager(tmp_path / "run", guard=GuardOptions(), preemption_signals=())
    with pytest.raises(UsageError, match="policy"):
        GuardOptions(policy="everything")  # type: ignore[arg-type]


def test_a_guard_that_trips_on_every_step_stops_with_an_error_naming_its_policy(tmp_path: Path) -> None:
    def always(step: int, loss: float, norm: float | None) -> str:
        return "the predicate says so"

    with pytest.raises(GuardError, match=r"max_rollbacks=2.*policy='batch'"):
        train(tmp_path, guard=GuardOptions(predicate=always, max_rollbacks=2))


def test_policy_window_rolls_back_steps_and_skips_their_samples_as_a_run_that_never_had_them(tmp_path: Path) -> None:
    order = ResumableDataLoader(TensorDataset(torch.zeros(256, 1)), batch_size=8, seed=3, shuffle=True)
    first = order.resumable_sampler.upcoming(256)
    bad = first[8 * 8 + 2]  # a sample of step 9

    def poisoned(step: int, attempt: int, loss: torch.Tensor, samples: list[int]) -> torch.Tensor:
        return loss * math.nan if bad in samples else loss

    window = GuardOptions(policy="window", window_steps=3)
    guarded, events, mgr, loader = train(tmp_path / "guarded", fault=poisoned, guard=window, durable_every=4)
    mgr.close(persist=False)
    assert [(e.step, e.kind) for e in events] == [(9, "rolled_back"), (9, "quarantined")]
    skipped = list(events[1].samples)
    back = events[1].restored  # the newest checkpoint of step 5 or older: a durable save (memory holds 7 and 8)
    assert back is not None and back <= 9 - 1 - 3
    assert sorted(skipped) == sorted(first[back * 8 : 9 * 8])  # every sample from there to the end of step 9
    (entry,) = loader.quarantine_record
    assert entry.reason == "window" and entry.step == 9 and list(entry.samples) == sorted(skipped)

    clean, events, mgr, _ = train(tmp_path / "clean", quarantined=skipped)
    mgr.close(persist=False)
    assert events == [] and same(clean, guarded)


def test_a_spike_detector_that_trips_on_every_step_hits_the_cap(tmp_path: Path) -> None:
    def growing(step: int, attempt: int, loss: torch.Tensor, samples: list[int]) -> torch.Tensor:
        return loss * 0 + float(2**step)  # every loss far above the last ones: a spike from the warm-up on

    spikes = GuardOptions(spike=SpikeRule(window=5, warmup=3, z=3.0), max_rollbacks=3, per_steps=50)
    with pytest.raises(GuardError, match=r"step 4 tripped the guard \(spike: .*max_rollbacks=3.*policy='batch'"):
        train(tmp_path, fault=growing, guard=spikes)


def test_no_checkpoint_holds_a_state_that_tripped_the_guard(tmp_path: Path) -> None:
    import ckptfmt

    order = ResumableDataLoader(TensorDataset(torch.zeros(256, 1)), batch_size=8, seed=3, shuffle=True)
    bad = order.resumable_sampler.upcoming(256)[4 * 8]  # a sample of step 5: bad data on every attempt

    def poisoned(step: int, attempt: int, loss: torch.Tensor, samples: list[int]) -> torch.Tensor:
        return loss * math.nan if bad in samples else loss

    _, events, mgr, _ = train(tmp_path, fault=poisoned, durable_every=1)
    mgr.close()
    assert [e.kind for e in events] == ["rolled_back", "quarantined"]
    for name in sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")):
        with ckptfmt.open_checkpoint(tmp_path / "run" / name) as ckpt:
            for tensor in ckpt.tensor_names("weights"):
                assert np.isfinite(ckpt.read_tensor("weights", tensor)).all(), name


def test_a_replay_from_the_first_checkpoint_with_the_record_ends_bit_identical_across_epochs(tmp_path: Path) -> None:
    sampler = ResumableDataLoader(TensorDataset(torch.zeros(256, 1)), batch_size=8, seed=3).resumable_sampler
    sampler.set_epoch(1)
    bad = sampler.upcoming(256)[2 * 8]  # trained on in epoch 0; makes step 35 (epoch 1) NaN

    def goes_bad(step: int, attempt: int, loss: torch.Tensor, samples: list[int]) -> torch.Tensor:
        return loss * math.nan if step > 32 and bad in samples else loss

    guarded, events, mgr, loader = train(tmp_path / "guarded", total=40, fault=goes_bad)
    mgr.close(persist=False)
    assert [(e.step, e.kind) for e in events] == [(35, "rolled_back"), (35, "quarantined")]
    record = loader.quarantine_record
    assert len(record) == 1 and record[0].since == (1, 2 * 8) and bad in record[0].samples

    replayed, events, mgr, _ = train(tmp_path / "replay", total=40, adopt=record)  # no fault: the record alone
    mgr.close(persist=False)
    assert events == [] and same(replayed, guarded)
    # the record applied from the start instead would also leave the samples out of epoch 0: another run
    early, _, mgr, _ = train(tmp_path / "early", total=40, quarantined=record[0].samples)
    mgr.close(persist=False)
    assert not same(early, guarded)
