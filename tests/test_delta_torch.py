"""Delta chunks through the checkpoint manager (spec/delta.md; issue 44): ``incremental=True, codec="xor-zstd"``
stores each save's changed floating tensors as their XOR with the previous save's, each full save in zstd, and a
restore gives back the state bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ckptfmt
from ckptfmt.errors import UsageError
from ckptfmt.torch import CheckpointManager, ResumableSampler


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()


def _state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_the_manager_saves_deltas_between_full_saves_and_restores_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer = _state(0)
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=2, incremental=True, full_every=3, codec="xor-zstd")
    for s in range(1, 6):
        _train(model, optimizer, s)
        manager.save(s, model=model, optimizer=optimizer, sampler=ResumableSampler(100, seed=0), config={"lr": 1e-4})
    manager.wait()
    manager.close()
    codecs = {}
    for s in (4, 5):
        with ckptfmt.open(run / f"step-{s:09d}") as ckpt:
            record = ckpt.tensor("weights", "0.weight")
            codecs[s] = record.chunks[0].codec.name
            assert ckpt.verify().ok
    assert codecs == {4: "zstd", 5: "xor-zstd"}  # step 4 starts a new chain (full_every=3): its keyframe
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-000000004",
        "step-000000005",
    ]  # keep_last=2: step 5 needs only step 4
    model2, optimizer2 = _state(7)
    restored = CheckpointManager(run, keep_last=None, incremental=True).restore_latest(
        model=model2, optimizer=optimizer2, sampler=ResumableSampler(100, seed=0), config={"lr": 1e-4}
    )
    assert restored == 5
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_xor_zstd_without_incremental_is_refused_where_it_is_given(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="incremental=True"):
        CheckpointManager(tmp_path / "run", codec="xor-zstd")
