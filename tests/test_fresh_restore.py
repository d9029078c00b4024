"""A restore at start-up reads each byte once (``restore_latest(fresh=True)``, issue 44): the live tensors hold
nothing of value, so a checkpoint is read, hashed and placed in them in one pass, never checked first. A checkpoint
refused after it was partly placed is passed over and the next one overwrites every tensor (no tensor ends up from
two checkpoints); when none is left, the restore raises instead of handing back a model that is neither fresh nor
restored. The default (a live state) still changes nothing unless all of the checkpoint is good."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptfmt.errors import RestoreError
from ckptfmt.reader import Checkpoint
from ckptfmt.run import checkpoint_name
from ckptfmt.torch import CheckpointManager, ResumableSampler


def _built(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip_last_tensor(url: Path) -> None:
    """One byte inside the last tensor of the weights file: the ones before it are placed before it is refused."""
    path = next((url / "weights").glob("*.safetensors"))
    with open(path, "r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run directory with checkpoints of steps 2 and 4, and the weights each holds."""
    model, opt = _built(0)
    sampler = ResumableSampler(32, seed=0)
    weights = {}
    with CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in range(1, 5):
            _step(model, opt)
            if step % 2 == 0:
                mgr.save(step, model=model, optimizer=opt, sampler=sampler, config={})
                weights[step] = _weights(model)
    return tmp_path / "run", weights


def _no_check_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Checkpoint, *args: object, **kwargs: object) -> None:
        raise AssertionError("a fresh restore checked before placing: a second pass")

    monkeypatch.setattr(Checkpoint, "check_regions", refuse)


def test_a_fresh_restore_places_each_byte_once_and_passes_over_a_damaged_checkpoint_whole(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, weights = run
    _flip_last_tensor(url / checkpoint_name(4))
    _no_check_pass(monkeypatch)
    model, opt = _built(7)
    mgr = CheckpointManager(url)
    assert mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), fresh=True) == 2
    assert _same(_weights(model), weights[2])  # every tensor step 2's: none left from the refused step 4
    assert mgr.last_restore is not None and any(checkpoint_name(4) in s for s in mgr.last_restore.skipped)
    mgr.close()


def test_a_fresh_restore_of_a_good_checkpoint_is_the_checkpoint(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, weights = run
    _no_check_pass(monkeypatch)
    model, opt = _built(7)
    mgr = CheckpointManager(url)
    assert mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), fresh=True) == 4
    assert _same(_weights(model), weights[4])
    mgr.close()


def test_when_no_checkpoint_is_left_a_fresh_restore_raises_and_a_live_one_leaves_the_model_as_it_was(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
) -> None:
    url, _ = run
    for step in (2, 4):
        _flip_last_tensor(url / checkpoint_name(step))
    model, opt = _built(7)
    initial = copy.deepcopy(_weights(model))
    mgr = CheckpointManager(url)
    assert mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0)) is None
    assert _same(_weights(model), initial)  # two passes: refused before any live tensor changed
    with pytest.raises(RestoreError, match="fresh=True"):
        mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), fresh=True)
    assert not _same(_weights(model), initial)  # what the raise is for: the model holds part of a refused one
    mgr.close()


def test_load_fresh_places_in_one_pass_and_a_damaged_checkpoint_still_raises(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfmt.errors import DigestMismatchError
    from ckptfmt.torch import load

    url, weights = run
    _no_check_pass(monkeypatch)
    model, opt = _built(7)
    kwargs = {"model": model, "optimizer": opt, "sampler": ResumableSampler(32, seed=0), "config": {}, "fresh": True}
    assert load(url / checkpoint_name(4), **kwargs).step == 4
    assert _same(_weights(model), weights[4])
    _flip_last_tensor(url / checkpoint_name(2))
    with pytest.raises(DigestMismatchError):
        load(url / checkpoint_name(2), **kwargs)


# ---------------------------------------------------------------- two ranks (threads): the vote decides for both


def _two_rank_run(tmp_path: Path) -> tuple[Path, Any, dict[int, dict[str, torch.Tensor]]]:
    from concurrent.futures import ThreadPoolExecutor

    from ckptfmt.collective import ThreadCollective

    run = tmp_path / "run"
    group = ThreadCollective.group(2)
    built = [_built(0) for _ in range(2)]  # here, not in the threads: torch's global RNG is one for all
    torch.manual_seed(1)
    batches = [torch.randn(8, 64) for _ in range(6)]

    def save(rank: int) -> dict[int, dict[str, torch.Tensor]]:
        model, opt = built[rank]
        sampler = ResumableSampler(32, seed=0, rank=rank, world_size=2)
        weights = {}
        with CheckpointManager(run, keep_last=None, collective=group[rank]) as mgr:
            for step in range(1, 7):
                opt.zero_grad()
                model(batches[step - 1]).square().mean().backward()
                opt.step()
                sampler.advance(2)
                if step % 2 == 0:
                    mgr.save(step, model=model, optimizer=opt, sampler=sampler, config={})
                    weights[step] = _weights(model)
        return weights

    with ThreadPoolExecutor(2) as pool:
        saved = list(pool.map(save, range(2)))
    assert _same(saved[0][6], saved[1][6])
    return run, group, saved[0]


def _fresh_restores(run: Path, group: Any) -> list[object]:
    """Each rank's restore_latest(fresh=True) into a model built afresh: its step and weights, or what it raised."""
    from concurrent.futures import ThreadPoolExecutor

    fresh = [_built(9) for _ in range(2)]

    def restore(rank: int) -> object:
        model, opt = fresh[rank]
        mgr = CheckpointManager(run, collective=group[rank])
        try:
            step = mgr.restore_latest(
                model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0, rank=rank, world_size=2), fresh=True
            )
        except RestoreError as exc:
            return exc
        return step, _weights(model)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(restore, range(2)))


def _rank_1_refuses(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Rank 1 places a checkpoint of ``steps`` in its live tensors, then finds a bad byte (rank 0 finds none)."""
    import threading

    from ckptfmt.errors import DigestMismatchError
    from ckptfmt.torch import in_place

    real = in_place.fill_fresh

    def fill(ckpt: Checkpoint, checked: Any) -> None:
        real(ckpt, checked)
        named = {checkpoint_name(s) for s in steps}
        if threading.current_thread().name.endswith("_1") and ckpt.url.rstrip("/").rsplit("/", 1)[-1] in named:
            raise DigestMismatchError("a bad byte this rank alone read", path=ckpt.url)

    monkeypatch.setattr(in_place, "fill_fresh", fill)


def test_on_two_ranks_a_checkpoint_one_rank_refuses_after_both_placed_it_is_overwritten_on_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, group, weights = _two_rank_run(tmp_path)
    _rank_1_refuses(monkeypatch, {6})
    for outcome in _fresh_restores(run, group):
        assert isinstance(outcome, tuple), outcome
        step, restored = outcome
        assert step == 4 and _same(restored, weights[4])  # rank 0 had step 6 in place: all of it overwritten


def test_on_two_ranks_when_one_rank_refuses_every_checkpoint_both_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, group, _ = _two_rank_run(tmp_path)
    _rank_1_refuses(monkeypatch, {2, 4, 6})
    outcomes = _fresh_restores(run, group)
    assert all(isinstance(o, RestoreError) for o in outcomes), outcomes  # rank 0 read each whole, yet raises too
