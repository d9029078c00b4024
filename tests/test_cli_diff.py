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
    from ckptfmt.cli import compare

    monkeypatch.setattr(compare, "BLOCK_BYTES", 64)  # 4 rows of 4 float32 per block
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
