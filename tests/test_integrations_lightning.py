"""CkptfmtCheckpointIO end to end on CPU: train a tiny LightningModule (dropout, shuffled data, an LR
scheduler), kill it, resume with ``fit(ckpt_path=...)`` from the ckptfmt checkpoint, compare with the
uninterrupted run; mid-epoch with a ResumableDataLoader as Lightning's stateful loader; every rank's RNG on
two DDP ranks (gloo on loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from process_ranks import launch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptfmt
from ckptfmt.integrations.lightning import CkptfmtCheckpointIO
from ckptfmt.torch import ResumableDataLoader

EPOCHS = 4


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}


class Killed(Exception):
    pass


class KillAtStep(Callback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if trainer.global_step == self.step:
            raise Killed(f"killed before step {self.step + 1}")


class KillAtEpoch(Callback):  # type: ignore[misc]
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == self.epoch:
            raise Killed(f"killed at the start of epoch {self.epoch}")


def data() -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    return DataLoader(dataset, batch_size=8, shuffle=True)


def fit(root: Path, *, kill: int | None = None, ckpt: Path | None = None, seed: int = 0, **io: Any) -> Net:
    pl.seed_everything(seed, verbose=False)
    model = Net()
    callbacks: list[Any] = [ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1)]
    if kill is not None:
        callbacks.append(KillAtEpoch(kill))
    run(model, data(), callbacks, EPOCHS, ckpt, **io)
    return model


def run(model: Net, loader: Any, callbacks: list[Any], epochs: int, ckpt: Path | None, **io: Any) -> None:
    """``fit`` on the CPU, quietly, through the ckptfmt plugin; a :class:`Killed` run just ends."""
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[CkptfmtCheckpointIO(**io)],
        callbacks=callbacks,
    )
    try:
        trainer.fit(model, loader, ckpt_path=str(ckpt) if ckpt else None)
    except Killed:
        pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Net, Path]:
    """(root of the uninterrupted run, its final model, root of a run killed at the start of epoch 2)."""
    tmp = tmp_path_factory.mktemp("lightning")
    full = fit(tmp / "full")
    fit(tmp / "killed", kill=2)
    return tmp / "full", full, tmp / "killed"


def test_saves_are_ckptfmt_checkpoints(runs: tuple[Path, Net, Path]) -> None:
    _, _, killed = runs
    assert sorted(os.listdir(killed)) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    with ckptfmt.open(killed / "epoch=1-step=8.ckpt") as ckpt:
        assert ckpt.profile == "training"
        assert ckpt.verify().ok
        assert set(ckpt.tensor_names("weights")) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
        assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(ckpt.tensor_names("optimizer"))
        assert "torch" in ckpt.read_context("rng")["generators"]
        assert ckpt.read_context("data")["epoch"] == 1
        assert ckpt.read_context("data")["lightning"]["global_step"] == 8
        assert ckpt.read_context("config")["config"] == {"hyper_parameters": {"lr": 0.01}}
        assert ckpt.read_context("provenance")["step"] == 8
        assert ckpt.read_context("topology")["world_size"] == 1


def test_kill_and_resume_is_bit_identical(runs: tuple[Path, Net, Path], tmp_path: Path) -> None:
    _, full, killed = runs
    resumed = fit(tmp_path / "resumed", ckpt=killed / "epoch=1-step=8.ckpt", seed=123)
    for (name, mine), theirs in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def test_resume_without_the_rng_diverges(runs: tuple[Path, Net, Path], tmp_path: Path) -> None:
    """Negative control: Lightning's own checkpoint has no RNG state; without ckptfmt's the run differs
    (the next epoch's shuffle and dropout masks come from another generator state)."""
    _, full, killed = runs
    resumed = fit(tmp_path / "resumed", ckpt=killed / "epoch=1-step=8.ckpt", seed=123, restore_rng=False)
    pairs = zip(resumed.state_dict().values(), full.state_dict().values(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)


def test_a_corrupt_checkpoint_fails_before_the_model_is_touched(runs: tuple[Path, Net, Path], tmp_path: Path) -> None:
    _, _, killed = runs
    import shutil

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(killed / "epoch=1-step=8.ckpt", broken)
    data_file = next((broken / "weights").glob("*.safetensors"))
    raw = bytearray(data_file.read_bytes())
    raw[-1] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ckptfmt.DigestMismatchError):
        CkptfmtCheckpointIO().load_checkpoint(broken)


def test_remove_checkpoint(tmp_path: Path, runs: tuple[Path, Net, Path]) -> None:
    import shutil

    _, _, killed = runs
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(killed / "epoch=0-step=4.ckpt", copy)
    CkptfmtCheckpointIO().remove_checkpoint(copy)
    assert not copy.exists()


def test_a_plugin_checkpoint_exports_to_a_plain_ckpt(runs: tuple[Path, Net, Path], tmp_path: Path) -> None:
    """Leaving ckptfmt is one command: the directory the plugin wrote becomes the .ckpt Lightning writes."""
    from ckptfmt.convert import convert, detect_format

    _, _, killed = runs
    source = killed / "epoch=1-step=8.ckpt"
    assert detect_format(str(source)) == "ckptfmt"
    convert(str(source), str(tmp_path / "plain.ckpt"), to="lightning")
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert plain["global_step"] == 8 and plain["epoch"] == 1
    with ckptfmt.open(source) as ckpt:
        for name, tensor in plain["state_dict"].items():
            assert torch.equal(tensor, torch.from_numpy(ckpt.read_tensor("weights", name)))
    assert plain["lr_schedulers"][0]["step_size"] == 2
    assert "fit_loop" in plain["loops"]


# ---------------------------------------------------------------- mid-epoch, through Lightning's stateful loader


class Seen(Net):
    """Records the sample indices of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.append(ids.tolist())
        return super().training_step((x, y), index)


def resumable() -> ResumableDataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    n = 24  # 6 whole batches an epoch: the iterator is never asked for the StopIteration after the last
    dataset = TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen), torch.arange(n))
    return ResumableDataLoader(dataset, batch_size=4, seed=7)


def fit_resumable(root: Path, *, kill: int | None = None, ckpt: Path | None = None, seed: int = 0) -> Seen:
    pl.seed_everything(seed, verbose=False)
    model = Seen()
    callbacks: list[Any] = [ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1)]
    if kill is not None:
        callbacks.append(KillAtStep(kill))
    run(model, resumable(), callbacks, 2, ckpt)
    return model


@pytest.fixture(scope="module")
def resumable_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Seen, Seen, Path]:
    """(the uninterrupted run, a run killed after step 10 of 12, the root of the killed run's checkpoints)."""
    tmp = tmp_path_factory.mktemp("resumable")
    full = fit_resumable(tmp / "full")
    killed = fit_resumable(tmp / "killed", kill=10)
    return full, killed, tmp / "killed"


def test_a_resumable_loader_serves_every_epoch_under_lightning(resumable_runs: tuple[Seen, Seen, Path]) -> None:
    """Lightning never asks for the StopIteration that ends an epoch (it knows its length): the next
    epoch's iterator must not be taken for a rival loop."""
    full, _, _ = resumable_runs
    assert len(full.seen) == 12
    for epoch in (full.seen[:6], full.seen[6:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(24))
    assert full.seen[:6] != full.seen[6:]


@pytest.mark.parametrize("step", [4, 8])
def test_mid_epoch_resume_continues_with_the_next_unseen_batch(
    resumable_runs: tuple[Seen, Seen, Path], tmp_path: Path, step: int
) -> None:
    """Killed after step 10, resumed from the save at step 4 (epoch 0) or 8 (epoch 1, batch 2 of 6): the
    batches trained on before the save and after the resume are the uninterrupted run's, none twice, none
    skipped, and the final weights are bit-identical."""
    full, killed, root = resumable_runs
    assert len(killed.seen) == 10
    name = f"epoch={step // 6}-step={step}.ckpt"
    with ckptfmt.open(root / name) as ckpt:  # the loader's position is in Lightning's loop state
        loops = ckpt.read_context("lightning")["checkpoint"]["loops"]
        (state,) = loops["fit_loop"]["state_dict"]["combined_loader"]
        assert (state["epoch"], state["global_sample_offset"]) == (step // 6, (step % 6) * 4)
        data = ckpt.read_context("data")  # and in the data field, as ckptfmt.torch saves it
        assert (data["epoch"], data["global_sample_offset"]) == (step // 6, (step % 6) * 4)
        assert "sample_offset_known" not in data and data["sampler"] == state["sampler"]
    resumed = fit_resumable(tmp_path, ckpt=root / name, seed=123)
    assert killed.seen[:step] + resumed.seen == full.seen
    for (name, mine), theirs in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


# ---------------------------------------------------------------- every rank's generators (DDP, two processes)


def test_every_rank_resumes_with_its_own_generators(tmp_path: Path) -> None:
    """Two DDP processes whose generators part ways: the checkpoint holds both ranks' (gathered by the plugin's
    callback), each rank restores its own, and a mid-epoch resume ends bit-identical on both; the same resume
    with rank 0's generators on every rank (what writing rank 0's alone amounts to) does not."""
    launch(Path(__file__).with_name("lightning_ddp_worker.py"), [str(tmp_path)], 2)
    with ckptfmt.open(tmp_path / "killed" / "epoch=1-step=6.ckpt") as ckpt:
        field = ckpt.read_context("rng")
        assert ckpt.read_context("topology")["world_size"] == 2
    first, second = (r["generators"] for r in field["ranks"])
    assert set(first) == set(second) >= {"torch", "python", "numpy"}
    assert not np.array_equal(first["torch"]["state"], second["torch"]["state"])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(result["full"]) == 8
        assert result["killed"][:6] + result["resumed"] == result["full"], rank
        assert result["resumed_identical"], rank
        assert not result["rank0_rng_identical"], rank  # negative control


def checkpoint_dict(**extra: Any) -> dict[str, Any]:
    return {"state_dict": {"w": torch.zeros(2)}, "epoch": 0, "global_step": 1, **extra}


def test_a_multi_rank_save_without_the_callback_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ckptfmt.errors import UsageError

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    io = CkptfmtCheckpointIO()
    with pytest.raises(UsageError, match=r"callbacks=\[io.rng_callback"):
        io.save_checkpoint(checkpoint_dict(optimizer_states=[]), tmp_path / "full.ckpt")
    assert not (tmp_path / "full.ckpt").exists()
    io.save_checkpoint(checkpoint_dict(), tmp_path / "weights.ckpt")  # weights only: no callback ran, none to write
    with ckptfmt.open(tmp_path / "weights.ckpt") as ckpt:
        assert ckpt.read_context("rng") == {"generators": {}}
