"""Async saves copy parameters and optimizer state off the trainer's thread; the next step must wait."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.torch import CheckpointManager, ResumableSampler
from ckptfmt.torch import state as torch_state


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, ResumableSampler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, ResumableSampler(64, seed=1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def weights(model: torch.nn.Module) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_the_next_step_waits_for_the_copy_and_the_checkpoint_holds_the_saved_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, sampler = setup()
    train_step(model, opt)
    slow_copy = torch_state.HostBuffers.copy
    stepping = threading.Event()
    opt.register_step_pre_hook(lambda *_: stepping.set())  # before the manager's: runs first

    def copy(self: torch_state.HostBuffers, key: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        if threading.current_thread() is not threading.main_thread():
            # a background copy starts only once the next step has begun: without the manager's step pre-hook,
            # that step would race it (and the checkpoint hold the updated state)
            assert stepping.wait(60), "hang guard: the next step never began"
        return slow_copy(self, key, tensor)

    monkeypatch.setattr(torch_state.HostBuffers, "copy", copy)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, preemption_signals=())
    expected = weights(model)
    mgr.save(1, model=model, optimizer=opt, sampler=sampler, config={"lr": 0.1})
    train_step(model, opt)  # changes every parameter and the batch-norm statistics
    mgr.wait()
    assert mgr.held_seconds > 0  # the step really waited (it began before any background copy)
    with ckptfmt.open(tmp_path / "run" / "step-000000001") as ckpt:
        for name, array in expected.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), array), name
    assert not np.array_equal(weights(model)["0.weight"], expected["0.weight"])
    mgr.close()


def test_the_hook_is_removed_once_the_save_is_done(tmp_path: Path) -> None:
    model, opt, sampler = setup()
    train_step(model, opt)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, preemption_signals=())
    mgr.save(1, model=model, optimizer=opt, sampler=sampler, config={})
    assert len(opt._optimizer_step_pre_hooks) == 1
    mgr.wait()
    assert len(opt._optimizer_step_pre_hooks) == 0
    mgr.close()
