"""ckpt inspect: the summary, the --json shape, tensor listing, incomplete and broken checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, edit_manifest, keys_of, run_cli, write_training

DOC_KEYS = (
    "url", "status", "checkpoint_id", "format_version", "profile", "step", "created_at", "code_commit",
    "metadata", "total_bytes", "file_count", "fields", "context",
)  # fmt: skip
FIELD_KEYS = ("kind", "files", "bytes", "tensors", "dtypes", "context")
TENSOR_KEYS = ("field", "name", "dtype", "shape", "bytes", "chunks")


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    url = str(tmp_path / "ckpt")
    write_training(url, step=1234)
    return url


@pytest.mark.parametrize("runner", RUNNERS)
def test_json_shape(ckpt: str, runner: str) -> None:
    run = RUNNERS[runner]("inspect", ckpt, "--json")
    assert run.exit_code == 0, run.stderr
    doc = run.json()
    keys_of(doc, DOC_KEYS)
    assert "tensors" not in doc
    assert doc["status"] == "committed" and doc["profile"] == "training" and doc["format_version"] == "1.3"
    assert doc["step"] == 1234 and doc["code_commit"] == "abc123" and doc["created_at"] == "2026-01-02T03:04:05Z"
    assert doc["checkpoint_id"].startswith("sha256:")
    assert set(doc["fields"]) == {"weights", "optimizer", "rng", "data", "config", "topology", "provenance"}
    for record in doc["fields"].values():
        keys_of(record, FIELD_KEYS)
    assert doc["fields"]["weights"]["dtypes"] == ["BF16", "F32", "I64"]
    assert doc["fields"]["weights"]["tensors"] == 3
    ctx = doc["context"]
    assert ctx["rng"] == {"generators": {"np": "numpy.bit_generator"}}
    assert ctx["data"] == {"epoch": 1, "global_sample_offset": 4096}
    assert ctx["topology"] == {"world_size": 1, "mesh": {"dims": ["dp"], "shape": [1]}}
    assert ctx["config"]["hash"].startswith("sha256:") and ctx["config"]["keys"] == ["lr", "model", "seed"]
    assert ctx["optimizer"] == {"keys": ["param_groups"]}


def test_human_summary(ckpt: str) -> None:
    run = run_cli("inspect", ckpt)
    assert run.exit_code == 0
    for text in ("profile training", "step         1234", "abc123", "FIELD", "optimizer", "world_size=1", "numpy"):
        assert text in run.stdout
    assert run.stderr == ""


def test_tensor_listing_and_glob(ckpt: str) -> None:
    doc = run_cli("inspect", ckpt, "--tensors", "--json").json()
    assert len(doc["tensors"]) == 4
    for t in doc["tensors"]:
        keys_of(t, TENSOR_KEYS)
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["layer0.w.exp_avg"] == {
        "field": "optimizer", "name": "layer0.w.exp_avg", "dtype": "F32", "shape": [6, 4], "bytes": 96, "chunks": 2,
    }  # fmt: skip
    assert by_name["count"]["shape"] == []
    only = run_cli("inspect", ckpt, "--match", "layer0.*", "--json").json()["tensors"]
    assert sorted(t["name"] for t in only) == ["layer0.b", "layer0.w", "layer0.w.exp_avg"]
    by_field = run_cli("inspect", ckpt, "--match", "optimizer/*", "--json").json()["tensors"]
    assert [t["name"] for t in by_field] == ["layer0.w.exp_avg"]
    human = run_cli("inspect", ckpt, "--tensors").stdout
    assert "layer0.w.exp_avg" in human and "6x4" in human


def test_incomplete_checkpoint_is_reported_not_a_crash(ckpt: str) -> None:
    (Path(ckpt) / "manifest.json").unlink()
    (Path(ckpt) / ".writer-lock").write_text('{"host": "h", "pid": 42, "started_at": "2026-01-01T00:00:00Z"}')
    run = run_cli("inspect", ckpt, "--json")
    assert run.exit_code == 1
    doc = run.json()
    keys_of(doc, ("url", "status", "message", "total_bytes", "files", "writer_lock"))
    assert doc["status"] == "incomplete" and doc["writer_lock"]["pid"] == 42
    assert {
        "path": "weights/r00000-00000.safetensors",
        "size": Path(ckpt, "weights/r00000-00000.safetensors").stat().st_size,
    } in doc["files"]
    human = run_cli("inspect", ckpt)
    assert human.exit_code == 1 and human.stdout.startswith("INCOMPLETE") and "pid 42" in human.stdout


def test_invalid_manifest_is_an_error_with_code(ckpt: str) -> None:
    edit_manifest(ckpt, lambda doc: doc.update(format_version="2.0"))
    run = run_cli("inspect", ckpt, "--json")
    assert run.exit_code == 1
    assert run.json()["error"]["code"] == "unsupported_version"
    assert "unsupported_version" in run.stderr


def test_unreadable_context_is_shown_and_fails(ckpt: str) -> None:
    path = Path(ckpt) / "data" / "context.msgpack"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    run = run_cli("inspect", ckpt, "--json")
    assert run.exit_code == 1
    assert run.json()["context"]["data"]["error"]["code"] == "digest_mismatch"
    assert "UNREADABLE" in run_cli("inspect", ckpt).stdout


def test_not_found_exit_2(tmp_path: Path) -> None:
    run = run_cli("inspect", str(tmp_path / "nope"))
    assert run.exit_code == 2 and run.stdout == "" and "not_found" in run.stderr


def test_storage_option_parsing_errors_are_usage_errors(ckpt: str) -> None:
    run = run_cli("inspect", ckpt, "--storage-option", "novalue")
    assert run.exit_code == 2 and "KEY=VALUE" in run.stderr


def test_memory_url_with_storage_options(tmp_path: Path) -> None:
    url = "memory://cli-inspect-test/ckpt"
    write_training(url)
    run = run_cli("inspect", url, "--json", "--storage-option", "skip_instance_cache=true")
    assert run.exit_code == 0, run.stderr
    assert run.json()["url"] == url


def test_a_referencing_checkpoint_shows_its_bases_and_referenced_bytes(tmp_path: Path) -> None:
    import numpy as np

    import ckptfmt

    arrays = {"frozen": np.ones((256, 256), np.float32), "adapter": np.zeros((4, 4), np.float32)}
    with ckptfmt.open_writer(tmp_path / "step-1", profile="weights") as w:
        w.write_tensors("weights", arrays)
    with ckptfmt.open_writer(tmp_path / "step-2", profile="weights", base=tmp_path / "step-1") as w:
        w.write_tensors("weights", {**arrays, "adapter": arrays["adapter"] + 1})
    run = run_cli("inspect", str(tmp_path / "step-2"), "--json")
    assert run.exit_code == 0, run.stderr
    doc = run.json()
    assert doc["referenced_bytes"] == arrays["frozen"].nbytes
    assert [b["location"] for b in doc["bases"]] == ["../step-1"]
    assert doc["fields"]["weights"]["referenced_bytes"] == arrays["frozen"].nbytes
    assert doc["fields"]["weights"]["bytes"] < 1024  # the adapter's file alone
    text = run_cli("inspect", str(tmp_path / "step-2")).stdout
    assert "referenced   256.0 KiB stored in its bases" in text and "base         ../step-1 (sha256:" in text
