"""PyTorch .pt/.bin/.pth -> ckptfmt: a real nn.Module and AdamW state, weights_only loading, bit for bit."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, assert_ckpt_tensor, run_cli


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model[2].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    out = model[2](model[1](model[0](torch.randn(4, 8))).to(torch.bfloat16))
    out.float().pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("runner", RUNNERS)
def test_module_and_adamw(tmp_path: Path, runner: str) -> None:
    model, optimizer = trained()
    path = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    out = str(tmp_path / "ours")
    result = RUNNERS[runner]("convert", str(path), out, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["source"]["format"] == "pt"
    with ckptfmt.open(out) as ckpt:
        assert ckpt.profile == "weights"
        assert set(ckpt.fields) == {"weights", "optimizer", "provenance"}
        sd = model.state_dict()
        assert set(ckpt.tensor_names("weights")) == {f"model.{k}" for k in sd}
        for key, tensor in sd.items():
            assert_ckpt_tensor(ckpt, "weights", f"model.{key}", tensor)
        osd = optimizer.state_dict()
        expected = {f"state.{i}.{k}": v for i, s in osd["state"].items() for k, v in s.items()}
        assert set(ckpt.tensor_names("optimizer")) == set(expected)
        for name, tensor in expected.items():
            assert_ckpt_tensor(ckpt, "optimizer", name, tensor)
        groups = ckpt.read_context("optimizer")["param_groups"]
        assert groups[0]["lr"] == 1e-3 and groups[0]["weight_decay"] == 0.1
        assert groups[0]["betas"] == [0.9, 0.999] and groups[0]["params"] == osd["param_groups"][0]["params"]
        assert ckpt.read_context("weights") == {"epoch": 3}
        provenance = ckpt.read_context("provenance")
        assert provenance["converted_from"]["optimizer_keys"] == ["optimizer"]
    assert run_cli("verify", out).exit_code == 0


def test_bare_state_dict_bin_in_a_directory(tmp_path: Path) -> None:
    model, _ = trained()
    (tmp_path / "src").mkdir()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "src"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:
        assert set(ckpt.fields) == {"weights", "provenance"}
        for key, tensor in model.state_dict().items():
            assert_ckpt_tensor(ckpt, "weights", key, tensor)


def test_optimizer_state_alone(tmp_path: Path) -> None:
    _, optimizer = trained()
    torch.save(optimizer.state_dict(), tmp_path / "opt.pth")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "opt.pth"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:
        assert ckpt.tensor_names("weights") == []
        assert "state.0.exp_avg" in ckpt.tensor_names("optimizer")


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_arbitrary_objects_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": Payload(str(marker))}, path)
    assert not marker.exists()
    result = run_cli("convert", str(path), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1
    assert result.json()["error"]["code"] == "invalid_source"
    assert not marker.exists()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_legacy_pickle_file_is_refused_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(Payload(str(marker))))
    result = run_cli("convert", str(path), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "invalid_source" in result.stderr
    assert not marker.exists()


def test_pt_is_import_only(tmp_path: Path) -> None:
    result = run_cli("convert", str(tmp_path), str(tmp_path / "x.pt"), "--to", "pt")
    assert result.exit_code == 2 and "import only" in result.stderr


def test_missing_source_exit_2(tmp_path: Path) -> None:
    result = run_cli("convert", str(tmp_path / "none.pt"), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 2 and result.json()["error"]["code"] == "not_found"
