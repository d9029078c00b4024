"""codec= through the PyTorch integration: ckptfmt.torch.save and CheckpointManager compress and restore."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt.torch import CheckpointManager, ResumableSampler, api  # noqa: E402


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def test_save_with_zstd_round_trips(tmp_path: Path) -> None:
    model, opt = _trained()
    url = str(tmp_path / "c")
    api.save(url, step=1, model=model, optimizer=opt, sampler=ResumableSampler(4), config={}, codec="zstd")
    ckpt = ckptfmt.open(url)
    assert ckpt.format_version == "1.3"  # tree digests (the default), zstd chunks
    assert ckpt.fields["weights"].tensors["weight"].chunks[0].codec.name == "zstd"
    assert ckpt.verify().ok
    fresh = torch.nn.Linear(64, 64)
    api.load(url, model=fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_manager_with_codec(tmp_path: Path) -> None:
    model, opt = _trained()
    with CheckpointManager(str(tmp_path / "run"), codec="zstd", exit_on_preemption=False) as manager:
        manager.save(step=1, model=model, optimizer=opt, config={}, sampler=ResumableSampler(4))
    [name] = [p.name for p in (tmp_path / "run").iterdir() if p.is_dir()]
    ckpt = ckptfmt.open(str(tmp_path / "run" / name))
    assert ckpt.fields["weights"].tensors["weight"].chunks[0].codec.name == "zstd"
