"""ckpt gc: retention and crash remains, by the same rules as ckpt ls and the CheckpointManager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, run_cli
from run_helpers import dead_pid, live_process, lock_of, write_remains, write_step

from ckptfmt.run import RunDirectory, checkpoint_name


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for step in (100, 200, 300, 400):
        write_step(root, step)
    write_remains(root, checkpoint_name(500), lock_of(dead_pid()))
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("not a checkpoint")
    return root


def children(run: Path) -> set[str]:
    return {p.name for p in run.iterdir() if p.is_dir()}


@pytest.mark.parametrize("runner", RUNNERS)
def test_keep_last_json(run: Path, runner: str) -> None:
    result = RUNNERS[runner]("gc", str(run), "--keep-last", "2", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["url"] == str(run) and doc["dry_run"] is False
    assert [(d["name"], d["status"]) for d in doc["deleted"]] == [
        (checkpoint_name(500), "incomplete"),
        (checkpoint_name(200), "committed"),
        (checkpoint_name(100), "committed"),
    ]
    assert [k["name"] for k in doc["kept"]] == [checkpoint_name(400), checkpoint_name(300)]
    assert children(run) == {checkpoint_name(400), checkpoint_name(300), "logs"}


def test_dry_run_deletes_nothing(run: Path) -> None:
    before = children(run)
    result = run_cli("gc", str(run), "--keep-last", "1", "--dry-run")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["would", "delete", checkpoint_name(s)] for s in (500, 300, 200, 100)
    ]
    assert "(incomplete," in lines[0] and all("(committed," in line for line in lines[1:])
    assert "4 checkpoint(s) would delete" in result.stderr and "1 kept" in result.stderr
    assert children(run) == before


def test_without_keep_last_only_crash_remains_go(run: Path) -> None:
    result = run_cli("gc", str(run), "--json")
    assert result.exit_code == 0
    assert [d["name"] for d in result.json()["deleted"]] == [checkpoint_name(500)]
    assert children(run) == {checkpoint_name(s) for s in (100, 200, 300, 400)} | {"logs"}


def test_keep_every_pins_and_latest(run: Path) -> None:
    rd = RunDirectory(run)
    rd.set_pinned([checkpoint_name(100)])
    rd.set_latest(checkpoint_name(300), 300, "sha256:" + "0" * 64)
    result = run_cli("gc", str(run), "--keep-last", "1", "--keep-every", "200", "--json")
    assert result.exit_code == 0
    assert [d["name"] for d in result.json()["deleted"]] == [checkpoint_name(500)]
    assert [k["name"] for k in result.json()["kept"]] == [checkpoint_name(s) for s in (400, 300, 200, 100)]


def test_live_writer_is_kept_and_ls_agrees(run: Path) -> None:
    with live_process() as pid:
        write_remains(run, checkpoint_name(600), lock_of(pid))
        listed = {e["name"]: e["status"] for e in run_cli("ls", str(run), "--json").json()["checkpoints"]}
        assert listed[checkpoint_name(600)] == "writing" and listed[checkpoint_name(500)] == "incomplete"
        plan = run_cli("gc", str(run), "--keep-last", "4", "--dry-run", "--json").json()
        # what ls calls incomplete is what gc deletes; what it calls writing, gc keeps
        assert [d["name"] for d in plan["deleted"]] == [n for n, s in listed.items() if s == "incomplete"]
        result = run_cli("gc", str(run), "--keep-last", "4", "--json")
        assert checkpoint_name(600) in [k["name"] for k in result.json()["kept"]]
        assert (run / checkpoint_name(600) / ".writer-lock").exists()


def test_usage_errors(run: Path, tmp_path: Path) -> None:
    assert run_cli("gc", str(tmp_path / "nothing")).exit_code == 2
    result = run_cli("gc", str(run / checkpoint_name(100)), "--json")
    assert result.exit_code == 2 and result.json()["error"]["code"] == "usage"
    assert run_cli("gc", str(run), "--keep-last", "0").exit_code == 2


def test_fsspec_run_directory() -> None:
    import uuid

    import numpy as np

    import ckptfmt

    url = f"memory://cli-gc-{uuid.uuid4().hex}/run"
    for step in (1, 2, 3):
        with ckptfmt.open_writer(f"{url}/{checkpoint_name(step)}", profile="weights") as w:
            w.write_tensors("weights", {"w": np.zeros(2, np.float32)})
            w.write_context("provenance", {"step": step})
    result = run_cli("gc", url, "--keep-last", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert [d["name"] for d in result.json()["deleted"]] == [checkpoint_name(2), checkpoint_name(1)]
    assert [e.name for e in RunDirectory(url).entries()] == [checkpoint_name(3)]
