"""Hostile torch files and pickles against the importers (issue 23): shared references that expand
exponentially, deep nesting, a thousand names for one tensor, damaged archives. One oracle: a library
error (invalid_source) naming the file, quickly, or (for legitimate sharing) the tensor stored once."""

from __future__ import annotations

import io
import json
import signal
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ckptfmt
from ckptfmt.convert import convert
from ckptfmt.convert.base import locate
from ckptfmt.convert.training_args import read_training_args
from ckptfmt.errors import SourceFormatError

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli

LEVELS, FAN = 9, 8  # 8**9 = 134M leaves once expanded, from a few hundred bytes


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (not hang) when the block runs longer than ``seconds``: the defect was an endless walk."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def shared_tree(levels: int = LEVELS, fan: int = FAN) -> list[Any]:
    """A list of ``fan`` references to a list of ``fan`` references... (pickled once per level)."""
    node: list[Any] = [1] * fan
    for _ in range(levels - 1):
        node = [node] * fan
    return node


def shared_args_pickle() -> bytes:
    """A training_args.bin of 274 bytes whose one field expands to 8**9 values (BINGETs of BINGETs)."""
    out = b"\x80\x02ctransformers.training_args\nTrainingArguments\n)\x81}X\x04\x00\x00\x00deep"
    out += b"](" + b"K\x01" * FAN + b"eq\x00"
    for level in range(1, LEVELS):
        out += b"0](" + (b"h" + bytes([level - 1])) * FAN + b"eq" + bytes([level])  # POP the level below
    return out + b"sb."


def torch_archive(pickle_bytes: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is ``pickle_bytes`` (what a hand-made hostile file holds)."""
    buf = io.BytesIO()
    torch.save({}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickle_bytes if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def trainer_dir(root: Path, **files: bytes) -> Path:
    root.mkdir()
    (root / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 1.0, "train_batch_size": 2}))
    safetensors.torch.save_file({"w": torch.ones(2, 2)}, root / "model.safetensors")
    for name, data in files.items():
        (root / name.replace("__", ".")).write_bytes(data)
    return root


def saved(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# ---------------------------------------------------------------- shared references: bounded by the expansion


def test_shared_references_in_training_args_are_refused_quickly(tmp_path: Path) -> None:
    data = shared_args_pickle()
    assert len(data) < 300
    (tmp_path / "training_args.bin").write_bytes(data)
    with deadline(60), pytest.raises(SourceFormatError) as info:
        read_training_args(locate(str(tmp_path / "training_args.bin")))
    assert info.value.code == "invalid_source" and "training_args.bin" in str(info.value.path)
    assert "expanded" in info.value.message


def test_shared_references_in_training_args_skip_the_file_in_an_import(tmp_path: Path) -> None:
    src = trainer_dir(tmp_path / "checkpoint-3", training_args__bin=shared_args_pickle())
    with deadline(60):
        result = convert(str(src), str(tmp_path / "out"), to="ckptfmt")
    assert any(n.startswith("skipped training_args.bin") for n in result.notes)


def test_a_small_shared_value_in_training_args_is_still_read(tmp_path: Path) -> None:
    out = b"\x80\x02ctransformers.training_args\nTrainingArguments\n)\x81}(X\x01\x00\x00\x00a](K\x01K\x02eq\x00"
    out += b"X\x01\x00\x00\x00bh\x00ub."
    (tmp_path / "training_args.bin").write_bytes(out)
    assert read_training_args(locate(str(tmp_path / "training_args.bin"))) == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("target", ["pt", "lightning", "hf-trainer", "accelerate"])
def test_shared_references_in_a_torch_file_are_refused_quickly(tmp_path: Path, target: str) -> None:
    tree = shared_tree()
    if target == "pt":
        src = tmp_path / "model.pt"
        src.write_bytes(saved({"w": torch.ones(2), "meta": tree}))
    elif target == "lightning":
        src = tmp_path / "model.ckpt"
        src.write_bytes(saved({"state_dict": {"w": torch.ones(2)}, "callbacks": tree}))
    elif target == "hf-trainer":
        src = trainer_dir(tmp_path / "checkpoint-3", scheduler__pt=saved({"milestones": tree}))
    else:
        src = tmp_path / "state"
        src.mkdir()
        safetensors.torch.save_file({"w": torch.ones(2, 2)}, src / "model.safetensors")
        (src / "scheduler.bin").write_bytes(saved({"milestones": tree}))
    assert src.is_dir() or src.stat().st_size < 4096
    with deadline(60):
        result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--from", target)
    assert result.exit_code == 1 and "invalid_source" in result.stderr, result.stderr
    assert "expanded" in result.stderr


def test_a_cycle_in_a_torch_file_is_refused(tmp_path: Path) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    (tmp_path / "model.pt").write_bytes(saved({"w": torch.ones(2), "meta": loop}))
    with deadline(60), pytest.raises(SourceFormatError, match="contains itself"):
        convert(str(tmp_path / "model.pt"), str(tmp_path / "out"), to="ckptfmt")


@pytest.mark.parametrize("depth", [65, 100_000])
def test_a_deeply_nested_torch_file_is_refused_cleanly(tmp_path: Path, depth: int) -> None:
    deep = b"\x80\x02}X\x01\x00\x00\x00d" + b"]" * depth + b"a" * (depth - 1) + b"s."
    (tmp_path / "model.pt").write_bytes(torch_archive(deep))
    with deadline(60):
        result = run_cli("convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "invalid_source" in result.stderr, result.stderr
    assert "nests deeper" in result.stderr


def test_nesting_within_the_limit_still_imports(tmp_path: Path) -> None:
    value: Any = 1
    for _ in range(40):
        value = [value]
    torch.save({"w": torch.ones(2), "meta": value}, tmp_path / "model.pt")
    convert(str(tmp_path / "model.pt"), str(tmp_path / "out"), to="ckptfmt")
    with ckptfmt.open(tmp_path / "out") as ckpt:
        assert ckpt.read_context("weights")["meta"] == value


# ---------------------------------------------------------------- shared tensors: stored once


def data_bytes(url: Path) -> int:
    return sum(p.stat().st_size for p in url.rglob("*.safetensors"))


def test_a_thousand_names_for_one_tensor_are_stored_once_in_a_lightning_import(tmp_path: Path) -> None:
    one = torch.arange(4096, dtype=torch.float32)  # 16 KiB
    state = {f"layer{i}.weight": one for i in range(1024)}
    torch.save({"state_dict": state, "epoch": 1, "global_step": 5, "extra": [one, one]}, tmp_path / "x.ckpt")
    assert (tmp_path / "x.ckpt").stat().st_size < 64 << 10
    convert(str(tmp_path / "x.ckpt"), str(tmp_path / "out"), to="ckptfmt")
    assert data_bytes(tmp_path / "out") < 256 << 10  # was 17 MB: every reference stored again
    with ckptfmt.open(tmp_path / "out") as ckpt:
        assert ckpt.tensor_names("weights") == ["layer0.weight"]
        aliases = ckpt.read_context("weights")["aliases"]
        assert len(aliases) == 1023 and set(aliases.values()) == {"layer0.weight"}
        assert len(ckpt.tensor_names("lightning_tensors")) == 1
    convert(str(tmp_path / "out"), str(tmp_path / "back.ckpt"), to="lightning")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert set(back["state_dict"]) == set(state)
    assert all(torch.equal(t, one) for t in back["state_dict"].values())
    assert back["extra"][0] is back["extra"][1]


def test_tied_weights_in_a_pt_file_are_stored_once_and_load_back(tmp_path: Path) -> None:
    from ckptfmt.torch import load as torch_load

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's head
    torch.save(model.state_dict(), tmp_path / "model.pt")
    convert(str(tmp_path / "model.pt"), str(tmp_path / "out"), to="ckptfmt")
    with ckptfmt.open(tmp_path / "out") as ckpt:
        assert ckpt.tensor_names("weights") == ["0.weight"]
        assert ckpt.read_context("weights")["aliases"] == {"1.weight": "0.weight"}
    fresh = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    torch_load(str(tmp_path / "out"), model=fresh, restore_rng=False)
    assert torch.equal(fresh[1].weight, model[0].weight)


def test_repeated_views_of_one_storage_are_refused_beyond_a_bound(tmp_path: Path) -> None:
    big = torch.zeros(1 << 16)  # 256 KiB, viewed 1,024 times (each view one element shorter: no alias)
    state = {str(i): {"exp_avg": big[i:]} for i in range(1024)}
    torch.save({"state": state, "param_groups": [{"params": list(range(1024))}]}, tmp_path / "opt.pt")
    assert (tmp_path / "opt.pt").stat().st_size < 1 << 20
    with pytest.raises(SourceFormatError, match="amplification"):
        convert(str(tmp_path / "opt.pt"), str(tmp_path / "out"), to="ckptfmt")


# ---------------------------------------------------------------- damaged archives: the library's error


def damaged(archive: bytes, entry: str, how: str) -> bytes:
    """``archive`` with ``entry``'s local and central headers saying an unsupported method or encryption."""
    data = bytearray(archive)
    name = entry.encode()
    for signature, flags_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        start = 0
        while (start := data.find(signature, start)) >= 0:
            name_at = start + (30 if signature == b"PK\x03\x04" else 46)
            if data[name_at : name_at + len(name)] == name:
                if how == "method":
                    data[start + method_at : start + method_at + 2] = (99).to_bytes(2, "little")
                else:
                    data[start + flags_at] |= 1
            start += 4
    return bytes(data)


def archive_entry(archive: bytes, suffix: str) -> str:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return next(n for n in z.namelist() if n.endswith(suffix))


@pytest.mark.parametrize("how", ["method", "encrypted"])
@pytest.mark.parametrize("entry", ["data.pkl", "data/0"])
def test_a_damaged_pt_archive_entry_is_invalid_source(tmp_path: Path, how: str, entry: str) -> None:
    archive = saved({"w": torch.ones(3)})
    (tmp_path / "model.pt").write_bytes(damaged(archive, archive_entry(archive, "/" + entry), how))
    result = run_cli("convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "invalid_source" in result.stderr and "model.pt" in result.stderr, result.stderr


@pytest.mark.parametrize("how", ["method", "encrypted"])
def test_a_damaged_training_args_archive_is_invalid_source(tmp_path: Path, how: str) -> None:
    archive = torch_archive(b"\x80\x02}.")  # the pickle is never reached
    (tmp_path / "training_args.bin").write_bytes(damaged(archive, archive_entry(archive, "/data.pkl"), how))
    with pytest.raises(SourceFormatError) as info:
        read_training_args(locate(str(tmp_path / "training_args.bin")))
    assert info.value.code == "invalid_source" and "training_args.bin" in str(info.value.path)
