"""ckptfmt.integrations.accelerate end to end on CPU: a tiny Accelerate loop (dropout, shuffled data,
an LR scheduler) saves through ckptfmt, is killed, resumes from the ckptfmt checkpoint alone and ends
bit-identical to the uninterrupted run; two processes with local disks of their own save and load alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from process_ranks import launch
from torch.utils.data import DataLoader, TensorDataset

import ckptfmt
from ckptfmt.integrations.accelerate import load_state, save_state

EPOCHS, SAVE_AFTER = 4, 2


class Killed(Exception):
    pass


def setup(seed: int = 0) -> tuple[Any, Any, Any, Any, Any]:
    set_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3)
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(
        TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)), batch_size=8, shuffle=True
    )
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def train(
    url: Path,
    *,
    first_epoch: int = 0,
    kill_after_save: bool = False,
    seed: int = 0,
    resume: bool = False,
    scramble_rng: bool = False,
) -> torch.nn.Module:
    accelerator, model, optimizer, loader, scheduler = setup(seed)
    if resume:
        data = load_state(accelerator, url)
        if scramble_rng:
            torch.manual_seed(1234)
        first_epoch = int(data["epoch"])
        assert data["step"] == first_epoch * len(loader)
    for epoch in range(first_epoch, EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if epoch + 1 == SAVE_AFTER and not resume:
            save_state(
                accelerator,
                url,
                step=(epoch + 1) * len(loader),
                data={"epoch": epoch + 1, "global_sample_offset": (epoch + 1) * 32},
                config={"lr": 0.01, "epochs": EPOCHS},
            )
            if kill_after_save:
                raise Killed
    return accelerator.unwrap_model(model)


def test_kill_and_resume_is_bit_identical(tmp_path: Path) -> None:
    full = train(tmp_path / "full")
    with pytest.raises(Killed):
        train(tmp_path / "ckpt", kill_after_save=True)
    with ckptfmt.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.profile == "training" and ckpt.verify().ok
        assert ckpt.read_context("data")["epoch"] == SAVE_AFTER
        assert ckpt.read_context("config")["config"] == {"lr": 0.01, "epochs": EPOCHS}
        assert ckpt.read_context("provenance")["step"] == SAVE_AFTER * 4
        assert ckpt.read_context("provenance")["converted_from"]["missing"] == {}
        assert "torch" in ckpt.read_context("rng")["generators"]
        assert ckpt.read_context("scheduler")["state"]["last_epoch"] == SAVE_AFTER * 4
    resumed = train(tmp_path / "ckpt", seed=99, resume=True)
    for (name, mine), theirs in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
    # negative control: the same resume with torch's generator moved on (shuffle, dropout) diverges
    scrambled = train(tmp_path / "ckpt", seed=99, resume=True, scramble_rng=True)
    pairs = zip(scrambled.state_dict().values(), full.state_dict().values(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)


def test_accelerate_directory_round_trip(tmp_path: Path) -> None:
    """A plain Accelerate save_state directory: imported (saying what it lacks), exported, loaded by Accelerate."""
    accelerator, model, optimizer, loader, scheduler = setup()
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
    accelerator.save_state(str(tmp_path / "native"))
    from ckptfmt.convert import convert, detect_format

    assert detect_format(str(tmp_path / "native")) == "accelerate"
    result = convert(str(tmp_path / "native"), str(tmp_path / "ours"), to="ckptfmt")
    assert any("lacks data" in n and "config" in n for n in result.notes)
    convert(str(tmp_path / "ours"), str(tmp_path / "back"), to="accelerate")
    expected = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    expected_opt = optimizer.state_dict()
    other, model2, optimizer2, _, scheduler2 = setup(seed=5)
    other.load_state(str(tmp_path / "back"))
    for name, tensor in other.unwrap_model(model2).state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    for pid, entries in expected_opt["state"].items():
        for key, value in entries.items():
            assert torch.equal(optimizer2.state_dict()["state"][pid][key], value)
    assert scheduler2.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]


def test_processes_with_their_own_local_disks_save_and_load(tmp_path: Path) -> None:
    """Two processes, each with a TMPDIR no other may touch (as on two nodes; see accelerate_worker.py): the
    checkpoint holds both processes' generators, and each gets its own back and ends bit-identical."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    env = [{"TMPDIR": str(disk), "CKPTFMT_TEST_FOREIGN": str(disks[1 - r])} for r, disk in enumerate(disks)]
    launch(Path(__file__).with_name("accelerate_worker.py"), [str(tmp_path / "ckpt")], 2, env=env)
    with ckptfmt.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.verify().ok
        generators = ckpt.read_context("rng")["generators"]
        assert ckpt.read_context("topology")["world_size"] == 2
    assert {"rank0/torch", "rank1/torch"} <= set(generators), sorted(generators)
    assert not np.array_equal(generators["rank0/torch"]["state"], generators["rank1/torch"]["state"])
    assert [list(disk.glob("ckptfmt-*")) for disk in disks] == [[], []]  # the staging directories are gone


def test_a_save_the_main_process_cannot_commit_fails_on_every_process_at_once(tmp_path: Path) -> None:
    """The main process's import fails (the URL is below a regular file): it raises, and the other process raises
    CollectiveError naming the main's error, instead of waiting in the last barrier until the job's timeout."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    (tmp_path / "a-file").write_bytes(b"not a directory")
    env = [{"TMPDIR": str(disk), "CKPTFMT_TEST_FOREIGN": str(disks[1 - r])} for r, disk in enumerate(disks)]
    url = str(tmp_path / "a-file" / "ckpt")
    results = launch(
        Path(__file__).with_name("accelerate_worker.py"), [url, "--main-cannot-write"], 2, env=env, timeout=90
    )
    main, other = (r.stdout for r in results)
    assert "process 0 refused" in main and "process 1 refused: CollectiveError" in other, (main, other)
    assert "did not save the checkpoint" in other and main.split("refused: ")[1].split(":")[0] in other


def test_a_given_staging_directory_holds_one_directory_per_process(tmp_path: Path) -> None:
    accelerator = setup()[0]
    save_state(accelerator, tmp_path / "ckpt", step=0, data={"epoch": 0, "global_sample_offset": 0}, staging=tmp_path)
    assert (tmp_path / "process-0" / "random_states_0.pkl").is_file()  # left for the caller
    assert load_state(accelerator, tmp_path / "ckpt", staging=tmp_path / "load")["step"] == 0
    assert (tmp_path / "load" / "process-0" / "model.safetensors").is_file()
