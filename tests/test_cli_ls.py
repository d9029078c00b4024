"""ckpt ls: the checkpoints of a run directory, their status, newest first."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, edit_manifest, keys_of, run_cli, write_training

ENTRY_KEYS = ("name", "url", "step", "created", "size", "status", "checkpoint_id", "profile", "error")


def dead_writer_lock() -> dict[str, object]:
    """The lock a writer on this host leaves when it is killed: its pid no longer runs."""
    pid = subprocess.Popen([sys.executable, "-c", "pass"])
    pid.wait()
    return {"host": socket.gethostname(), "pid": pid.pid, "nonce": "0", "started_at": "2026-01-02T03:04:05Z"}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    write_training(str(run / "ckpt-a"), step=100)
    write_training(str(run / "ckpt-b"), step=200)
    edit_manifest(str(run / "ckpt-b"), lambda d: None)  # rewritten, still valid
    # a crashed writer: files, a lock, no manifest; the step comes from the name
    crashed = run / "step_000300"
    (crashed / "weights").mkdir(parents=True)
    (crashed / "weights" / "r00000-00000.safetensors").write_bytes(b"x" * 10)
    (crashed / ".writer-lock").write_text(json.dumps(dead_writer_lock()))
    # a committed checkpoint whose manifest is broken
    write_training(str(run / "broken-400"), step=400)
    (run / "broken-400" / "manifest.json").write_text("{not json")
    # neither a checkpoint nor an attempt at one: left out
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("hello")
    (run / "notes.txt").write_text("ignored")
    now = 1_800_000_000
    for name, age in (("step_000300", 0), ("broken-400", 10)):
        for path in (run / name).rglob("*"):
            os.utime(path, (now - age, now - age))
    return run


@pytest.mark.parametrize("runner", RUNNERS)
def test_json_lists_newest_first_with_status(run_dir: Path, runner: str) -> None:
    result = RUNNERS[runner]("ls", str(run_dir), "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["url"] == str(run_dir)
    entries = doc["checkpoints"]
    for e in entries:
        keys_of(e, ENTRY_KEYS)
    by_name = {e["name"]: e for e in entries}
    assert set(by_name) == {"ckpt-a", "ckpt-b", "step_000300", "broken-400"}
    assert by_name["ckpt-a"]["status"] == "committed" and by_name["ckpt-a"]["step"] == 100
    assert by_name["ckpt-b"]["step"] == 200 and by_name["ckpt-b"]["profile"] == "training"
    assert by_name["step_000300"]["status"] == "incomplete" and by_name["step_000300"]["step"] == 300
    assert by_name["broken-400"]["status"] == "invalid manifest" and by_name["broken-400"]["step"] == 400
    assert by_name["broken-400"]["error"]["code"] == "invalid_manifest"
    assert by_name["step_000300"]["size"] == 10 + (run_dir / "step_000300" / ".writer-lock").stat().st_size
    # the committed ones carry the provenance time (2026-01-02), the others their files' mtime (2027)
    assert [e["name"] for e in entries] == ["step_000300", "broken-400", "ckpt-b", "ckpt-a"]


def test_table(run_dir: Path) -> None:
    result = run_cli("ls", str(run_dir))
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "CREATED", "SIZE", "STATUS"]
    assert "invalid manifest" in result.stdout and "incomplete" in result.stdout
    assert "logs" not in result.stdout


def test_the_last_restore_is_shown_with_what_memory_held(run_dir: Path) -> None:
    from ckptfmt.run import RunDirectory

    report = {
        "step": 5,
        "tier": "memory",
        "seconds": 0.25,
        "bytes_between_nodes": 2048,
        "phases": {"apply": 0.1, "agree": 0.05, "read": 0.05, "gather": 0.05},
        "skipped": ["memory step 6 (sha256:ab): DigestMismatchError: file 'weights/r00002-00000.safetensors'"],
        "held": [
            {"node": "A", "kind": "slot", "step": 5, "checkpoint_id": "sha256:cd", "files": 12, "bytes": 4096},
            {"node": "A", "kind": "peer", "step": 5, "checkpoint_id": "sha256:cd", "files": 2, "bytes": 1024},
            {"node": "B", "step": 5, "checkpoint_id": "sha256:cd", "ranks": [[-1, 3], [5, 6]]},
        ],
        "ranks": [{"tier": "memory"}, {"tier": "peer"}],
    }
    RunDirectory(str(run_dir)).record_restore(report)
    out = run_cli("ls", str(run_dir)).stdout
    assert "last restore: step 5 from memory+peer on 2 rank(s), 2.0 KiB between nodes" in out
    assert "(agree 0.050 s, gather 0.050 s, read 0.050 s, apply 0.100 s)" in out
    assert "passed over: memory step 6" in out and "step 5: node A peer, 2 file(s), 1.0 KiB" in out
    assert "step 5: node B writer ranks unnamed files, 0-2, 5" in out
    doc = run_cli("ls", str(run_dir), "--json").json()
    assert doc["last_restore"]["held"][1]["kind"] == "peer"
    assert [e["name"] for e in doc["checkpoints"]].count("last-restore.json") == 0  # a record, not a checkpoint


def test_a_checkpoint_is_not_a_run_directory(run_dir: Path) -> None:
    result = run_cli("ls", str(run_dir / "ckpt-a"), "--json")
    assert result.exit_code == 2 and result.json()["error"]["code"] == "usage"


def test_missing_run_directory(tmp_path: Path) -> None:
    assert run_cli("ls", str(tmp_path / "nothing")).exit_code == 2


def test_fsspec_run_directory() -> None:
    import uuid

    run = f"memory://cli-ls-{uuid.uuid4().hex}/run"
    write_training(f"{run}/step_1", step=1)
    write_training(f"{run}/step_2", step=2)
    result = run_cli("ls", run, "--json")
    assert result.exit_code == 0, result.stderr
    entries = result.json()["checkpoints"]
    assert [(e["name"], e["status"], e["step"]) for e in entries] == [
        ("step_2", "committed", 2),
        ("step_1", "committed", 1),
    ]
