"""Accelerate save_state directories -> ckptfmt: several models and optimizers, per-process RNG files,
hostile pickles, and what the notes and provenance say. Directories are built as Accelerate writes them
(file names and contents), without running Accelerate, so these tests stay fast."""

from __future__ import annotations

import os
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

import ckptfmt
from ckptfmt.convert import convert, detect_format

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli


def rng_state(step: int = 0) -> dict[str, Any]:
    return {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }


def save_state(directory: Path, *, ranks: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two models, two optimizers, one scheduler, RNG files for ``ranks`` processes."""
    directory.mkdir()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.Adam(a.parameters()), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    b(a(torch.randn(4, 3))).sum().backward()
    opt_a.step()
    opt_b.step()
    safetensors.torch.save_file(a.state_dict(), directory / "model.safetensors")
    torch.save(b.state_dict(), directory / "pytorch_model_1.bin")
    torch.save(opt_a.state_dict(), directory / "optimizer.bin")
    torch.save(opt_b.state_dict(), directory / "optimizer_1.bin")
    scheduler = torch.optim.lr_scheduler.StepLR(opt_a, 2)
    torch.save(scheduler.state_dict(), directory / "scheduler.bin")
    for r in range(ranks):
        torch.save(rng_state(step=r), directory / f"random_states_{r}.pkl")
    return a.state_dict(), b.state_dict()


def test_two_models_two_optimizers(tmp_path: Path) -> None:
    a, b = save_state(tmp_path / "state")
    assert detect_format(str(tmp_path / "state")) == "accelerate"
    out = str(tmp_path / "ours")
    result = run_cli("convert", str(tmp_path / "state"), out, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    assert any("lacks data" in n for n in result.json()["notes"])
    with ckptfmt.open(out) as ckpt:
        assert ckpt.profile == "training"
        names = set(ckpt.tensor_names("weights"))
        assert names == set(a) | {f"model_1.{k}" for k in b}
        for key, tensor in b.items():
            assert np.array_equal(ckpt.read_tensor("weights", f"model_1.{key}"), tensor.numpy())
        assert {"0/state.0.exp_avg", "1/state.0.momentum_buffer"} <= set(ckpt.tensor_names("optimizer"))
        assert len(ckpt.read_context("optimizer")["optimizers"]) == 2
        assert ckpt.read_context("scheduler")["state"]["step_size"] == 2
        assert set(ckpt.read_context("rng")["generators"]) == {"python", "numpy", "torch"}
        sources = ckpt.read_context("provenance")["converted_from"]["fields"]
        assert sources["weights"]["file"] == "model.safetensors, pytorch_model_1.bin"
        assert sources["optimizer"]["file"] == "optimizer.bin, optimizer_1.bin"
    assert run_cli("verify", out).exit_code == 0
    assert "random_states_0.pkl" in run_cli("inspect", out).stdout  # where the rng field came from
    back = tmp_path / "back"
    convert(out, str(back), to="accelerate")
    assert set(os.listdir(back)) == {
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.bin",
        "optimizer_1.bin",
        "scheduler.bin",
        "random_states_0.pkl",
    }
    again = safetensors.torch.load_file(back / "model_1.safetensors")
    assert all(torch.equal(again[k], v) for k, v in b.items())


def test_per_process_rng_files(tmp_path: Path) -> None:
    save_state(tmp_path / "state", ranks=2)
    out = str(tmp_path / "ours")
    convert(str(tmp_path / "state"), out, to="ckptfmt")
    with ckptfmt.open(out) as ckpt:
        generators = ckpt.read_context("rng")["generators"]
        assert {n.split("/")[0] for n in generators} == {"rank0", "rank1"}
        assert ckpt.read_context("topology")["world_size"] == 2
        assert ckpt.read_context("accelerate")["step"] == {"0": 0, "1": 1}
    convert(out, str(tmp_path / "back"), to="accelerate")
    from ckptfmt.convert.torch_files import numpy_globals

    with torch.serialization.safe_globals(numpy_globals()):
        state = torch.load(tmp_path / "back" / "random_states_1.pkl", weights_only=True)
    assert state["step"] == 1 and state["random_state"] == random.getstate()
    assert torch.equal(state["torch_manual_seed"], torch.get_rng_state())


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_registered_object_pickle_is_skipped_not_run(tmp_path: Path) -> None:
    save_state(tmp_path / "state")
    marker = tmp_path / "pwned"
    (tmp_path / "state" / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    torch.save({"epoch": 3, "offset": torch.tensor([5])}, tmp_path / "state" / "custom_checkpoint_1.pkl")
    result = convert(str(tmp_path / "state"), str(tmp_path / "ours"), to="ckptfmt")
    assert not marker.exists()
    assert any(n.startswith("skipped custom_checkpoint_0.pkl") for n in result.notes)
    with ckptfmt.open(tmp_path / "ours") as ckpt:
        files = ckpt.read_context("accelerate")["files"]
        assert set(files) == {"custom_checkpoint_1.pkl"}
        assert files["custom_checkpoint_1.pkl"]["epoch"] == 3
        assert ckpt.read_context("provenance")["converted_from"]["skipped"][0].startswith("custom_checkpoint_0.pkl")


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl", "pytorch_model_1.bin"])
def test_a_hostile_state_file_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    save_state(tmp_path / "state")
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _Payload(marker)}, tmp_path / "state" / name)
    result = run_cli("convert", str(tmp_path / "state"), str(tmp_path / "ours"), "--to", "ckptfmt")
    assert result.exit_code == 1
    assert name in result.stderr and "invalid_source" in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "ours" / "manifest.json").exists()


def test_a_malformed_rng_state_is_refused(tmp_path: Path) -> None:
    save_state(tmp_path / "state")
    torch.save(
        {"random_state": (3, [1, 2]), "torch_manual_seed": torch.ones(3)}, tmp_path / "state" / "random_states_0.pkl"
    )
    with pytest.raises(ckptfmt.SourceFormatError) as info:
        convert(str(tmp_path / "state"), str(tmp_path / "ours"), to="ckptfmt")
    assert info.value.path is not None and "random_states_0.pkl" in info.value.path


def test_import_ckptfmt_loads_no_framework() -> None:
    import subprocess

    code = (
        "import sys, ckptfmt, ckptfmt.convert; "
        "bad = [m for m in ('transformers', 'pytorch_lightning', 'accelerate', 'torch', 'ckptfmt.integrations') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
