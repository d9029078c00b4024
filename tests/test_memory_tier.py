"""The memory tier in one process: snapshots in a slot ring, restores from the newest good one, durable saves
made from memory, rescue, the capacity guard (spec/memory.md).

A "crash" here is a manager abandoned after its last snapshot is committed (its threads idle, as a SIGKILLed
process leaves its slots); kills of real processes are in tests/test_memory_processes.py and, under
torchrun, tests/test_memory_torchrun.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptfmt.cli import cli
from click.testing import CliRunner
from torch import nn
from torch.utils.data import TensorDataset

import ckptfmt
from ckptfmt.errors import DigestMismatchError, MemoryCapacityError
from ckptfmt.run import RunDirectory
from ckptfmt.storage.local import IN_PLACE_MARKER
from ckptfmt.tier import find_slots, persist, read_slot
from ckptfmt.tier import ring as ring_module
from ckptfmt.torch import CheckpointManager, ResumableDataLoader

STEPS, EVERY = 12, 5
CONFIG = {"lr": 0.01, "seed": 7}


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: ResumableDataLoader

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "config": CONFIG}


def build() -> Trainer:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    return Trainer(model, optimizer, ResumableDataLoader(data, batch_size=8, shuffle=True, seed=11))


@dataclass
class Outcome:
    losses: dict[int, float]
    weights: dict[str, torch.Tensor]
    restore: Any


def train(run_dir: Path, memory_dir: Path | None, *, stop_at: int | None = None, **options: Any) -> Outcome:
    """A run from wherever the manager restores to ``STEPS`` (or ``stop_at``: then abandoned, as if killed)."""
    t = build()
    mgr = CheckpointManager(
        run_dir,
        loader=t.loader,
        keep_last=10,
        memory_every=1 if memory_dir is not None else 0,
        memory_dir=memory_dir,
        **options,
    )
    step = mgr.restore_latest(**t.state()) or 0
    restore = mgr.last_restore
    losses: dict[int, float] = {}
    while step < STEPS:
        for x, y in t.loader:
            loss = nn.functional.mse_loss(t.model(x), y)
            t.optimizer.zero_grad()
            loss.backward()
            t.optimizer.step()
            step += 1
            losses[step] = loss.item()
            mgr.checkpoint_if_due(step, every=EVERY, **t.state())
            if step in (stop_at, STEPS):
                break
        if step == stop_at:
            mgr.wait_memory()  # the snapshot of this step is committed; then the process "dies"
            mgr.close(persist=False)  # nothing more persisted than a SIGKILL would have let through
            break
    else:
        mgr.close()
    return Outcome(losses, {k: v.clone() for k, v in t.model.state_dict().items()}, restore)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return train(tmp_path_factory.mktemp("reference"), None)


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield tmp_path / "run", tmp_path / "shm"


def newest_slot(memory_dir: Path, run_dir: Path) -> Path:
    slots = [s for s in find_slots(memory_dir, str(run_dir)) if s.status == "committed"]
    return Path(slots[0].path)


def older_step(memory_dir: Path, run_dir: Path) -> int:
    """The step the next newest slot holds: 6, or 5 when step 5's slot was still being persisted at step 6 (the
    spare slot then holds 7 or 6: MEM-2 never rewrites the newest snapshot's slot)."""
    steps = [s.step for s in find_slots(memory_dir, str(run_dir)) if s.status == "committed"]
    assert len(steps) in (2, 3) and steps[0] == 7 and steps[1] in (5, 6), steps
    return int(steps[1])  # type: ignore[arg-type]


def flip_a_byte(slot: Path) -> Path:
    target = max((p for p in slot.rglob("*.safetensors")), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes, past the header
    target.write_bytes(bytes(data))
    return target


def test_a_crashed_run_resumes_from_memory_at_its_last_step_bit_identical(
    dirs: tuple[Path, Path], reference: Outcome
) -> None:
    run_dir, shm = dirs
    first = train(run_dir, shm, stop_at=7)
    assert [e.step for e in RunDirectory(run_dir).entries()] == [5]  # durable is two steps behind
    resumed = train(run_dir, shm)
    assert resumed.restore.tier == "memory" and resumed.restore.step == 7
    assert resumed.restore.bytes_read > 0 and resumed.restore.seconds > 0
    assert {**first.losses, **resumed.losses} == reference.losses  # every step's loss, the same bits
    for name, value in reference.weights.items():
        assert torch.equal(resumed.weights[name], value), name
    # The restored snapshot is made durable in the background, and the resumed run's durable saves too; a
    # copy that starts after its slot was rewritten takes the newest snapshot instead (timing decides which).
    entries = [e for e in RunDirectory(run_dir).entries() if e.status == "committed"]
    steps = {e.step for e in entries}
    assert 5 in steps and steps & {7, 8, 9} and 12 in steps, steps  # 12: at close (10 may have become 11 or 12)
    assert all(ckptfmt.verify(run_dir / e.name).ok for e in entries)


def test_a_flipped_byte_in_the_newest_slot_falls_back_to_the_previous_one(
    dirs: tuple[Path, Path], reference: Outcome, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir, shm = dirs
    first = train(run_dir, shm, stop_at=7)
    expected = older_step(shm, run_dir)
    flipped = flip_a_byte(newest_slot(shm, run_dir))
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        resumed = train(run_dir, shm)
    assert resumed.restore.tier == "memory" and resumed.restore.step == expected
    assert any("DigestMismatchError" in s and str(flipped.parent.parent) in s for s in resumed.restore.skipped)
    assert any("skipping" in r.message and "Digest" in r.message for r in caplog.records)
    assert {**first.losses, **resumed.losses} == reference.losses


def test_both_slots_bad_fall_back_to_the_durable_checkpoint(dirs: tuple[Path, Path], reference: Outcome) -> None:
    run_dir, shm = dirs
    first = train(run_dir, shm, stop_at=7)
    committed = [s for s in find_slots(shm, str(run_dir)) if s.status == "committed"]
    for slot in committed:
        flip_a_byte(Path(slot.path))
    resumed = train(run_dir, shm)
    assert resumed.restore.tier == "durable" and resumed.restore.step == 5
    assert len(resumed.restore.skipped) == len(committed)  # two, or three with the spare slot (MEM-2)
    assert {**first.losses, **resumed.losses} == reference.losses


def test_a_torn_snapshot_is_passed_over_for_the_previous_slot(dirs: tuple[Path, Path], reference: Outcome) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=7)
    expected = older_step(shm, run_dir)
    newest = newest_slot(shm, run_dir)
    (newest / "manifest.json").unlink()  # killed between the data files and the manifest
    assert read_slot(newest).status == "torn"
    resumed = train(run_dir, shm)
    assert resumed.restore.tier == "memory" and resumed.restore.step == expected


def test_a_slot_of_another_run_is_ignored(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir, shm = dirs
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    train(run_dir, shm, stop_at=7)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        resumed = train(run_dir, shm, stop_at=8)
    assert resumed.restore.tier == "durable" and resumed.restore.step == 5
    assert any("written by run 'job-a'" in r.message and "ckpt rescue" in r.message for r in caplog.records)


def test_a_durable_save_is_the_snapshot_byte_for_byte(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=7)
    slot = newest_slot(shm, run_dir)
    snapshot_id = ckptfmt.open(slot).id
    done = persist(slot, RunDirectory(tmp_path / "copy"))
    assert done.status == "persisted" and done.checkpoint_id == snapshot_id and done.step == 7
    with ckptfmt.open(tmp_path / "copy" / "step-000000007") as ckpt:
        assert ckpt.id == snapshot_id and ckpt.verify().ok
    for path in (p for p in slot.rglob("*") if p.is_file() and p.name != IN_PLACE_MARKER):  # a slot's own mark
        assert (tmp_path / "copy" / "step-000000007" / path.relative_to(slot)).read_bytes() == path.read_bytes()
    assert persist(slot, RunDirectory(tmp_path / "copy")).status == "already durable"


def test_a_slot_that_rotted_after_its_commit_is_not_persisted(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=7)
    slot = newest_slot(shm, run_dir)
    flip_a_byte(slot)
    with pytest.raises(DigestMismatchError):
        persist(slot, RunDirectory(tmp_path / "copy"))
    left = [p for p in (tmp_path / "copy").rglob("*") if p.is_file()]
    assert left == []  # nothing half-written: no manifest, no data file, no lock


def test_slots_are_rewritten_in_place(dirs: tuple[Path, Path]) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=3)
    slot = newest_slot(shm, run_dir)  # step 3; step 1 was in the same slot
    inodes = {p.relative_to(slot): p.stat().st_ino for p in slot.rglob("*.safetensors")}
    train(run_dir, shm, stop_at=5)  # steps 4 and 5: each slot rewritten once more
    assert {p.relative_to(slot): p.stat().st_ino for p in slot.rglob("*.safetensors")} == inodes
    assert not [p for p in shm.rglob("*") if ".tmp-" in p.name]


def test_ckpt_rescue_persists_what_a_dead_worker_left(dirs: tuple[Path, Path]) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=7)
    older = older_step(shm, run_dir)
    runner = CliRunner()
    result = runner.invoke(cli, ["rescue", str(shm), str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    by_step = {s["slot"]["step"]: s for s in doc["slots"]}
    assert by_step[7]["status"] == "persisted"
    assert by_step[older]["status"] == ("persisted" if older == 6 else "already durable")
    assert RunDirectory(run_dir).latest()["step"] == 7  # type: ignore[index]
    again = json.loads(runner.invoke(cli, ["rescue", str(shm), str(run_dir), "--json"]).stdout)
    assert {s["status"] for s in again["slots"]} == {"already durable"}
    shutil.rmtree(shm)  # the node is lost: the rescued step survives it
    resumed = train(run_dir, shm, stop_at=8)
    assert resumed.restore.tier == "durable" and resumed.restore.step == 7


def test_ckpt_rescue_reports_a_corrupt_slot_and_exits_1(dirs: tuple[Path, Path]) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=7)
    older = older_step(shm, run_dir)
    flip_a_byte(newest_slot(shm, run_dir))
    result = CliRunner().invoke(cli, ["rescue", str(shm), str(run_dir)])
    assert result.exit_code == 1
    assert "corrupt" in result.stdout and "digest_mismatch" in result.stdout
    assert f"{'persisted' if older == 6 else 'already durable'} step {older}" in result.stdout
    assert not (run_dir / "step-000000007").exists()


def test_the_capacity_guard_refuses_slots_that_do_not_fit(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, shm = dirs
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(ring_module.shutil, "disk_usage", lambda _: usage._replace(free=1 << 20, total=64 << 20))
    with pytest.raises(MemoryCapacityError) as caught:
        train(run_dir, shm, stop_at=1)
    message = str(caught.value)
    assert "need" in message and "1.0 MiB free" in message and "memory_dir=" in message and str(shm) in message
    assert not list(shm.rglob("*.safetensors"))  # refused before anything was written


def test_the_capacity_guard_on_a_real_small_tmpfs(tmp_path: Path) -> None:
    mount = tmp_path / "small-shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the guard is tested above")
    try:
        with pytest.raises(MemoryCapacityError, match=r"has 0\.\d MiB free"):
            train(tmp_path / "run", mount, stop_at=1)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_memory_every_zero_changes_nothing(tmp_path: Path) -> None:
    train(tmp_path / "run", None, stop_at=5)
    assert not os.path.exists(tmp_path / "shm")
    entries = RunDirectory(tmp_path / "run").entries()
    assert [e.step for e in entries] == [5]
    assert not any(
        k.startswith("ckptfmt.memory.") for k in ckptfmt.open(tmp_path / "run" / "step-000000005").manifest.metadata
    )


def test_a_slot_planted_as_a_symlink_is_neither_read_nor_written_through(
    dirs: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=2)  # makes the run's memory directory and both slots
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    shutil.copytree(newest_slot(shm, run_dir), victim, dirs_exist_ok=True)  # a valid checkpoint of this run
    slot = next(Path(s.path) for s in find_slots(shm, str(run_dir)) if s.step != 2)
    shutil.rmtree(slot)
    slot.symlink_to(victim, target_is_directory=True)
    assert read_slot(slot).status == "invalid" and "symlink" in (read_slot(slot).reason or "")
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        train(run_dir, shm, stop_at=4)  # the ring comes to the planted slot: that snapshot is refused, loudly
    assert any("skipped: UnsafePathError" in r.message and "symlink" in r.message for r in caplog.records)
    assert (victim / "precious.txt").read_text() == "keep"
    assert ckptfmt.open(victim).verify().ok  # nothing rewritten there


def test_a_slot_with_a_malformed_binding_is_ignored(dirs: tuple[Path, Path]) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=6)
    newest = newest_slot(shm, run_dir)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["metadata"]["ckptfmt.memory.step"] = "-1"
    (newest / "manifest.json").unlink()
    (newest / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
    assert read_slot(newest).status == "invalid" and "ckptfmt.memory.step" in (read_slot(newest).reason or "")
    resumed = train(run_dir, shm, stop_at=7)
    assert resumed.restore.step < 6  # the other slot, or the durable step 5


def test_durable_saves_from_memory_take_the_managers_codec(dirs: tuple[Path, Path], reference: Outcome) -> None:
    run_dir, shm = dirs
    train(run_dir, shm, stop_at=5, codec="zstd")
    slot_ids = {ckptfmt.open(s.path).id for s in find_slots(shm, str(run_dir)) if s.status == "committed"}
    with ckptfmt.open(run_dir / "step-000000005") as ckpt:
        assert ckpt.verify().ok
        # re-encoded from a snapshot (this model's tensors are below zstd's minimum size, so they stay raw)
        assert ckpt.read_context("provenance")["converted_from"]["checkpoint_id"] in slot_ids
        assert ckpt.id not in slot_ids
    resumed = train(run_dir, None)  # from the encoded durable checkpoint alone
    assert resumed.restore.step == 5 and resumed.weights.keys() == reference.weights.keys()
    for name, value in reference.weights.items():
        assert torch.equal(resumed.weights[name], value), name
