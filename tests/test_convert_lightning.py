"""Lightning .ckpt <-> ckptfmt: a real checkpoint from Lightning's own CheckpointIO, imported, exported back
losslessly, and resumed from."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptfmt
from ckptfmt.convert import convert, detect_format
from ckptfmt.convert.lightning import decode, encode, join_checkpoint, split_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.01, sizes: tuple[int, int] = (4, 8)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(*sizes), torch.nn.Dropout(0.3), torch.nn.Linear(sizes[1], 1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.seen += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["extra"] = {"tuple": (1, 2.5), 3: "int key", "t": torch.arange(3)}


def fit(root: Path, epochs: int, ckpt: Path | None = None) -> Net:
    pl.seed_everything(0, verbose=False)
    model = Net()
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)), 4)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1)],
    )
    trainer.fit(model, loader, ckpt_path=str(ckpt) if ckpt else None)
    return model


@pytest.fixture(scope="module")
def ckpt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pl")
    fit(root, 2)
    return root / "epoch=1-step=8.ckpt"


def test_import(ckpt_file: Path, tmp_path: Path) -> None:
    assert detect_format(str(ckpt_file)) == "lightning"
    out = str(tmp_path / "ours")
    result = run_cli("convert", str(ckpt_file), out, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    notes = " ".join(result.json()["notes"])
    assert "lacks" in notes and "rng" in notes and "topology" in notes and "sample offset" in notes
    original = torch.load(ckpt_file, weights_only=True)
    with ckptfmt.open(out) as ckpt:
        assert ckpt.profile == "training"
        for name, tensor in original["state_dict"].items():
            assert np.array_equal(ckpt.read_tensor("weights", name), tensor.numpy())
        momentum = original["optimizer_states"][0]["state"][0]["momentum_buffer"]
        assert np.array_equal(ckpt.read_tensor("optimizer", "state.0.momentum_buffer"), momentum.numpy())
        assert ckpt.read_context("config")["config"] == {"hyper_parameters": {"lr": 0.01, "sizes": [4, 8]}}
        data = ckpt.read_context("data")
        assert data["epoch"] == 1 and data["lightning"]["global_step"] == 8
        assert data["sample_offset_known"] is False
        sources = ckpt.read_context("provenance")["converted_from"]["fields"]
        assert sources["weights"] == {"file": ckpt_file.name, "key": "state_dict"}
        assert sources["optimizer"]["key"] == "optimizer_states"
        assert ckpt.read_context("provenance")["step"] == 8
    assert run_cli("verify", out).exit_code == 0
    assert "optimizer_states" in run_cli("inspect", out).stdout  # where the optimizer field came from


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        # key order is not kept: ckptfmt stores tensor names and map keys sorted
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(type(a) is type(b) and a == b)


def test_export_gives_back_the_same_dict_and_lightning_resumes_from_it(ckpt_file: Path, tmp_path: Path) -> None:
    ours, back = str(tmp_path / "ours"), tmp_path / "back.ckpt"
    convert(str(ckpt_file), ours, to="ckptfmt")
    result = run_cli("convert", ours, str(back), "--to", "lightning")
    assert result.exit_code == 0, result.stderr
    original = torch.load(ckpt_file, weights_only=True)
    again = torch.load(back, weights_only=True)
    assert _same(dict(original["state_dict"]), again["state_dict"])
    original["state_dict"] = again["state_dict"]
    assert _same(original, again)
    from_original = fit(tmp_path / "a", 4, ckpt=ckpt_file)
    from_export = fit(tmp_path / "b", 4, ckpt=back)
    for name, tensor in from_original.state_dict().items():
        assert torch.equal(tensor, from_export.state_dict()[name]), name


def test_several_optimizers_and_tagged_values_round_trip() -> None:
    model = torch.nn.Linear(2, 2)
    a, b = torch.optim.Adam([model.weight]), torch.optim.SGD([model.bias], lr=0.1, momentum=0.5)
    model(torch.ones(1, 2)).sum().backward()
    a.step()
    b.step()
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [a.state_dict(), b.state_dict()],
        "loops": {"$weird": 1, (1, 2): [np.arange(3), None], "deep": {"t": torch.ones(2, dtype=torch.bfloat16)}},
        "epoch": 0,
    }
    fields = split_checkpoint(checkpoint, "mem")
    assert set(fields.optimizer) == {
        "0/state.0.exp_avg",
        "0/state.0.exp_avg_sq",
        "0/state.0.step",
        "1/state.0.momentum_buffer",  # each optimizer numbers its own parameters
    }
    numpy_tensors = {k: v for k, v in fields.extra_tensors.items()}
    back = join_checkpoint(
        fields.weights, fields.optimizer, fields.optimizer_context, fields.contexts["lightning"], numpy_tensors
    )
    assert _same(back["optimizer_states"], checkpoint["optimizer_states"])
    loops = back["loops"]
    assert loops["$weird"] == 1 and np.array_equal(loops[(1, 2)][0], np.arange(3)) and loops[(1, 2)][1] is None
    assert torch.equal(loops["deep"]["t"], checkpoint["loops"]["deep"]["t"])  # type: ignore[index]
    tensors: dict[str, Any] = {}
    assert decode(encode((1, [2, (3,)]), tensors, "x"), tensors) == (1, [2, (3,)])


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_hostile_ckpt_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    with path.open("wb") as f:
        torch.save({"state_dict": {}, "hyper_parameters": _Payload()}, f)
    result = run_cli("convert", str(path), str(tmp_path / "ours"), "--to", "ckptfmt")
    assert result.exit_code == 1
    assert "evil.ckpt" in result.stderr and "invalid_source" in result.stderr
    raw = tmp_path / "raw.ckpt"
    raw.write_bytes(pickle.dumps({"state_dict": {}}))  # a plain pickle, not a torch zip file
    with pytest.raises(ckptfmt.SourceFormatError) as info:
        convert(str(raw), str(tmp_path / "ours2"), to="ckptfmt")
    assert info.value.path == str(raw)


def test_not_a_lightning_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"weights": torch.ones(2)}, path)
    with pytest.raises(ckptfmt.SourceFormatError, match="state_dict") as info:
        convert(str(path), str(tmp_path / "ours"), to="ckptfmt")
    assert info.value.path == str(path)
