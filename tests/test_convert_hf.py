"""Hugging Face safetensors <-> ckptfmt: single and sharded (the layout huggingface_hub writes), bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, assert_ckpt_tensor, assert_same_tensor, keys_of, run_cli

RESULT_KEYS = ("source", "destination", "tensors", "bytes", "files", "checkpoint_id", "notes")


def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["embed.weight"] = torch.randn(10, 8).to(torch.bfloat16)
    sd["mask"] = torch.tensor([True, False, True])
    sd["ids"] = torch.arange(5, dtype=torch.int64)
    sd["scale"] = torch.tensor(0.5, dtype=torch.float16)
    sd["special"] = torch.tensor([float("nan"), -0.0, float("inf")])
    return sd


def hf_dir(tmp_path: Path, name: str, **options: object) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = state_dict()
    path = tmp_path / name
    path.mkdir()
    save_torch_state_dict(sd, path, **options)  # type: ignore[arg-type]
    return path, sd


def load_hf(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(path / shard))
    return out


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("runner", RUNNERS)
def test_round_trip(tmp_path: Path, layout: str, runner: str) -> None:
    options = {"max_shard_size": 300} if layout == "sharded" else {}
    src, sd = hf_dir(tmp_path, "hf", **options)
    assert (src / "model.safetensors.index.json").exists() == (layout == "sharded")
    ours = str(tmp_path / "ours")
    result = RUNNERS[runner]("convert", str(src), ours, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    keys_of(doc, RESULT_KEYS)
    assert doc["source"] == {"url": str(src), "format": "hf"}
    assert doc["destination"]["format"] == "ckptfmt" and doc["tensors"] == len(sd)
    with ckptfmt.open(ours) as ckpt:
        assert ckpt.profile == "weights"
        assert set(ckpt.fields) == {"weights", "provenance"}
        assert set(ckpt.tensor_names("weights")) == set(sd)
        for name, tensor in sd.items():
            assert_ckpt_tensor(ckpt, "weights", name, tensor)
        provenance = ckpt.read_context("provenance")
        assert provenance["converted_from"]["format"] == "hf"
        assert provenance["converted_from"]["layout"] == layout
        assert "step" not in provenance  # nothing invented
    assert run_cli("verify", ours).exit_code == 0

    back = tmp_path / "back"
    args = ["--max-shard-size", "300"] if layout == "sharded" else []
    result = RUNNERS[runner]("convert", ours, str(back), "--to", "hf", *args)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())
    reloaded = load_hf(back)
    assert set(reloaded) == set(sd)
    for name, tensor in sd.items():
        assert_same_tensor(reloaded[name], tensor)


def test_sharded_index_matches_huggingface_hub(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf", max_shard_size=300)
    ours = str(tmp_path / "ours")
    assert run_cli("convert", str(src), ours, "--to", "ckptfmt").exit_code == 0
    back = tmp_path / "back"
    assert run_cli("convert", ours, str(back), "--to", "hf", "--max-shard-size", "300").exit_code == 0
    theirs = json.loads((src / "model.safetensors.index.json").read_text())
    mine = json.loads((back / "model.safetensors.index.json").read_text())
    assert mine["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert set(mine["weight_map"]) == set(theirs["weight_map"])


def test_source_as_index_or_single_file(tmp_path: Path) -> None:
    sharded, sd = hf_dir(tmp_path, "sharded", max_shard_size=300)
    single, _ = hf_dir(tmp_path, "single")
    for src in (sharded / "model.safetensors.index.json", single / "model.safetensors"):
        out = str(tmp_path / f"out-{src.parent.name}")
        assert run_cli("convert", str(src), out, "--to", "ckptfmt").exit_code == 0
        with ckptfmt.open(out) as ckpt:
            assert set(ckpt.tensor_names("weights")) == set(sd)


def test_existing_destination_needs_overwrite(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf", max_shard_size=300)
    ours = str(tmp_path / "ours")
    assert run_cli("convert", str(src), ours, "--to", "ckptfmt").exit_code == 0
    again = run_cli("convert", str(src), ours, "--to", "ckptfmt", "--json")
    assert again.exit_code == 2 and again.json()["error"]["code"] == "exists"
    assert run_cli("convert", str(src), ours, "--to", "ckptfmt", "--overwrite").exit_code == 0
    back = tmp_path / "back"
    assert run_cli("convert", ours, str(back), "--to", "hf", "--max-shard-size", "300").exit_code == 0
    assert run_cli("convert", ours, str(back), "--to", "hf").exit_code == 2
    # overwrite with one shard: the old shards and index go, as huggingface_hub does
    assert run_cli("convert", ours, str(back), "--to", "hf", "--overwrite").exit_code == 0
    assert sorted(p.name for p in back.iterdir()) == ["model.safetensors"]


def test_index_escaping_the_directory_is_refused(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf", max_shard_size=300)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = "../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1
    assert result.json()["error"]["code"] == "invalid_source"
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_index_and_shard_disagreeing_is_refused(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf", max_shard_size=300)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost"] = next(iter(doc["weight_map"].values()))
    index.write_text(json.dumps(doc))
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and "ghost" in result.json()["error"]["message"]


def test_polyglot_shard_is_refused(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf")
    with (src / "model.safetensors").open("ab") as f:
        f.write(b"trailing bytes")
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and result.json()["error"]["code"] == "invalid_source"


def test_hf_to_hf_is_a_usage_error(tmp_path: Path) -> None:
    src, _ = hf_dir(tmp_path, "hf")
    result = run_cli("convert", str(src), str(tmp_path / "x"), "--to", "hf")
    assert result.exit_code == 2 and "ckptfmt first" in result.stderr


def test_parse_size() -> None:
    from ckptfmt.convert import parse_size

    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("300") == 300
    with pytest.raises(ckptfmt.UsageError):
        parse_size("lots")
