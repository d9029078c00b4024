"""A DCP trainer's state dict through the checkpoint manager and its memory tier (``ckptfmt.dcp.training_state``):
snapshots every step, a run abandoned after step 5 as a SIGKILL leaves it, and a fresh process's restore from memory
that goes on to end bit-identical to an uninterrupted run; every entry of the state dict back, the trainer's own
``Stateful`` and plain dicts included. Entries the manager could not put back are refused, naming them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict
from torch.utils.data import TensorDataset

from ckptfmt.dcp import training_state
from ckptfmt.errors import UsageError
from ckptfmt.torch import CheckpointManager, ResumableDataLoader, TrainingState

STEPS, DIES_AFTER = 8, 5
CONFIG = {"lr": 0.01, "seed": 7}


class TrainState:
    """torchtitan's ``train_state``: a Stateful of plain counters."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens = state_dict["step"], state_dict["tokens"]


class ModelWrapper:
    """torchtitan's ``ModelWrapper``: a Stateful over the model's DCP state dict."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: ResumableDataLoader
    train_state: TrainState
    counters: dict[str, Any]

    def states(self) -> dict[str, Any]:
        """The state dict torchtitan's CheckpointManager builds and hands dcp.save."""
        return {
            "model": ModelWrapper(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.scheduler,
            "dataloader": self.loader,
            "train_state": self.train_state,
            "counters": self.counters,
        }

    def state(self) -> TrainingState:
        return training_state(self.states(), model=self.model, optimizer=self.optimizer, config=CONFIG)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.train_state.step += 1
        self.train_state.tokens += x.shape[0]
        self.counters["losses"] = [*self.counters["losses"], loss.item()]


def build(seed: int) -> Trainer:
    torch.manual_seed(seed)  # a fresh process initializes differently: the restore must overwrite all of it
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    loader = ResumableDataLoader(data, batch_size=8, shuffle=True, seed=11)
    return Trainer(model, optimizer, scheduler, loader, TrainState(), {"losses": [], "name": f"run{seed}"})


def train(t: Trainer, mgr: CheckpointManager | None, start: int, stop: int) -> None:
    step = start
    while step < stop:
        for x, y in t.loader:
            t.step(x, y)
            step += 1
            if mgr is not None:
                mgr.checkpoint_if_due(step, t.state(), every=100)
            if step == stop:
                return


def everything(t: Trainer) -> dict[str, Any]:
    return {
        "weights": {k: v.clone() for k, v in t.model.state_dict().items()},
        "optimizer": get_optimizer_state_dict(t.model, t.optimizer),
        "scheduler": t.scheduler.state_dict(),
        "train_state": t.train_state.state_dict(),
        "counters": dict(t.counters),
        "loader": t.loader.state_dict(),
    }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_dcp_state_dict_restored_from_memory_ends_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = build(7)
    train(reference, None, 0, STEPS)

    killed = build(7)
    mgr = CheckpointManager(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", keep_last=3)
    train(killed, mgr, 0, DIES_AFTER)
    mgr.wait_memory()  # step 5's snapshot is committed; then the process "dies" (nothing more persisted)
    mgr.close(persist=False)

    resumed = build(99)
    mgr = CheckpointManager(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", keep_last=3)
    counters = resumed.counters
    assert mgr.restore_latest(resumed.state()) == DIES_AFTER
    assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
    assert resumed.train_state.state_dict() == {"step": DIES_AFTER, "tokens": 8 * DIES_AFTER}
    assert resumed.counters is counters and counters["name"] == "run7" and len(counters["losses"]) == DIES_AFTER
    train(resumed, mgr, DIES_AFTER, STEPS)
    mgr.close()
    assert equal(everything(resumed), everything(reference))


def test_entries_the_manager_could_not_put_back_are_refused_naming_them() -> None:
    t = build(7)
    stray = {**t.states(), "ema": {"shadow": torch.zeros(3)}}
    with pytest.raises(UsageError, match="'ema'") as caught:
        training_state(stray, model=t.model, optimizer=t.optimizer)
    assert caught.value.tensor == "ema.shadow"
    with pytest.raises(UsageError, match="'epoch' is a int"):
        training_state({**t.states(), "epoch": 3}, model=t.model, optimizer=t.optimizer)


def test_the_data_loader_is_not_asked_for_its_state_when_the_state_is_built() -> None:
    """A fresh torchdata StatefulDataLoader's state_dict() changes its next epoch's order: building the state must
    not call it (the save does, when it takes the data position)."""
    t = build(7)
    calls = []
    real = t.loader.state_dict

    def spy() -> dict[str, Any]:
        calls.append(1)
        return real()

    t.loader.state_dict = spy  # type: ignore[method-assign]
    state = training_state(t.states(), model=t.model, optimizer=t.optimizer)
    assert state.loader is t.loader and calls == []


def test_a_name_that_is_no_field_name_is_refused_before_anything_is_saved(tmp_path: Path) -> None:
    t = build(7)
    mgr = CheckpointManager(tmp_path / "run")
    train(t, None, 0, 1)
    with pytest.raises(UsageError, match="'Train-State'"):
        mgr.save(
            1,
            training_state(
                {"Train-State": t.train_state, "dataloader": t.loader},
                model=t.model,
                optimizer=t.optimizer,
                config=CONFIG,
            ),
        )
    mgr.close()
    assert not any((tmp_path / "run").glob("step-*/manifest.json"))


@pytest.mark.slow
def test_an_fsdp2_dcp_state_dict_on_2_ranks_restored_from_memory_after_a_kill_ends_bit_identical(
    tmp_path: Path,
) -> None:
    from process_ranks import launch

    worker = Path(__file__).with_name("dcp_manager_worker.py")
    launch(worker, [str(tmp_path / "reference"), "6"], 2, timeout=180)
    done = launch(worker, [str(tmp_path / "killed"), "6", "4"], 2, timeout=180, check=False)
    assert all(d.returncode == -9 for d in done), [d.stderr[-2000:] for d in done]
    launch(worker, [str(tmp_path / "killed"), "6"], 2, timeout=180)
    reference = json.loads((tmp_path / "reference" / "result.json").read_text())
    resumed = json.loads((tmp_path / "killed" / "result.json").read_text())
    assert reference["restored"] == 0 and resumed["restored"] == 4
    assert resumed["train"] == reference["train"]  # the plain dict back in place: step and every batch seen
    assert resumed["digest"] == reference["digest"]
