"""ckpt diff: identical checkpoints exit 0; added, removed and changed tensors and context keys exit 1."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import PROVENANCE, RUNNERS, keys_of, run_cli, write_training

DOC_KEYS = ("a", "b", "identical", "fields", "tensors", "context", "metadata")
CHANGE_KEYS = ("field", "name", "dtype", "shape", "bytes", "max_abs_diff", "different_elements", "nonfinite_mismatches")


def weights(url: str, tensors: dict[str, np.ndarray], **provenance: object) -> str:
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensors("weights", tensors)
        w.write_context("provenance", {**PROVENANCE, **provenance})
    return url


@pytest.mark.parametrize("runner", RUNNERS)
def test_identical_exit_0(tmp_path: Path, runner: str) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b, target_file_size=64)  # other files, same content
    result = RUNNERS[runner]("diff", a, b, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    keys_of(doc, DOC_KEYS)
    assert doc["identical"] is True
    assert run_cli("diff", a, b).stdout.startswith("identical")


def test_changed_tensor_reports_max_abs_diff(tmp_path: Path) -> None:
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = x.copy()
    y[5, 3] += 0.5
    y[0, 0] -= 2.0
    bf = np.ones(3, dtype=ml_dtypes.bfloat16)
    a = weights(str(tmp_path / "a"), {"x": x, "i": np.arange(3), "gone": x, "bf": bf})
    b = weights(str(tmp_path / "b"), {"x": y, "i": np.arange(3) + 1, "new": x, "bf": bf * 2})
    result = run_cli("diff", a, b, "--json")
    assert result.exit_code == 1
    doc = result.json()
    assert doc["identical"] is False
    assert doc["tensors"]["added"] == [{"field": "weights", "name": "new"}]
    assert doc["tensors"]["removed"] == [{"field": "weights", "name": "gone"}]
    changed = {c["name"]: c for c in doc["tensors"]["changed"]}
    for c in changed.values():
        keys_of(c, CHANGE_KEYS)
    assert changed["x"]["max_abs_diff"] == 2.0 and changed["x"]["different_elements"] == 2
    assert changed["i"]["max_abs_diff"] is None and changed["i"]["different_elements"] == 3
    assert changed["bf"]["max_abs_diff"] == 1.0
    human = run_cli("diff", a, b).stdout
    assert "~ tensor weights/x" in human and "max abs diff 2" in human and "+ tensor weights/new" in human


def test_dtype_and_shape_changes_and_nan(tmp_path: Path) -> None:
    x = np.zeros((2, 2), dtype=np.float32)
    nan = x.copy()
    nan[0, 0] = np.nan
    a = weights(str(tmp_path / "a"), {"d": x, "s": x, "n": x, "nn": nan})
    b = weights(str(tmp_path / "b"), {"d": x.astype(np.float64), "s": x.reshape(4), "n": nan, "nn": nan})
    changed = {c["name"]: c for c in run_cli("diff", a, b, "--json").json()["tensors"]["changed"]}
    assert changed["d"]["dtype"] == ["F32", "F64"]
    assert changed["s"]["shape"] == [[2, 2], [4]]
    assert changed["n"]["nonfinite_mismatches"] == 1 and changed["n"]["different_elements"] == 1
    assert "nn" not in changed


def test_context_keys_and_ignore(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a, step=100)
    write_training(b, step=200)
    doc = run_cli("diff", a, b, "--json").json()
    assert {"field": "provenance", "key": "step", "change": "changed"} in doc["context"]
    assert run_cli("diff", a, b, "--ignore", "provenance").exit_code == 0
    assert run_cli("diff", a, b, "--ignore", "provenance.step").exit_code == 0
    assert run_cli("diff", a, b, "--ignore", "provenance.code.*").exit_code == 1


def test_field_added(tmp_path: Path) -> None:
    a = weights(str(tmp_path / "a"), {"x": np.zeros(2)})
    b = str(tmp_path / "b")
    with ckptfmt.open_writer(b, profile="weights") as w:
        w.write_tensors("weights", {"x": np.zeros(2)})
        w.write_context("provenance", PROVENANCE)
        w.write_context("extra", {"k": 1})
    doc = run_cli("diff", a, b, "--json").json()
    assert doc["fields"]["added"] == ["extra"]


def test_large_tensor_compared_in_row_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfmt.cli import checkpoint_diff

    monkeypatch.setattr(checkpoint_diff, "BLOCK_BYTES", 64)  # 4 rows of 4 float32 per block
    x = np.random.default_rng(0).standard_normal((37, 4)).astype(np.float32)
    y = x.copy()
    y[36, 1] += 3.0
    y[3, 2] -= 1.0
    a = weights(str(tmp_path / "a"), {"x": x})
    b = weights(str(tmp_path / "b"), {"x": y})
    [change] = run_cli("diff", a, b, "--json").json()["tensors"]["changed"]
    assert change["different_elements"] == 2
    assert change["max_abs_diff"] == pytest.approx(float(np.float64(y[36, 1]) - np.float64(x[36, 1])))


def test_missing_checkpoint_exit_2(tmp_path: Path) -> None:
    a = weights(str(tmp_path / "a"), {"x": np.zeros(2)})
    assert run_cli("diff", a, str(tmp_path / "none")).exit_code == 2


def _flip_first_chunk_byte(url: str, field: str, tensor: str) -> str:
    """Flip one byte inside a tensor's stored bytes (the manifest still lists the old digest)."""
    with ckptfmt.open(url) as c:
        chunk = c.tensor(field, tensor).chunks[0]
    path = Path(url, chunk.path)
    data = bytearray(path.read_bytes())
    data[chunk.begin] ^= 0x01
    path.write_bytes(bytes(data))
    return chunk.path


@pytest.mark.parametrize("corrupt_side", ["a", "b"])
def test_flipped_byte_with_matching_digests_is_a_problem_not_identical(tmp_path: Path, corrupt_side: str) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b)
    bad = a if corrupt_side == "a" else b
    data_file = _flip_first_chunk_byte(bad, "weights", "layer0.w")
    result = run_cli("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout
    doc = result.json()
    assert doc["identical"] is False and doc["compared"] == "bytes"
    [problem] = doc["problems"]
    assert problem["side"] == corrupt_side and problem["code"] == "digest_mismatch"
    assert (problem["path"], problem["field"], problem["tensor"]) == (data_file, "weights", "layer0.w")
    human = run_cli("diff", a, b)
    assert human.exit_code == 1 and "corrupt" in human.stdout and "layer0.w" in human.stdout


def test_corruption_on_both_sides_reports_both(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b)
    _flip_first_chunk_byte(a, "optimizer", "layer0.w.exp_avg")
    _flip_first_chunk_byte(b, "optimizer", "layer0.w.exp_avg")
    doc = run_cli("diff", a, b, "--json").json()
    assert sorted(p["side"] for p in doc["problems"]) == ["a", "b"]


def test_corrupt_tensor_of_changed_shape_is_still_reported(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32)
    a = weights(str(tmp_path / "a"), {"x": x})
    b = weights(str(tmp_path / "b"), {"x": x.reshape(2, 3)})
    _flip_first_chunk_byte(b, "weights", "x")
    doc = run_cli("diff", a, b, "--json").json()
    assert [(p["side"], p["tensor"]) for p in doc["problems"]] == [("b", "x")]


def test_corrupt_context_blob_is_a_problem(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b)
    with ckptfmt.open(b) as c:
        blob = c.field("data").context
    assert blob is not None
    path = Path(b, blob)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    result = run_cli("diff", a, b, "--json")
    assert result.exit_code == 1
    assert [(p["side"], p["field"]) for p in result.json()["problems"]] == [("b", "data")]


def test_digests_only_says_so_and_skips_reading(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b)
    _flip_first_chunk_byte(b, "weights", "layer0.w")
    result = run_cli("diff", a, b, "--digests-only", "--json")
    doc = result.json()
    assert doc["compared"] == "digests" and "bytes not read" in doc["note"]
    assert doc["identical"] is True and result.exit_code == 0  # what --digests-only promises, and no more
    human = run_cli("diff", a, b, "--digests-only").stdout
    assert "bytes not read" in human and "ckpt verify" in human


def test_identical_checkpoints_are_proven_by_one_verify_pass_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each side is verified once (every byte hashed against the file and chunk digests); matching chunk digests
    then prove matching bytes, so no tensor is read again."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_training(a)
    write_training(b)
    calls: list[tuple[int, ...]] = []
    original = ckptfmt.Checkpoint.read_slice

    def counting(
        self: ckptfmt.Checkpoint, field: str, name: str, offsets: object, shape: object, **kw: object
    ) -> object:
        calls.append(tuple(offsets))  # type: ignore[arg-type]
        return original(self, field, name, offsets, shape, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ckptfmt.Checkpoint, "read_slice", counting)
    assert run_cli("diff", a, b, "--json").exit_code == 0
    assert calls == []
