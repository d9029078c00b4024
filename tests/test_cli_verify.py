"""ckpt verify: every kind of damage is found, all of it is reported, exit codes are right."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, data_file, edit_manifest, flip_byte, keys_of, run_cli, write_training

REPORT_KEYS = ("url", "checkpoint_id", "ok", "quick", "files_checked", "bytes_checked", "chunks_checked", "problems")


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    url = str(tmp_path / "ckpt")
    write_training(url)
    return url


def codes(url: str, *extra: str) -> tuple[int, list[str]]:
    run = run_cli("verify", url, "--json", *extra)
    doc = run.json()
    keys_of(doc, REPORT_KEYS)
    return run.exit_code, [p["code"] for p in doc["problems"]]


@pytest.mark.parametrize("runner", RUNNERS)
def test_valid_checkpoint_exits_0(ckpt: str, runner: str) -> None:
    run = RUNNERS[runner]("verify", ckpt)
    assert run.exit_code == 0, run.stderr
    assert run.stdout.startswith("OK")
    doc = RUNNERS[runner]("verify", ckpt, "--json").json()
    keys_of(doc, REPORT_KEYS)
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["bytes_checked"] == sum(
        p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file() and p.name != "manifest.json"
    )
    assert doc["chunks_checked"] == 5  # 3 weights + 2 optimizer chunks


def test_flipped_byte(ckpt: str) -> None:
    flip_byte(data_file(ckpt, "weights"))
    code, found = codes(ckpt)
    assert code == 1
    assert "digest_mismatch" in found


def test_every_problem_is_reported_not_just_the_first(ckpt: str) -> None:
    flip_byte(data_file(ckpt, "weights"))
    flip_byte(data_file(ckpt, "optimizer"))
    (Path(ckpt) / "data" / "context.msgpack").unlink()
    run = run_cli("verify", ckpt, "--json")
    problems = run.json()["problems"]
    assert run.exit_code == 1
    assert {p["field"] for p in problems if p["code"] == "digest_mismatch"} == {"weights", "optimizer"}
    assert any(p["code"] == "missing_file" and p["path"] == "data/context.msgpack" for p in problems)
    human = run_cli("verify", ckpt)
    assert human.exit_code == 1 and human.stdout.startswith("INVALID")
    assert human.stdout.count("[digest_mismatch]") >= 2 and "[missing_file]" in human.stdout


def test_truncated_file(ckpt: str) -> None:
    path = data_file(ckpt, "weights")
    path.write_bytes(path.read_bytes()[:-5])
    code, found = codes(ckpt)
    assert code == 1 and found == ["size_mismatch"]
    assert codes(ckpt, "--quick") == (1, ["size_mismatch"])


def test_quick_checks_sizes_and_structure_without_hashing(ckpt: str) -> None:
    flip_byte(data_file(ckpt, "weights"))
    doc = run_cli("verify", ckpt, "--quick", "--json").json()
    assert doc["ok"] is True and doc["quick"] is True and doc["bytes_checked"] == 0


def test_missing_file(ckpt: str) -> None:
    data_file(ckpt, "optimizer").unlink()
    code, found = codes(ckpt)
    assert code == 1 and found == ["missing_file"]


def test_missing_required_field(ckpt: str) -> None:
    def drop_rng(doc: dict[str, Any]) -> None:
        path = doc["fields"].pop("rng")["context"]["path"]
        doc["files"] = [f for f in doc["files"] if f["path"] != path]

    edit_manifest(ckpt, drop_rng)
    code, found = codes(ckpt)
    assert code == 1 and found == ["missing_field"]


def test_missing_manifest_is_incomplete(ckpt: str) -> None:
    (Path(ckpt) / "manifest.json").unlink()
    code, found = codes(ckpt)
    assert code == 1 and found == ["incomplete"]
    assert "no manifest" in run_cli("verify", ckpt).stdout


def _move_second_chunk(doc: dict[str, Any], row: int, global_rows: int) -> None:
    tensor = doc["fields"]["optimizer"]["tensors"]["layer0.w.exp_avg"]
    tensor["shape"] = [global_rows, 4]
    second = max(tensor["chunks"], key=lambda c: c["offsets"][0])
    second["offsets"] = [row, 0]


def test_overlapping_chunks(ckpt: str) -> None:
    edit_manifest(ckpt, lambda doc: _move_second_chunk(doc, row=2, global_rows=6))
    run = run_cli("verify", ckpt, "--json")
    assert run.exit_code == 1
    [problem] = run.json()["problems"]
    assert problem["code"] == "chunk_layout" and "overlap" in problem["message"]


def test_gapped_chunks(ckpt: str) -> None:
    edit_manifest(ckpt, lambda doc: _move_second_chunk(doc, row=4, global_rows=7))
    run = run_cli("verify", ckpt, "--json")
    assert run.exit_code == 1
    [problem] = run.json()["problems"]
    assert problem["code"] == "chunk_layout" and "gap" in problem["message"]


def test_nothing_there_is_a_usage_error(tmp_path: Path) -> None:
    run = run_cli("verify", str(tmp_path / "nothing"), "--json")
    assert run.exit_code == 2
    assert run.json()["error"]["code"] == "not_found"
    assert "not_found" in run.stderr


def test_no_progress_bar_when_stderr_is_not_a_terminal(ckpt: str) -> None:
    run = run_cli("verify", ckpt)
    assert run.stderr == ""


def test_progress_bar_on_a_terminal_goes_to_stderr_and_quiet_silences_it(
    ckpt: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptfmt.cli.verify import run_verify

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    report = run_verify(ckpt, {}, quick=False, quiet=False)
    err = capsys.readouterr().err
    assert report.ok and "verify [" in err and "100%" in err
    run_verify(ckpt, {}, quick=False, quiet=True)
    assert capsys.readouterr().err == ""


def test_fsspec_url() -> None:
    import uuid

    url = f"memory://cli-verify-{uuid.uuid4().hex}/ckpt"
    write_training(url)
    assert run_cli("verify", url).exit_code == 0
    import fsspec

    fs = fsspec.filesystem("memory")
    path = url.removeprefix("memory://") + "/weights/r00000-00000.safetensors"
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 1
    fs.pipe_file(path, bytes(data))
    code, found = codes(url)
    assert code == 1 and "digest_mismatch" in found
