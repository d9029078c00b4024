"""ckptfmt as torch.distributed.checkpoint's storage layer (ckptfmt.dcp): dcp.save and dcp.load write and read
verified ckptfmt checkpoints, in one process (the multi-rank cases: tests/test_dcp_ranks.py)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import run_cli
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckptfmt.dcp import StorageReader, StorageWriter
from ckptfmt.errors import DigestMismatchError, UsageError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return model, optimizer


def state(seed: int) -> dict[str, Any]:
    model, optimizer = trained(seed)
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "train": {"step": 7 + seed, "name": f"run{seed}", "lr": math.inf}}


def flat(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return dict(flatten_state_dict(sd)[0])


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    fa, fb = flat(a), flat(b)
    if fa.keys() != fb.keys():
        return False
    for key, value in fa.items():
        other = fb[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and value.dtype == other.dtype and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


def test_a_dcp_round_trip_through_ckptfmt_equals_the_one_through_the_file_system_writer(tmp_path: Path) -> None:
    saved = state(0)
    dcp.save(saved, storage_writer=StorageWriter(tmp_path / "ckptfmt"))
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "dcp")))
    ours, theirs = state(1), state(1)
    assert not same(ours, saved)
    dcp.load(ours, storage_reader=StorageReader(tmp_path / "ckptfmt"))
    dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path / "dcp")))
    assert same(ours, theirs) and same(ours, saved)
    assert ours["train"] == {"step": 7, "name": "run0", "lr": math.inf}


def test_ckpt_verify_and_inspect_pass_on_a_checkpoint_written_through_dcp(tmp_path: Path) -> None:
    dcp.save(state(0), storage_writer=StorageWriter(tmp_path / "ck"))
    run = run_cli("verify", str(tmp_path / "ck"))
    assert run.exit_code == 0, run.stdout + run.stderr
    doc = run_cli("inspect", str(tmp_path / "ck"), "--json").json()
    assert doc["profile"] == "weights"


def test_a_flipped_byte_fails_the_load_naming_file_and_tensor_and_changes_no_destination(tmp_path: Path) -> None:
    dcp.save(state(0), storage_writer=StorageWriter(tmp_path / "ck"))
    data = sorted((tmp_path / "ck" / "weights").rglob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x10
    data.write_bytes(bytes(raw))
    target = state(1)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat(target).items()}
    with pytest.raises(CheckpointException) as caught:  # DCP reports each rank's error, ours unchanged inside
        dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    ((error, _),) = caught.value.failures.values()
    assert isinstance(error, DigestMismatchError)
    assert error.path is not None and error.path.startswith("weights/") and error.tensor is not None
    after = flat(target)
    assert all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k] for k, v in before.items())


class Opaque:
    """State that only pickle can carry."""


def test_state_that_would_need_pickle_is_refused_naming_its_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2), "thing": Opaque()}, storage_writer=StorageWriter(tmp_path / "ck"))
    ((error, _),) = caught.value.failures.values()
    assert isinstance(error, UsageError) and error.tensor == "thing" and "pickle" in error.message
    assert not (tmp_path / "ck" / "manifest.json").exists()


def test_a_checkpoint_written_by_ckptfmt_torch_loads_through_dcp(tmp_path: Path) -> None:
    import ckptfmt

    with warnings.catch_warnings():
        model, _ = trained(0)
        with ckptfmt.CheckpointWriter(ckptfmt.open_store(str(tmp_path / "ck")), profile="weights") as writer:
            writer.write_tensors("weights", dict(model.state_dict()))
    other, _ = trained(1)
    target = dict(other.state_dict())
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())


def test_a_dcp_save_with_training_fields_is_a_training_checkpoint_with_all_seven(tmp_path: Path) -> None:
    from torch.utils.data import TensorDataset

    from ckptfmt.dcp import TrainingFields
    from ckptfmt.torch import ResumableDataLoader

    loader = ResumableDataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, seed=1)
    for _ in zip(range(3), loader, strict=False):
        pass  # three batches handed out: the data position is 12 samples in
    saved = state(0)
    fields = TrainingFields(step=7, data=loader, config={"lr": 0.01, "model": "mlp"})
    dcp.save(saved, storage_writer=StorageWriter(tmp_path / "ck", training=fields))
    doc = run_cli("inspect", str(tmp_path / "ck"), "--json").json()
    assert doc["profile"] == "training"
    assert {"weights", "optimizer", "rng", "data", "config", "topology", "provenance"} <= set(doc["fields"])
    assert doc["context"]["data"]["global_sample_offset"] == 12
    assert run_cli("verify", str(tmp_path / "ck")).exit_code == 0
    target = state(1)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    assert same(target, saved)  # the optimizer's tensors, in their own field, under DCP's names all the same


def test_a_checkpoint_written_through_dcp_loads_without_a_template(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    saved = state(0)
    dcp.save(saved, storage_writer=StorageWriter(tmp_path / "ck"))
    loaded = _load_state_dict_from_keys(storage_reader=StorageReader(tmp_path / "ck"))  # what dcp_to_torch_save does
    assert same(loaded, saved)  # nested as it was saved: the flattening DCP used travels in the checkpoint


def test_a_dcp_directory_converted_by_ckpt_convert_loads_through_the_reader_as_it_saved(tmp_path: Path) -> None:
    saved = {"model": dict(trained(0)[0].state_dict())}
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "dcp")))
    run = run_cli("convert", str(tmp_path / "dcp"), str(tmp_path / "ck"), "--to", "ckptfmt")
    assert run.exit_code == 0, run.stdout + run.stderr
    target = {"model": dict(trained(1)[0].state_dict())}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    assert same(target, saved)


def test_a_local_url_is_this_machine_s_disk(tmp_path: Path) -> None:
    saved = state(0)
    dcp.save(saved, storage_writer=StorageWriter(f"local://{tmp_path}/ck"))  # fsspec's name, no auto_mkdir needed
    target = state(1)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    assert same(target, saved)
