"""The memory tier when things go wrong: a snapshot that cannot be taken, a crash inside MEM-2's window, a close
after a restore, and peers whose messages are malformed (spec/memory.md MEM-2, MEM-6; ckptfmt.decide).

A "kill" here is deterministic: the memory directory is copied at chosen points of a snapshot's write (what a
SIGKILL at that instant would leave in tmpfs) and a fresh manager restores from each copy.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_threads import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import ckptfmt
import ckptfmt.storage.slot as slot_module
import ckptfmt.torch.memory as memory_module
from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError, CheckpointExistsError, MalformedMessageError, MemoryCapacityError
from ckptfmt.run import RunDirectory
from ckptfmt.tier import find_slots
from ckptfmt.torch import CheckpointManager, ResumableDataLoader
from ckptfmt.torch.memory import MemorySnapshots

CONFIG = {"lr": 0.01, "seed": 7}
EVERY = 5  # a durable save every 5 steps
TIMEOUT = 20.0  # a rank left waiting fails the test after this, instead of hanging it
JOIN_TIMEOUT = TIMEOUT * 6  # a rank still running this long after its turn to be joined has hung
DEVICES = [  # CUDA: the snapshot is copied into pinned host buffers first, a path of its own
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: ResumableDataLoader

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "config": CONFIG}

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self.loader

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        device = next(self.model.parameters()).device
        x, y = (t.to(device) for t in batch)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.item())


def build(device: str = "cpu") -> Trainer:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    return Trainer(model, optimizer, ResumableDataLoader(data, batch_size=8, shuffle=True, seed=11))


def committed_steps(shm: Path, run: Path) -> list[int]:
    return [int(s.step or 0) for s in find_slots(shm, str(run)) if s.status == "committed"]


def messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- 05: no room on the memory tier


@pytest.mark.parametrize("device", DEVICES)
def test_enospc_on_the_memory_tier_skips_snapshots_and_the_durable_save_due_goes_to_the_run_directory(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The red-team report's steps: the slot's writes fail with ENOSPC during steps 4 and 5 (a /dev/shm shared with
    DataLoader workers fills and drains). Training goes on; the durable save due at 5 is written straight to the
    run directory, restores bit-identically; the capacity is checked again after each failure."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    full = threading.Event()
    real_write_all = slot_module.write_all

    def write_all(fd: int, view: memoryview) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, view)

    monkeypatch.setattr(slot_module, "write_all", write_all)
    checks: list[int] = []
    real_check = MemorySnapshots.check_capacity

    def check_capacity(self: MemorySnapshots, per_rank: int) -> None:
        checks.append(self.snapshots)  # how many snapshots were started before this check
        real_check(self, per_rank)

    monkeypatch.setattr(MemorySnapshots, "check_capacity", check_capacity)

    t = build(device)
    mgr = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, preemption_signals=())
    losses: dict[int, float] = {}
    at_5: dict[str, torch.Tensor] = {}
    batches = t.batches()
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        for step in range(1, 11):
            losses[step] = t.step(next(batches))
            if step == 4:
                mgr.wait_memory()  # step 3's snapshot is committed: from here on, no room
                full.set()
            mgr.checkpoint_if_due(step, every=EVERY, **t.state())
            if step == 5:
                at_5 = {k: v.clone() for k, v in t.model.state_dict().items()}
                mgr.wait_memory()  # step 5's write (and the durable save instead) is done while there is no room
                assert 3 in committed_steps(shm, run)  # the older slot still holds
                full.clear()
        mgr.close()
    memory = mgr._memory
    assert memory is not None and memory.failed == 2 and memory.skipped == 2
    assert checks == [0, 4, 5]  # before the first snapshot, then again after each failed one
    text = messages(caplog)
    assert "memory snapshot of step 4 skipped" in text and "No space left on device" in text
    assert "memory snapshot of step 5 skipped" in text and "durable save of step 5 written straight" in text

    durable = {e.step: e for e in RunDirectory(run).entries() if e.status == "committed"}
    assert 5 in durable and 10 in durable, durable
    step5 = run / durable[5].name
    with ckptfmt.open(step5) as ckpt:
        assert ckpt.verify().ok
        assert not any(k.startswith("ckptfmt.memory.") for k in ckpt.manifest.metadata)  # the state, not a slot
    resumed = build(device)
    restored = ckptfmt.torch.load(step5, **resumed.state(), loader=resumed.loader)
    assert restored.step == 5
    for name, value in at_5.items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    batches = resumed.batches()
    assert [resumed.step(next(batches)) for _ in range(3)] == [losses[6], losses[7], losses[8]]


def test_a_durable_save_due_when_the_recheck_finds_no_room_goes_to_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capacity re-checked after a failure and refused: that snapshot is skipped on the trainer's thread, and the
    durable save due is written there, straight to the run directory."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    t = build()
    mgr = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, preemption_signals=())
    batches = t.batches()
    try:
        for step in range(1, 5):
            t.step(next(batches))
            mgr.checkpoint_if_due(step, every=EVERY, **t.state())
        mgr.wait_memory()
        assert mgr._memory is not None
        mgr._memory._recheck = True  # as after a failed snapshot

        def no_room(self: object, per_slot: int, **options: object) -> None:
            raise MemoryCapacityError("no room left", path=str(shm))

        monkeypatch.setattr(memory_module.MemoryTier, "check_capacity", no_room)
        t.step(next(batches))
        mgr.checkpoint_if_due(5, every=EVERY, **t.state())
        assert mgr._memory.skipped == 1 and mgr._memory.failed == 0
        assert [e.step for e in RunDirectory(run).entries() if e.status == "committed"] == [5]
        assert sorted(committed_steps(shm, run)) == [3, 4]
    finally:
        mgr.close(persist=False)


# ---------------------------------------------------------------- 05 with several ranks: all skip together


def test_one_rank_that_cannot_write_its_share_makes_every_rank_skip_that_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's files fail (at steps 3 and 5) and, at step 2, rank 1 cannot even open its slot: every rank skips
    those snapshots together (none waits out a timeout, none commits), the durable save due at 5 is written by
    both straight to the run directory, and later snapshots commit again."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    failing = threading.Event()
    real_write = slot_module.InPlaceOutput.write

    def write(self: slot_module.InPlaceOutput, data: bytes | memoryview) -> None:
        if failing.is_set() and "r00001" in self._rel:
            raise slot_module.StorageError("write failed: [Errno 28] No space left on device", path=self._rel)
        real_write(self, data)

    monkeypatch.setattr(slot_module.InPlaceOutput, "write", write)

    def no_slot(index: int) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    def body(rank: int, collective: ThreadCollective) -> tuple[int, int, list[int]]:
        t = build()
        mgr = CheckpointManager(
            run,
            loader=t.loader,
            keep_last=10,
            memory_every=1,
            memory_dir=shm,
            collective=collective,
            peer_timeout=TIMEOUT,
        )
        assert mgr._memory is not None
        batches = t.batches()
        newest: list[int] = []
        try:
            for step in range(1, 8):
                t.step(next(batches))
                if rank == 1 and step in (3, 5):
                    failing.set()
                if rank == 1 and step == 2:
                    real = mgr._memory.tier.writable_slot
                    mgr._memory.tier.writable_slot = no_slot  # type: ignore[method-assign]
                mgr.checkpoint_if_due(step, every=EVERY, **t.state())
                mgr.wait_memory()
                if rank == 1:
                    failing.clear()
                    if step == 2:
                        mgr._memory.tier.writable_slot = real  # type: ignore[method-assign]
                newest.append(mgr._memory.newest[1] if mgr._memory.newest is not None else -1)
        finally:
            mgr.close(persist=False)
        return mgr._memory.failed, mgr._memory.skipped, newest

    results = run_ranks(2, body, TIMEOUT, join_timeout=JOIN_TIMEOUT)
    assert all(isinstance(r, tuple) for r in results), results
    expected = (3, 3, [1, 1, 1, 4, 4, 6, 7])
    assert results == [expected, expected]
    step5 = [e for e in RunDirectory(run).entries() if e.status == "committed" and e.step == 5]
    assert len(step5) == 1 and ckptfmt.verify(run / step5[0].name).ok


# ---------------------------------------------------------------- MEM-2: a crash while a slot is held


def test_a_crash_at_any_point_of_a_snapshot_written_while_a_slot_is_held_restores_the_newest_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 5's durable copy holds its slot (blocked here) while steps 6 and 7 are snapshotted. At every write of
    step 7's snapshot (lock, each data file, manifest) the memory directory is copied, as a SIGKILL then would leave
    it. Each copy restores step 6, the newest committed snapshot: never step 5, two steps back."""
    run, shm, images = tmp_path / "run", tmp_path / "shm", tmp_path / "images"
    entered, release = threading.Event(), threading.Event()

    def held_persist(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(TIMEOUT)
        raise CheckpointExistsError("held by the test: never made durable", path=str(run))

    monkeypatch.setattr(memory_module, "persist", held_persist)
    armed = threading.Event()
    taken: list[Path] = []

    def image() -> None:
        if armed.is_set():
            taken.append(images / f"kill-{len(taken):02d}")
            shutil.copytree(shm, taken[-1], symlinks=True)

    real_write_all, real_put = slot_module.write_all, slot_module.SlotStore.put_exclusive

    def write_all(fd: int, view: memoryview) -> None:
        image()
        real_write_all(fd, view)

    def put_exclusive(self: slot_module.SlotStore, path: str, data: bytes) -> None:
        image()
        real_put(self, path, data)

    monkeypatch.setattr(slot_module, "write_all", write_all)
    monkeypatch.setattr(slot_module.SlotStore, "put_exclusive", put_exclusive)

    t = build()
    mgr = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, preemption_signals=())
    batches = t.batches()
    try:
        for step in range(1, 8):
            t.step(next(batches))
            if step == 7:
                armed.set()
            mgr.checkpoint_if_due(step, every=EVERY, **t.state())
            mgr.wait_memory()
            if step == 5:
                assert entered.wait(TIMEOUT)  # step 5's slot is held from here on
        armed.clear()
        newest_three = sorted(committed_steps(shm, run))
    finally:
        release.set()
        mgr.close(persist=False)
    assert len(taken) >= 4, taken  # the lock, the data files, the manifest
    assert not RunDirectory(run).entries()  # nothing durable: each restore below reads memory only
    restored = []
    for memory_dir in taken:
        fresh = build()
        again = CheckpointManager(
            run, loader=fresh.loader, memory_every=1, memory_dir=memory_dir, preemption_signals=()
        )
        try:
            restored.append(again.restore_latest(**fresh.state()))
        finally:
            again.close(persist=False)
    assert restored == [6] * len(taken)
    assert newest_three == [5, 6, 7]  # step 7 went to the spare slot


def test_without_room_for_the_spare_slot_a_snapshot_due_while_a_slot_is_held_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MEM-2 without a spare: step 7 would have to rewrite step 6's slot (step 5's is held), so it is skipped."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    entered, release = threading.Event(), threading.Event()

    def held_persist(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(TIMEOUT)
        raise CheckpointExistsError("held by the test: never made durable", path=str(run))

    monkeypatch.setattr(memory_module, "persist", held_persist)
    real_check = memory_module.MemoryTier.check_capacity

    def ring_only(self: memory_module.MemoryTier, per_slot: int, **options: Any) -> None:
        if self.slot_count > 2:
            raise MemoryCapacityError("no room for a third slot", path=str(shm))
        real_check(self, per_slot, **options)

    monkeypatch.setattr(memory_module.MemoryTier, "check_capacity", ring_only)
    t = build()
    mgr = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, preemption_signals=())
    batches = t.batches()
    try:
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            for step in range(1, 8):
                t.step(next(batches))
                mgr.checkpoint_if_due(step, every=EVERY, **t.state())
                mgr.wait_memory()
                if step == 5:
                    assert entered.wait(TIMEOUT)
        assert mgr._memory is not None and not mgr._memory.spare
        assert mgr._memory.skipped == 1 and mgr._memory.failed == 0
        assert sorted(committed_steps(shm, run)) == [5, 6]
    finally:
        release.set()
        mgr.close(persist=False)
    text = messages(caplog)
    assert "not for a spare one" in text and "memory snapshot of step 7 skipped" in text and "MEM-2" in text


# ---------------------------------------------------------------- close() after a restore


def train_to(run: Path, shm: Path, steps: int, **options: Any) -> None:
    t = build()
    mgr = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, **options)
    step = mgr.restore_latest(**t.state()) or 0
    batches = t.batches()
    while step < steps:
        t.step(next(batches))
        step += 1
        mgr.checkpoint_if_due(step, every=EVERY, **t.state())
    mgr.close()


def test_a_restored_snapshot_that_the_run_directory_holds_is_not_persisted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, shm = tmp_path / "run", tmp_path / "shm"
    train_to(run, shm, 10, preemption_signals=())  # close() made step 10 durable: slot and run dir hold the same
    assert [e.step for e in RunDirectory(run).entries()][:1] == [10]
    calls: list[object] = []
    monkeypatch.setattr(memory_module, "persist", lambda *a, **k: calls.append(a))
    t = build()
    mgr = CheckpointManager(run, loader=t.loader, memory_every=1, memory_dir=shm, preemption_signals=())
    try:
        assert mgr.restore_latest(**t.state()) == 10
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        assert mgr._memory is not None and mgr._memory._persists == []
    finally:
        mgr.close()
    assert calls == []  # neither after the restore nor at close


def test_close_says_what_it_waits_for_and_close_timeout_abandons_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A restored snapshot the run directory lacks is persisted in the background; close() logs that it waits for
    it, and with close_timeout=0 abandons it: no durable step 7, the snapshot stays committed in memory."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    t = build()
    first = CheckpointManager(run, loader=t.loader, keep_last=10, memory_every=1, memory_dir=shm, preemption_signals=())
    batches = t.batches()
    for step in range(1, 8):
        t.step(next(batches))
        first.checkpoint_if_due(step, every=EVERY, **t.state())
    first.wait_memory()
    first.close(persist=False)  # as a crash after step 7's snapshot: step 5 durable, step 7 in memory

    entered, release = threading.Event(), threading.Event()
    real_persist = memory_module.persist

    def slow_persist(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(TIMEOUT)
        return real_persist(*args, **kwargs)

    monkeypatch.setattr(memory_module, "persist", slow_persist)

    class ReleaseOnWait(logging.Handler):  # the copy goes on once close() said it waits for it
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("closing: waiting"):
                release.set()

    handler = ReleaseOnWait()
    logging.getLogger("ckptfmt").addHandler(handler)
    fresh = build()
    mgr = CheckpointManager(
        run, loader=fresh.loader, memory_every=1, memory_dir=shm, preemption_signals=(), close_timeout=0
    )
    try:
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            assert mgr.restore_latest(**fresh.state()) == 7
            assert entered.wait(TIMEOUT)
            mgr.close()
    finally:
        release.set()
        logging.getLogger("ckptfmt").removeHandler(handler)
    text = messages(caplog)
    assert "closing: waiting for the durable copy of step 7" in text and "close_timeout=0" in text
    assert "the durable copy of step 7 was abandoned at close" in text
    assert [e.step for e in RunDirectory(run).entries() if e.status == "committed"] == [5]
    assert not [p for p in run.rglob("*") if p.is_file() and "step-000000007" in str(p)]  # its files cleaned up
    assert 7 in committed_steps(shm, run)


# ---------------------------------------------------------------- 07's class: malformed messages


class Lying(ThreadCollective):
    """A rank of ``inner``'s group whose next gather or broadcast payload (once armed) is what ``alter`` makes of
    it: what a buggy or lying process would put on the wire."""

    def __init__(self, inner: ThreadCollective) -> None:
        super().__init__(inner.rank, inner._shared)
        self.gather_alter: Callable[[bytes], bytes] | None = None
        self.broadcast_alter: Callable[[bytes], bytes] | None = None

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        if self.gather_alter is not None:
            data, self.gather_alter = self.gather_alter(data), None
        return super().gather(data, dst=dst, max_size=max_size)

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        if self.broadcast_alter is not None and data is not None:
            data, self.broadcast_alter = self.broadcast_alter(data), None
        return super().broadcast(data, src=src)


@pytest.fixture
def two_tiers(tmp_path: Path) -> Iterator[tuple[list[Lying], list[MemorySnapshots]]]:
    group = [Lying(c) for c in ThreadCollective.group(2, timeout=TIMEOUT)]
    run = RunDirectory(tmp_path / "run")
    tiers = run_ranks(
        2,
        lambda rank, _: MemorySnapshots(run, memory_dir=tmp_path / "shm", slots=2, collective=group[rank]),
        TIMEOUT,
        join_timeout=JOIN_TIMEOUT,
    )
    assert all(isinstance(t, MemorySnapshots) for t in tiers), tiers
    yield group, tiers  # type: ignore[misc]
    for tier in tiers:
        assert isinstance(tier, MemorySnapshots)
        tier.close(persist=False)


def test_a_malformed_snapshot_size_fails_the_capacity_check_on_every_rank_naming_the_rank(
    two_tiers: tuple[list[Lying], list[MemorySnapshots]],
) -> None:
    group, tiers = two_tiers
    group[1].gather_alter = lambda data: data.replace(b"1000", b'"1e9"')
    results = run_ranks(2, lambda rank, _: tiers[rank].check_capacity(1000), TIMEOUT, join_timeout=JOIN_TIMEOUT)
    assert all(isinstance(r, MalformedMessageError) and "rank 1" in str(r) for r in results), results


@pytest.mark.parametrize(
    "payload",
    [b"{not json", b'{"ok":[[5,"../../escaped","sha256:' + b"0" * 64 + b'"]]}', b'{"ok":[[5,7,"sha256:x"]]}'],
)
def test_a_malformed_list_of_memory_slots_is_refused_by_every_rank(
    two_tiers: tuple[list[Lying], list[MemorySnapshots]], payload: bytes
) -> None:
    group, tiers = two_tiers
    group[0].broadcast_alter = lambda data: payload
    results = run_ranks(2, lambda rank, _: tiers[rank].candidates(), TIMEOUT, join_timeout=JOIN_TIMEOUT)
    assert all(isinstance(r, MalformedMessageError) for r in results), results


def two_managers(tmp_path: Path) -> tuple[list[Lying], list[CheckpointManager]]:
    group = [Lying(c) for c in ThreadCollective.group(2, timeout=TIMEOUT)]
    managers = [CheckpointManager(tmp_path / "run", collective=group[r], preemption_signals=()) for r in range(2)]
    return group, managers


def test_a_vote_that_is_not_a_boolean_is_an_error_on_every_rank_not_a_silent_no(tmp_path: Path) -> None:
    group, managers = two_managers(tmp_path)
    group[1].gather_alter = lambda data: json.dumps({"ok": "yes"}).encode() if data.startswith(b"{") else b"maybe"
    results = run_ranks(2, lambda rank, _: managers[rank]._agree(True), TIMEOUT, join_timeout=JOIN_TIMEOUT)
    assert all(isinstance(r, MalformedMessageError) and "rank 1" in str(r) for r in results), results


@pytest.mark.parametrize(
    "payload", [b"\xff", b'{"ok":[["../../escaped",5,"committed"]]}', b'{"ok":[["step-5",true,"x"]]}']
)
def test_a_malformed_listing_of_the_run_directory_is_refused_by_every_rank(tmp_path: Path, payload: bytes) -> None:
    group, managers = two_managers(tmp_path)
    group[0].broadcast_alter = lambda data: payload
    results = run_ranks(
        2, lambda rank, _: managers[rank].restore_latest(model=nn.Linear(2, 2)), TIMEOUT, join_timeout=JOIN_TIMEOUT
    )
    assert all(isinstance(r, CheckpointError) and r.code == "malformed_message" for r in results), results


def test_a_malformed_restore_report_of_a_rank_is_recorded_as_such_not_raised(tmp_path: Path) -> None:
    from ckptfmt.torch.restore_report import RestoreReport

    group, managers = two_managers(tmp_path)
    group[1].gather_alter = lambda data: b"\xff{"
    report = RestoreReport(
        step=5, tier="durable", url="x", checkpoint_id="sha256:" + "0" * 64, seconds=0.5, bytes_read=1
    )
    results = run_ranks(2, lambda rank, _: managers[rank]._record_restore(report), TIMEOUT, join_timeout=JOIN_TIMEOUT)
    assert results == [None, None], results
    ranks = RunDirectory(tmp_path / "run").last_restore()["ranks"]  # type: ignore[index]
    assert ranks[0]["step"] == 5 and ranks[0]["seconds"] == 0.5
    assert ranks[1]["rank"] == 1 and "restore report of rank 1" in ranks[1]["error"]
