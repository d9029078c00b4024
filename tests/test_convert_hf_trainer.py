"""Hugging Face Trainer checkpoint directories <-> ckptfmt: a real tiny Trainer run, imported, exported and resumed.

The resume test is the contract: import ``checkpoint-3`` into ckptfmt, export it back with
``--to hf-trainer``, resume a fresh Trainer from the export, and the weights and optimizer state at
step 6 are bit-identical to the uninterrupted run's ``checkpoint-6``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

import ckptfmt
from ckptfmt.convert import convert, detect_format

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers loads huggingface_hub: nothing may reach the Hub
import transformers  # the integrations extra, which .[dev] installs

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli

STEPS, SAVE_EVERY = 6, 3


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 deterministic token sequences: item i depends on i alone."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(out: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        save_strategy="steps",
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: checkpoint-3 and checkpoint-6."""
    out = tmp_path_factory.mktemp("hf") / "run"
    trainer(out).train()
    return out


def test_import_fills_the_training_profile_and_says_what_is_missing(run: Path, tmp_path: Path) -> None:
    src = run / "checkpoint-3"
    assert detect_format(str(src)) == "hf-trainer"
    out = str(tmp_path / "ours")
    result = run_cli("convert", str(src), out, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["source"]["format"] == "hf-trainer"
    assert any("training_args.bin read by scanning its pickle opcodes" in n for n in doc["notes"])
    assert any("lacks topology" in n for n in doc["notes"])
    assert "note: " in result.stderr
    with ckptfmt.open(out) as ckpt:
        assert ckpt.profile == "training"
        assert {"weights", "optimizer", "rng", "data", "config", "topology", "provenance"} <= set(ckpt.fields)
        assert {"trainer_state", "scheduler"} <= set(ckpt.fields)
        weights = safetensors.torch.load_file(src / "model.safetensors")
        assert set(ckpt.tensor_names("weights")) == set(weights)
        for name, tensor in weights.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), tensor.numpy())
        osd = torch.load(src / "optimizer.pt", weights_only=True)
        for pid, state in osd["state"].items():
            for key, value in state.items():
                assert np.array_equal(ckpt.read_tensor("optimizer", f"state.{pid}.{key}"), value.numpy())
        assert ckpt.read_context("optimizer")["param_groups"][0]["lr"] == osd["param_groups"][0]["lr"]
        assert ckpt.read_context("optimizer")["class"] == "AdamW"  # from training_args.optim
        generators = ckpt.read_context("rng")["generators"]
        assert {g["kind"] for g in generators.values()} == {"python.random", "numpy.random_state", "torch.cpu"}
        data = ckpt.read_context("data")
        assert data["hf_trainer"]["global_step"] == 3
        assert data["global_sample_offset"] == 12  # 3 steps of 4 samples
        config = ckpt.read_context("config")["config"]
        assert config["model"]["n_embd"] == 16 and config["trainer"]["train_batch_size"] == 4
        args = config["training_args"]
        assert args["learning_rate"] == 1e-3 and args["max_steps"] == STEPS and args["save_strategy"] == "steps"
        assert args["gradient_accumulation_steps"] == 1 and args["per_device_train_batch_size"] == 4
        provenance = ckpt.read_context("provenance")
        assert provenance["step"] == 3
        sources = provenance["converted_from"]["fields"]
        assert sources["optimizer"]["file"] == "optimizer.pt"
        assert sources["rng"]["file"] == "rng_state.pth"
        assert sources["weights"]["file"] == "model.safetensors"
        assert "topology" in provenance["converted_from"]["missing"]
    inspect = run_cli("inspect", out)
    assert "converted_from" in inspect.stdout and "optimizer.pt" in inspect.stdout
    assert run_cli("verify", out).exit_code == 0


def test_export_resumes_a_trainer_bit_identically(run: Path, tmp_path: Path) -> None:
    ours, exported = str(tmp_path / "ours"), tmp_path / "exported"
    convert(str(run / "checkpoint-3"), ours, to="ckptfmt")
    result = run_cli("convert", ours, str(exported), "--to", "hf-trainer", "--json")
    assert result.exit_code == 0, result.stderr
    names = set(os.listdir(exported))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= names
    assert "training_args.bin" not in names
    resumed = trainer(tmp_path / "resumed", seed=1)  # other initial weights: the resume must replace them
    resumed.train(resume_from_checkpoint=str(exported))
    final = run / f"checkpoint-{STEPS}"
    expected = safetensors.torch.load_file(final / "model.safetensors")
    state = resumed.model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    theirs = torch.load(final / "optimizer.pt", weights_only=True)["state"]
    mine = resumed.optimizer.state_dict()["state"]
    for pid, entries in theirs.items():
        for key, value in entries.items():
            assert torch.equal(mine[pid][key], value), (pid, key)


def test_resume_without_the_rng_state_is_not_identical(run: Path, tmp_path: Path) -> None:
    """Negative control: the comparison above can fail. Without rng_state.pth the run diverges
    (GPT-2's dropout draws from torch's generator)."""
    exported = tmp_path / "exported"
    ours = str(tmp_path / "ours")
    convert(str(run / "checkpoint-3"), ours, to="ckptfmt")
    convert(ours, str(exported), to="hf-trainer")
    (exported / "rng_state.pth").unlink()
    torch.manual_seed(1234)
    resumed = trainer(tmp_path / "resumed", seed=1)
    torch.manual_seed(1234)
    resumed.train(resume_from_checkpoint=str(exported))
    expected = safetensors.torch.load_file(run / f"checkpoint-{STEPS}" / "model.safetensors")
    state = resumed.model.state_dict()
    assert not all(torch.equal(state[n], t) for n, t in expected.items())


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_training_args_is_never_unpickled(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    marker = tmp_path / "pwned"
    (src / "training_args.bin").write_bytes(pickle.dumps(_Payload(str(marker))))
    result = convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    assert not marker.exists()
    assert any(n.startswith("skipped training_args.bin") and "never unpickled" in n for n in result.notes)
    with ckptfmt.open(tmp_path / "ours") as ckpt:
        assert "training_args" not in ckpt.read_context("config")["config"]
        assert ckpt.read_context("provenance")["converted_from"]["skipped"][0].startswith("training_args.bin")


def test_training_args_gradient_accumulation_counts_and_tokens_are_dropped(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, hub_token="hf_secret_value", report_to=[]
    )
    torch.save(args, src / "training_args.bin")  # as the Trainer saves it
    convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    with ckptfmt.open(tmp_path / "ours") as ckpt:
        assert ckpt.read_context("data")["global_sample_offset"] == 3 * 4 * 2
        training_args = ckpt.read_context("config")["config"]["training_args"]
        assert training_args["gradient_accumulation_steps"] == 2 and "hub_token" not in training_args
    assert not any(b"hf_secret_value" in f.read_bytes() for f in (tmp_path / "ours").rglob("*") if f.is_file())


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state.pth", "scheduler.pt"])
def test_a_hostile_torch_file_is_refused_naming_it(run: Path, tmp_path: Path, name: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _Payload(str(marker))}, src / name)
    out = tmp_path / "ours"
    result = run_cli("convert", str(src), str(out), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1, result.stderr
    assert not marker.exists()
    assert name in result.stderr and "invalid_source" in result.stderr
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"global_step": 3, "global_step": 4}', "duplicate"),
        ('{"global_step": -1}', "global_step"),
        ('{"global_step": NaN}', "NaN"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_a_malformed_trainer_state_is_refused(run: Path, tmp_path: Path, text: str, problem: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    (src / "trainer_state.json").write_text(text)
    with pytest.raises(ckptfmt.SourceFormatError, match=problem) as info:
        convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    assert info.value.path is not None and info.value.path.endswith("trainer_state.json")


def test_per_rank_rng_pytorch_bin_and_no_optimizer(run: Path, tmp_path: Path) -> None:
    """What a distributed, safe_serialization=False, weights-only save looks like."""
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    weights = safetensors.torch.load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(weights, src / "pytorch_model.bin")
    (src / "optimizer.pt").unlink()
    shutil.copy(src / "rng_state.pth", src / "rng_state_0.pth")
    (src / "rng_state.pth").rename(src / "rng_state_1.pth")
    ours, back = str(tmp_path / "ours"), tmp_path / "back"
    result = convert(str(src), ours, to="ckptfmt")
    assert any("optimizer (no optimizer.pt)" in n for n in result.notes)
    with ckptfmt.open(ours) as ckpt:
        assert ckpt.tensor_names("optimizer") == []
        assert ckpt.read_context("topology")["world_size"] == 2
        assert ckpt.read_context("data")["global_sample_offset"] == 24
        assert {n.split("/")[0] for n in ckpt.read_context("rng")["generators"]} == {"rank0", "rank1"}
        for name, tensor in weights.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), tensor.numpy())
    convert(ours, str(back), to="hf-trainer")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(back))
    assert "optimizer.pt" not in os.listdir(back)
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        original = torch.load(run / "checkpoint-3" / "rng_state.pth", weights_only=True)
        again = torch.load(back / "rng_state_1.pth", weights_only=True)
    assert again["python"] == original["python"]
    assert torch.equal(again["cpu"], original["cpu"])
    assert np.array_equal(again["numpy"][1], original["numpy"][1]) and again["numpy"][2:] == original["numpy"][2:]


def test_export_refuses_to_overwrite(run: Path, tmp_path: Path) -> None:
    ours, exported = str(tmp_path / "ours"), tmp_path / "exported"
    convert(str(run / "checkpoint-3"), ours, to="ckptfmt")
    convert(ours, str(exported), to="hf-trainer")
    result = run_cli("convert", ours, str(exported), "--to", "hf-trainer")
    assert result.exit_code == 2 and "overwrite" in result.stderr
    assert run_cli("convert", ours, str(exported), "--to", "hf-trainer", "--overwrite").exit_code == 0


@pytest.mark.parametrize("by_name", [False, True])
def test_export_from_a_ckptfmt_torch_checkpoint(tmp_path: Path, by_name: bool) -> None:
    """A checkpoint written by ckptfmt.torch (not imported) exports with a trainer_state.json made from its step."""
    from ckptfmt.torch import capture
    from ckptfmt.torch.state import write_snapshot

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()

    class Sampler:
        def state_dict(self) -> dict[str, int]:
            return {"epoch": 0, "global_sample_offset": 12}

    url = str(tmp_path / "ours")
    snap = capture(
        step=7, model=model, optimizer=optimizer, sampler=Sampler(), config={"lr": 1e-3}, optimizer_by_name=by_name
    )
    write_snapshot(ckptfmt.open_writer(url), snap)  # commits
    with ckptfmt.open(url) as ckpt:  # ckptfmt.torch names optimizer state by parameter or by index
        assert ("weight/exp_avg" in ckpt.tensor_names("optimizer")) is by_name
    result = convert(url, str(tmp_path / "hf"), to="hf-trainer")
    assert any("made from the checkpoint's step 7" in n for n in result.notes)
    import json

    assert json.loads((tmp_path / "hf" / "trainer_state.json").read_text())["global_step"] == 7
    loaded = torch.load(tmp_path / "hf" / "optimizer.pt", weights_only=True)
    for pid, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(loaded["state"][pid][key], value)
    again = torch.optim.AdamW(model.parameters())
    again.load_state_dict(loaded)  # the index-keyed state dict the Trainer loads
    assert again.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps({"a": 1})[:-3],  # truncated
        b"\x80\x02cos\nsystem\n(S'touch x'\ntR.",  # a bare call of os.system, protocol 2
        b"\x80\x02(cos\nsystem\nS'touch x'\ni__main__\nX\n.",  # INST: an opcode the scan does not read
        b"PK\x03\x04 not really a zip",
    ],
)
def test_unreadable_training_args_are_skipped_and_named(run: Path, tmp_path: Path, data: bytes) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    (src / "training_args.bin").write_bytes(data)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "x").exists()
    assert any(n.startswith("skipped training_args.bin") for n in result.notes)


def test_deeply_nested_training_args_are_read_without_recursion(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    depth = 40_000  # lists nested this deep (under MAX_PICKLE_OPS): the nested field is left out, the rest is read
    head = b"\x80\x04ctransformers.training_args\nTrainingArguments\n)\x81}"
    deep = b"\x8c\x01a" + b"]" * depth + b"a" * (depth - 1) + b"s"
    plain = b"\x8c\x1bgradient_accumulation_stepsK\x03s"
    (src / "training_args.bin").write_bytes(head + deep + plain + b"b.")
    convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    with ckptfmt.open(tmp_path / "ours") as ckpt:
        assert ckpt.read_context("config")["config"]["training_args"] == {"gradient_accumulation_steps": 3}


def test_scan_pickle_reads_plain_values_and_keeps_calls_opaque() -> None:
    from ckptfmt.convert.pickle_scan import scan_pickle

    value = {"a": [1, 2.5, None, True, "s", b"b"], "t": (1, (2,)), "shared": [0]}
    value["again"] = value["shared"]
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):  # protocol 2 writes bytes as a call of _codecs
        assert scan_pickle(pickle.dumps(value, protocol=protocol), "mem") == {**value, "t": (1, (2,))}
    opaque = scan_pickle(pickle.dumps(_Payload("m")), "mem")
    assert type(opaque).__name__ == "Opaque" and opaque.name.endswith("system")  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_sharded_weights(run: Path, tmp_path: Path, kind: str) -> None:
    import json

    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    weights = safetensors.torch.load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {f"model-0000{i + 1}-of-00002.{kind}": names[i::2] for i in range(2)}
    if kind == "bin":
        halves = {k.replace("model-", "pytorch_model-"): v for k, v in halves.items()}
    for shard, members in halves.items():
        part = {n: weights[n].contiguous() for n in members}
        if kind == "bin":
            torch.save(part, src / shard)
        else:
            safetensors.torch.save_file(part, src / shard)
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {n: shard for shard, members in halves.items() for n in members}
    (src / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    with ckptfmt.open(tmp_path / "ours") as ckpt:
        assert set(ckpt.tensor_names("weights")) == set(weights)
        for name, tensor in weights.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), tensor.numpy())
        source = ckpt.read_context("provenance")["converted_from"]["fields"]["weights"]["file"]
        assert source == (", ".join(sorted(halves)) if kind == "safetensors" else index)


def test_a_bin_index_naming_a_file_outside_is_refused(run: Path, tmp_path: Path) -> None:
    import json

    src = tmp_path / "src"
    shutil.copytree(run / "checkpoint-3", src)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd.bin"}}))
    with pytest.raises(ckptfmt.SourceFormatError, match=r"not a \.bin file here") as info:
        convert(str(src), str(tmp_path / "ours"), to="ckptfmt")
    assert info.value.path is not None and info.value.path.endswith("pytorch_model.bin.index.json")


def test_import_and_export_through_fsspec(run: Path, tmp_path: Path) -> None:
    """A remote source and destination (fsspec's memory filesystem: no mmap, ranged reads, pipe_file writes)."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/hf-trainer-{uuid.uuid4().hex}"
    for f in (run / "checkpoint-3").iterdir():
        fs.pipe_file(f"{root}/src/{f.name}", f.read_bytes())
    try:
        convert(f"memory://{root}/src", f"memory://{root}/ours", to="ckptfmt")
        convert(f"memory://{root}/ours", f"memory://{root}/back", to="hf-trainer")
        for name in ("optimizer.pt", "model.safetensors", "rng_state.pth", "scheduler.pt"):
            (tmp_path / name).write_bytes(fs.cat_file(f"{root}/back/{name}"))
        original = torch.load(run / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
        again = torch.load(tmp_path / "optimizer.pt", weights_only=True)["state"]
        assert all(torch.equal(again[p][k], v) for p, entries in original.items() for k, v in entries.items())
        weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
        expected = safetensors.torch.load_file(run / "checkpoint-3" / "model.safetensors")
        assert all(torch.equal(weights[k], v) for k, v in expected.items())
    finally:
        fs.rm(root, recursive=True)
