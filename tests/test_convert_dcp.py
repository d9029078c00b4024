"""PyTorch Distributed Checkpoint <-> ckptfmt, and a malicious .metadata that must never run."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, assert_ckpt_tensor, assert_same_tensor, run_cli


def dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process, no process group: intended
        dcp.save(state, checkpoint_id=str(path))


def dcp_load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))


def flat_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state["emb"] = torch.randn(6, 3).to(torch.bfloat16)
    state["special"] = torch.tensor([float("nan"), -0.0, float("inf")])
    state["count"] = torch.tensor(7, dtype=torch.int64)
    state["epoch"] = 3
    state["lr"] = 0.5
    return state


@pytest.mark.parametrize("runner", RUNNERS)
def test_round_trip(tmp_path: Path, runner: str) -> None:
    state = flat_state()
    src = tmp_path / "dcp"
    dcp_save(state, src)
    assert (src / ".metadata").exists() and list(src.glob("*.distcp"))
    ours = str(tmp_path / "ours")
    result = RUNNERS[runner]("convert", str(src), ours, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["source"]["format"] == "dcp"
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    with ckptfmt.open(ours) as ckpt:
        assert ckpt.profile == "weights"
        assert set(ckpt.tensor_names("weights")) == set(tensors)
        for name, tensor in tensors.items():
            assert_ckpt_tensor(ckpt, "weights", name, tensor)
        assert ckpt.read_context("weights") == {"epoch": 3, "lr": 0.5}
        assert ckpt.read_context("provenance")["converted_from"]["format"] == "dcp"
    assert run_cli("verify", ours).exit_code == 0

    back = tmp_path / "back"
    result = RUNNERS[runner]("convert", ours, str(back), "--to", "dcp")
    assert result.exit_code == 0, result.stderr
    target: dict[str, Any] = {k: torch.empty_like(v) for k, v in tensors.items()}
    target |= {"epoch": 0, "lr": 0.0}
    dcp_load(target, back)
    for name, tensor in tensors.items():
        assert_same_tensor(target[name], tensor)
    assert target["epoch"] == 3 and target["lr"] == 0.5


def test_nested_state_dict_uses_dotted_names(tmp_path: Path) -> None:
    inner = {"a": torch.arange(4.0), "b": {"c": torch.ones(2, 2, dtype=torch.int32)}}
    dcp_save({"outer": inner}, tmp_path / "dcp")
    ours = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "dcp"), ours, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(ours) as ckpt:
        assert sorted(ckpt.tensor_names("weights")) == ["outer.a", "outer.b.c"]
        assert_ckpt_tensor(ckpt, "weights", "outer.b.c", inner["b"]["c"])


def _metadata_with_chunks(src: Path) -> None:
    """Rewrite a one-chunk DCP tensor as two row chunks stored in a second file (as two ranks would)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    with (src / ".metadata").open("rb") as f:
        md = pickle.load(f)  # our own file, written just above by dcp.save
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    meta = md.state_dict_metadata["w"]
    meta.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3])),
        ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 3])),
    ]
    blob = bytearray()
    infos = []
    for start in (0, 2):
        import io

        buf = io.BytesIO()
        torch.save(full[start : start + 2].clone(), buf)
        infos.append(_StorageInfo("__1_0.distcp", len(blob), len(buf.getvalue())))
        blob += buf.getvalue()
    (src / "__1_0.distcp").write_bytes(bytes(blob))
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "w"}
    md.storage_data[MetadataIndex("w", torch.Size([0, 0]), 0)] = infos[0]
    md.storage_data[MetadataIndex("w", torch.Size([2, 0]), 1)] = infos[1]
    with (src / ".metadata").open("wb") as f:
        pickle.dump(md, f)


def test_chunked_tensor_keeps_its_chunks(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(4, 3)}, src)
    _metadata_with_chunks(src)
    ours = str(tmp_path / "ours")
    result = run_cli("convert", str(src), ours, "--to", "ckptfmt")
    assert result.exit_code == 0, result.stderr
    with ckptfmt.open(ours) as ckpt:
        record = ckpt.tensor("weights", "w")
        assert sorted(c.offsets for c in record.chunks) == [(0, 0), (2, 0)]
        assert_same_tensor(
            ckpt.read_tensor("weights", "w"), torch.arange(12, dtype=torch.float32).reshape(4, 3).numpy()
        )


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("runner", RUNNERS)
def test_malicious_metadata_is_refused_and_never_runs(tmp_path: Path, runner: str) -> None:
    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(2)}, src)
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    result = RUNNERS[runner]("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1
    error = result.json()["error"]
    assert error["code"] == "invalid_source" and "system" in error["message"]
    assert not marker.exists()
    assert not (tmp_path / "out" / "manifest.json").exists()
    # the same payload hidden inside genuine metadata, as a value of a dataclass field
    with (src / ".metadata").open("wb") as f:
        pickle.dump({"not": "metadata"}, f)
    assert run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt").exit_code == 1


def test_payload_inside_real_metadata_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(2)}, src)
    from torch.distributed.checkpoint.metadata import Metadata

    with (src / ".metadata").open("rb") as f:
        md: Metadata = pickle.load(f)  # our own file
    marker = tmp_path / "pwned"
    md.planner_data = Payload(str(marker))
    with (src / ".metadata").open("wb") as f:
        pickle.dump(md, f)
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "refused to unpickle" in result.stderr
    assert not marker.exists()


def test_storage_path_escaping_the_directory_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(2)}, src)
    with (src / ".metadata").open("rb") as f:
        md = pickle.load(f)  # our own file
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    with (src / ".metadata").open("wb") as f:
        pickle.dump(md, f)
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and "plain file name" in result.json()["error"]["message"]


def test_malicious_data_item_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    marker = tmp_path / "pwned"
    dcp_save({"w": torch.zeros(2), "obj": Payload(str(marker))}, src)
    assert not marker.exists()
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "invalid_source" in result.stderr
    assert not marker.exists()


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def _class_build(module: str, name: str, attribute: str) -> bytes:
    """A hand-made pickle: fetch an admitted class, then BUILD (None, {attribute: True}) against the class
    object itself, which a plain restricted unpickler turns into setattr(cls, attribute, True)."""
    return (
        b"\x80\x04"
        + _s(module)
        + _s(name)
        + b"\x93"  # STACK_GLOBAL
        + b"N}"  # NONE, EMPTY_DICT (the slot state)
        + _s(attribute)
        + b"\x88s"  # NEWTRUE, SETITEM
        + b"\x86b."  # TUPLE2, BUILD, STOP
    )


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("torch", "Size"),
    ],
)
def test_build_against_an_admitted_class_is_refused_and_the_class_is_unchanged(
    tmp_path: Path, module: str, name: str
) -> None:
    import importlib

    from ckptfmt.convert.dcp_metadata import parse_metadata
    from ckptfmt.errors import SourceFormatError

    cls = getattr(importlib.import_module(module), name)
    attribute = "ckptfmt_tampered"
    with pytest.raises(SourceFormatError):
        parse_metadata(_class_build(module, name, attribute))
    assert not hasattr(cls, attribute)
    # and through the CLI, inside a DCP directory
    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(2)}, src)
    (src / ".metadata").write_bytes(_class_build(module, name, attribute))
    result = run_cli("convert", str(src), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and result.json()["error"]["code"] == "invalid_source"
    assert not hasattr(cls, attribute)


def test_build_against_a_memoized_class_inside_real_metadata_leaves_it_unchanged(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from ckptfmt.convert.dcp_metadata import parse_metadata

    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(2)}, src)
    data = (src / ".metadata").read_bytes()
    assert data.endswith(b".")
    # after the genuine object: fetch memo 2 (the Metadata class, as dcp.save memoizes it), BUILD, POP it
    tail = b"h\x02N}" + _s("ckptfmt_tampered") + b"\x88s\x86b0."
    try:
        parse_metadata(data[:-1] + tail)
    except Exception as exc:  # refusing is fine; what matters is the class
        assert type(exc).__module__.startswith("ckptfmt"), exc
    assert not hasattr(Metadata, "ckptfmt_tampered")


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02(c__main__\nX\ni." + b"",  # INST: an old-style call
        b"\x80\x02\x82\x01.",  # EXT1: the copyreg extension registry
        b"\x80\x02(X\x01\x00\x00\x00ao.",  # OBJ
        b"\x80\x02X\x01\x00\x00\x00aQ.",  # BINPERSID
    ],
)
def test_opcodes_outside_the_allow_list_are_refused(payload: bytes) -> None:
    from ckptfmt.convert.dcp_metadata import parse_metadata
    from ckptfmt.errors import SourceFormatError

    with pytest.raises(SourceFormatError, match=r"opcode|readable"):
        parse_metadata(payload)


def _edited_metadata(src: Path, edit: Any) -> bytes:
    with (src / ".metadata").open("rb") as f:
        md = pickle.load(f)  # our own file, written by dcp.save
    edit(md)
    return pickle.dumps(md)


@pytest.mark.parametrize(
    "edit",
    [
        lambda md: setattr(md.state_dict_metadata["w"], "size", "4x3"),
        lambda md: setattr(md.state_dict_metadata["w"], "chunks", None),
        lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", [0.5]),
        lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", [-1]),
        lambda md: setattr(md.state_dict_metadata["w"], "properties", 3),
        lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"),
        lambda md: setattr(md, "state_dict_metadata", [1, 2]),
        lambda md: setattr(md, "storage_data", {1: 2}),
        lambda md: [setattr(v, "offset", "0") for v in md.storage_data.values()],
        lambda md: [setattr(v, "relative_path", 7) for v in md.storage_data.values()],
        lambda md: [object.__setattr__(k, "fqn", 7) for k in md.storage_data],
        lambda md: md.state_dict_metadata.update({"x": 5}),
        lambda md: md.state_dict_metadata.update({7: md.state_dict_metadata["w"]}),
        lambda md: setattr(md, "state_dict_metadata", {"w": [[[[[[]]]]]] * 3}),
    ],
)
def test_wrong_field_types_are_a_source_format_error(tmp_path: Path, edit: Any) -> None:
    from ckptfmt.convert.dcp_metadata import parse_metadata
    from ckptfmt.errors import SourceFormatError

    src = tmp_path / "dcp"
    dcp_save({"w": torch.zeros(4, 3)}, src)
    with pytest.raises(SourceFormatError):
        parse_metadata(_edited_metadata(src, edit))


def test_deeply_nested_metadata_is_refused_cleanly() -> None:
    from ckptfmt.convert.dcp_metadata import parse_metadata
    from ckptfmt.errors import SourceFormatError

    with pytest.raises(SourceFormatError):
        parse_metadata(b"\x80\x04" + b"]" * 200_000 + b".")
