"""RunDirectory: which children are checkpoints, their status, the latest pointer, pins, retention and gc."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from run_helpers import dead_pid, live_process, lock_of, write_remains, write_step

from ckptfmt.run import RunDirectory, checkpoint_name


def names(entries: list[object]) -> list[str]:
    return [e.name for e in entries]  # type: ignore[attr-defined]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Six committed checkpoints, steps 10..60."""
    root = tmp_path / "run"
    for step in (10, 20, 30, 40, 50, 60):
        write_step(root, step)
    return root


def test_entries_status_and_order(run: Path) -> None:
    write_remains(run, checkpoint_name(70), lock_of(dead_pid()))
    with live_process() as pid:
        write_remains(run, checkpoint_name(80), lock_of(pid))
        write_remains(run, checkpoint_name(90), None)  # a crash between abort's deletes: no lock left
        write_step(run, 5, name="odd-5")
        (run / "odd-5" / "manifest.json").write_text("{not json")
        (run / "logs").mkdir()
        (run / "logs" / "train.log").write_text("not a checkpoint")
        entries = RunDirectory(run).entries()
        status = {e.name: e.status for e in entries}
    assert names(entries)[:3] == [checkpoint_name(s) for s in (90, 80, 70)]  # newest step first
    assert status[checkpoint_name(80)] == "writing"
    assert status[checkpoint_name(70)] == status[checkpoint_name(90)] == "incomplete"
    assert status["odd-5"] == "invalid manifest"
    assert "logs" not in status
    committed = next(e for e in entries if e.name == checkpoint_name(60))
    assert committed.status == "committed" and committed.step == 60 and committed.profile == "weights"
    assert committed.checkpoint_id and committed.checkpoint_id.startswith("sha256:")
    invalid = next(e for e in entries if e.name == "odd-5")
    assert invalid.error is not None and invalid.error["code"] == "invalid_manifest"


def test_entries_of_one_run_directory_follow_replaced_and_damaged_manifests(run: Path) -> None:
    """A RunDirectory remembers what each committed manifest yields by its checkpoint id (a manager lists its
    run after every save); a manifest replaced since, or made unreadable, is read afresh."""
    rd = RunDirectory(run)
    name = checkpoint_name(60)
    first = next(e for e in rd.entries() if e.name == name)
    shutil.rmtree(run / name)
    write_step(run, 61, name=name)  # replaced: another manifest under the same name
    second = next(e for e in rd.entries() if e.name == name)
    assert second.checkpoint_id != first.checkpoint_id and second.step == 61
    (run / name / "manifest.json").write_text("{not json")
    damaged = next(e for e in rd.entries() if e.name == name)
    assert damaged.status == "invalid manifest" and damaged.checkpoint_id is None
    write_step(run, 62, name="fresh")
    assert next(e for e in rd.entries() if e.name == "fresh").step == 62
    (run / checkpoint_name(50) / "stray.txt").write_text("someone else's")  # a remembered entry's listing is new
    assert next(e for e in rd.entries() if e.name == checkpoint_name(50)).foreign == ("stray.txt",)
    rd.gc(keep_last=2)
    committed = {e.name for e in rd.entries() if e.status == "committed"}
    assert set(rd._committed) == committed and len(committed) == 2  # what was deleted is forgotten


def test_keep_last(run: Path) -> None:
    rd = RunDirectory(run)
    doomed = rd.gc(keep_last=2)
    assert names(doomed) == [checkpoint_name(s) for s in (40, 30, 20, 10)]
    assert names(rd.entries()) == [checkpoint_name(60), checkpoint_name(50)]
    assert not (run / checkpoint_name(10)).exists()


def test_keep_every_pins_latest_and_protect(run: Path) -> None:
    rd = RunDirectory(run)
    rd.set_pinned([checkpoint_name(10)])
    rd.set_latest(checkpoint_name(30), 30, "sha256:" + "0" * 64)
    doomed = rd.plan_gc(keep_last=1, keep_every=20, protect={checkpoint_name(50)})
    # kept: 60 (last), 20 and 40 (every 20), 10 (pinned), 30 (latest), 50 (protected)
    assert doomed == []
    rd.set_pinned([])
    assert names(rd.gc(keep_last=1, keep_every=20)) == [checkpoint_name(50), checkpoint_name(10)]
    assert names(rd.entries()) == [checkpoint_name(s) for s in (60, 40, 30, 20)]


def test_no_retention_rule_removes_only_dead_writers_remains(run: Path) -> None:
    write_remains(run, checkpoint_name(70), lock_of(dead_pid()))
    rd = RunDirectory(run)
    assert names(rd.gc(keep_last=None)) == [checkpoint_name(70)]
    assert len(rd.entries()) == 6 and not (run / checkpoint_name(70)).exists()


def test_gc_never_deletes_a_live_writers_checkpoint(run: Path) -> None:
    rd = RunDirectory(run)
    with live_process() as pid:
        write_remains(run, checkpoint_name(70), lock_of(pid))
        assert checkpoint_name(70) not in names(rd.gc(keep_last=1))
        assert (run / checkpoint_name(70) / ".writer-lock").exists()
    # its writer is gone now: its remains go
    assert names(rd.gc(keep_last=1)) == [checkpoint_name(70)]
    assert not (run / checkpoint_name(70)).exists()


def test_locks_of_other_hosts_and_unreadable_locks(run: Path) -> None:
    write_remains(run, "recent", lock_of(1, host="elsewhere", started_at="2999-01-01T00:00:00Z"))
    write_remains(run, "old", lock_of(1, host="elsewhere", started_at="2001-01-01T00:00:00Z"))
    write_remains(run, "garbled", None)
    (run / "garbled" / ".writer-lock").write_text("{not json")
    status = {e.name: e.status for e in RunDirectory(run).entries()}
    assert status == {**status, "recent": "writing", "old": "incomplete", "garbled": "writing"}
    assert names(RunDirectory(run).gc(keep_last=None)) == ["old"]


def test_gc_keeps_an_invalid_manifest(run: Path) -> None:
    (run / checkpoint_name(10) / "manifest.json").write_text('{"format_version": "9.0"}')
    rd = RunDirectory(run)
    assert checkpoint_name(10) not in names(rd.gc(keep_last=1))
    assert (run / checkpoint_name(10) / "manifest.json").exists()


def test_dry_run_deletes_nothing(run: Path) -> None:
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert len(RunDirectory(run).gc(keep_last=1, dry_run=True)) == 5
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_latest_pointer(run: Path) -> None:
    rd = RunDirectory(run)
    assert rd.latest() is None
    rd.set_latest(checkpoint_name(60), 60, "sha256:" + "a" * 64)
    assert rd.latest() == {"name": checkpoint_name(60), "step": 60, "checkpoint_id": "sha256:" + "a" * 64}
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_latest_pointer_is_replaced_atomically(run: Path) -> None:
    """A reader racing the writer sees the old pointer or the new one, never a torn or missing file."""
    rd = RunDirectory(run)
    rd.set_latest(checkpoint_name(10), 10, "sha256:" + "0" * 64)
    seen: list[object] = []
    stop = threading.Event()

    def read() -> None:
        reader = RunDirectory(run)
        while not stop.is_set():
            seen.append(reader.latest())

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(300):
            step = 10 * (i % 6 + 1)
            rd.set_latest(checkpoint_name(step), step, "sha256:" + "0" * 64)
    finally:
        stop.set()
        thread.join()
    assert seen and all(isinstance(v, dict) and v["step"] in (10, 20, 30, 40, 50, 60) for v in seen)
