"""Incremental durable saves under the trainer's CheckpointManager: a LoRA-style run (a frozen base model and
small trained adapters) saved every step costs about one full checkpoint plus the adapter and optimizer deltas,
resumes bit for bit, and a damaged base makes restore_latest fall back to a checkpoint that does not use it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfmt
from ckptfmt.torch import CheckpointManager, ResumableSampler

WIDTH, LAYERS, RANK = 256, 4, 4


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, WIDTH) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(WIDTH, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T  # type: ignore[no-any-return]


def lora_state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, ResumableSampler]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[LoRALinear() for _ in range(LAYERS)])
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-2), ResumableSampler(1000, seed=0)  # one data order


def frozen_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def step(model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ResumableSampler, n: int) -> None:
    for _ in range(n):
        index = next(iter(sampler))
        sampler.advance(1)
        gen = torch.Generator().manual_seed(int(index))
        x = torch.randn(4, WIDTH, generator=gen)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("mode", ["frozen", "hashed-async"])
def test_lora_run_saved_every_step_costs_one_full_checkpoint_plus_deltas(tmp_path: Path, mode: str) -> None:
    model, optimizer, sampler = lora_state()
    run = tmp_path / "run"
    manager = CheckpointManager(
        run,
        keep_last=None,
        incremental=True,
        full_every=100,
        frozen=frozen_names(model) if mode == "frozen" else (),
        async_save=mode == "hashed-async",
    )
    for s in range(1, 21):
        step(model, optimizer, sampler, 1)
        manager.save(s, model=model, optimizer=optimizer, config={"lr": 1e-2}, sampler=sampler)
    manager.wait()
    manager.close()

    full = dir_bytes(run / "step-000000001")
    trained = [p for p in model.parameters() if p.requires_grad]
    # what changes every step: the adapters and Adam's two moments of them, plus ~28 KB of manifest (12 KB),
    # RNG state (11 KB: torch's Mersenne Twister), other contexts and safetensors headers
    delta_bound = 3 * nbytes(trained) + 32 * 1024
    deltas = [dir_bytes(run / f"step-{s:09d}") for s in range(2, 21)]
    assert max(deltas) < delta_bound, (deltas, delta_bound)
    total = dir_bytes(run)  # (latest.json included)
    assert total < full + 20 * delta_bound
    assert total < 0.2 * 20 * full  # against twenty full checkpoints
    with ckptfmt.open(run / "step-000000020") as ckpt:
        assert [b.location for b in ckpt.manifest.bases] == ["../step-000000001"]
        assert ckpt.verify().ok

    # resume in a fresh process's objects: bit for bit, and the same trajectory afterwards
    model2, optimizer2, sampler2 = lora_state(seed=7)
    restored = CheckpointManager(run, keep_last=None, incremental=True).restore_latest(
        model=model2, optimizer=optimizer2, sampler=sampler2, config={"lr": 1e-2}
    )
    assert restored == 20
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    step(model, optimizer, sampler, 3)
    step(model2, optimizer2, sampler2, 3)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_full_every_bounds_chains_and_a_damaged_base_falls_back(tmp_path: Path) -> None:
    model, optimizer, sampler = lora_state()
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=None, incremental=True, full_every=5)
    for s in range(1, 11):
        step(model, optimizer, sampler, 1)
        manager.save(s, model=model, optimizer=optimizer, config={}, sampler=sampler)
    manager.close()
    bases = {}
    for s in range(1, 11):
        with ckptfmt.open(run / f"step-{s:09d}") as ckpt:
            bases[s] = [b.name for b in ckpt.manifest.bases]
    assert bases[1] == bases[6] == []  # full saves: the first, then every fifth
    assert all(bases[s] == ["step-000000001"] for s in range(2, 6))
    assert all(bases[s] == ["step-000000006"] for s in range(7, 11))

    # a flipped byte in a frozen weight of step 6: steps 6 to 10 all read it, step 5 does not
    with ckptfmt.open(run / "step-000000006") as ckpt:
        chunk = ckpt.tensor("weights", "0.base.weight").chunks[0]
    path = run / "step-000000006" / chunk.path
    data = bytearray(path.read_bytes())
    data[chunk.begin + 8] ^= 0x10
    path.write_bytes(bytes(data))
    report = ckptfmt.verify(run / "step-000000009")
    assert not report.ok and {p.path for p in report.problems} == {f"../step-000000006/{chunk.path}"}

    fresh = lora_state(seed=3)
    restored = CheckpointManager(run, keep_last=None, incremental=True).restore_latest(
        model=fresh[0], optimizer=fresh[1], sampler=fresh[2]
    )
    assert restored == 5

    # the base deleted outright: its referrers are refused, naming it, and the restore falls back the same way
    shutil.rmtree(run / "step-000000006")
    report = ckptfmt.verify(run / "step-000000010")
    assert [p.code for p in report.problems] == ["base_checkpoint"]
    assert "step-000000006" in report.problems[0].message and "step-000000010" in report.problems[0].message
    # step 5 was the fourth save since a full one: with full_every=5 the next is full; with 6 it references
    # the checkpoint the run resumed from (its bytes where they are stored: step 1)
    for s, full_every, expected in ((6, 6, ["step-000000001"]), (7, 5, [])):
        manager = CheckpointManager(run, keep_last=None, incremental=True, full_every=full_every)
        fresh = lora_state(seed=s)
        assert manager.restore_latest(model=fresh[0], optimizer=fresh[1], sampler=fresh[2]) == 5
        step(fresh[0], fresh[1], fresh[2], 1)
        manager.save(s, model=fresh[0], optimizer=fresh[1], config={}, sampler=fresh[2])
        manager.close()
        with ckptfmt.open(run / f"step-{s:09d}") as ckpt:
            assert [b.name for b in ckpt.manifest.bases] == expected
            assert ckpt.verify().ok
        shutil.rmtree(run / f"step-{s:09d}")


def test_a_referenced_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    from ckptfmt.errors import ReferencedCheckpointError
    from ckptfmt.torch import save

    model, optimizer, sampler = lora_state()
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=None, incremental=True)
    for s in (1, 2):
        step(model, optimizer, sampler, 1)
        manager.save(s, model=model, optimizer=optimizer, config={}, sampler=sampler)
    manager.close()
    before = (run / "step-000000001" / "manifest.json").read_bytes()
    resumed = CheckpointManager(run, keep_last=None, incremental=True)
    with pytest.raises(ReferencedCheckpointError, match="step-000000002"):  # step 2 references step 1
        resumed.save(1, model=model, optimizer=optimizer, config={}, sampler=sampler)
    resumed.close()
    with pytest.raises(ReferencedCheckpointError):
        save(
            run / "step-000000001", step=1, model=model, optimizer=optimizer, config={}, sampler=sampler, overwrite=True
        )
    assert (run / "step-000000001" / "manifest.json").read_bytes() == before
    assert ckptfmt.verify(run / "step-000000002").ok
