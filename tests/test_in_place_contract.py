"""The in-place contract is checked: between a save (or a memory snapshot) and the next ``optimizer.step()``, only
``step()`` changes parameters and optimizer state. A snapshot copies them in the background meanwhile, so an EMA
update or a schedule-free ``optimizer.eval()`` placed there would leave a torn snapshot with valid digests. Their
version counters, taken at capture and compared once the bytes are taken, refuse it (``SourceChangedError``): it is
never committed. Nothing a normal training loop does in that window (zero_grad, forward, backward, the step gate)
trips the check.

Interleavings are made deterministic with events: the background copy waits until the test releases it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptfmt
from ckptfmt.errors import CheckpointError, SourceChangedError
from ckptfmt.tier import find_slots
from ckptfmt.torch import CheckpointManager, ResumableSampler
from ckptfmt.torch import state as torch_state
from ckptfmt.torch.state import HostBuffers, Snapshot

HANG_GUARD = 60.0  # seconds an event may take before the test fails instead of hanging (never a timing assertion)
# CUDA: the memory tier copies into pinned buffers on a side stream, and a version counter moves when an op is queued
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def build(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)
    model(torch.randn(8, 4, device=next(model.parameters()).device)).square().mean().backward()
    opt.step()


def deferred(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """Parameters and optimizer state left for the copy, as an async save or a memory snapshot captures them."""
    snap = Snapshot()
    torch_state.capture_model(model, snap, defer=True)
    torch_state.capture_optimizer(opt, snap, defer=True, model=model)
    return snap


def _ema(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)


def _schedule_free_eval(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    p = model.get_parameter("0.weight")
    with torch.no_grad():  # as schedulefree's eval(): p.lerp_(end=z, weight=1 - 1 / beta1)
        p.lerp_(torch.zeros_like(p), 0.1)


def _through_a_view(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        model.get_parameter("2.bias").view(-1).add_(1.0)


def _in_inference_mode(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.inference_mode():
        model.get_parameter("0.bias").zero_()


def _optimizer_moment(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.state[model.get_parameter("2.weight")]["exp_avg"].zero_()


CHANGES: dict[str, tuple[Callable[[nn.Module, torch.optim.Optimizer], None], str, str]] = {
    "ema": (_ema, "weights", "0.weight"),
    "schedule_free_eval": (_schedule_free_eval, "weights", "0.weight"),
    "view": (_through_a_view, "weights", "2.bias"),
    "inference_mode": (_in_inference_mode, "weights", "0.bias"),
    "optimizer_state": (_optimizer_moment, "optimizer", "2.weight/exp_avg"),
}


# ---------------------------------------------------------------- the snapshot itself


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_before_the_copy_is_refused_naming_the_tensor(change: str) -> None:
    model, opt = build()
    train_step(model, opt)
    snap = deferred(model, opt)
    make, field, tensor = CHANGES[change]
    make(model, opt)
    with pytest.raises(SourceChangedError) as caught:
        snap.materialize(HostBuffers())
    error = caught.value
    assert (error.code, error.field, error.tensor) == ("source_changed", field, tensor)
    assert isinstance(error, CheckpointError) and "changed in place" in str(error)
    assert error.to_dict()["code"] == "source_changed"


def test_the_error_counts_every_changed_tensor() -> None:
    model, opt = build()
    train_step(model, opt)
    snap = deferred(model, opt)
    _ema(model, opt)
    with pytest.raises(SourceChangedError, match=r"; 5 more tensors changed too") as caught:
        snap.materialize(HostBuffers())
    assert caught.value.tensor == "0.weight"


def test_views_changed_while_they_are_written_fail_the_save_and_nothing_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory tier on CPU writes views of the live tensors: the write is the copy, checked once flushed."""
    model, opt = build()
    train_step(model, opt)
    snap = deferred(model, opt)
    snap.materialize(None)  # views: nothing checked yet
    write_tensor = ckptfmt.CheckpointWriter.write_tensor
    written: list[str] = []

    def write_then_change(self: ckptfmt.CheckpointWriter, field: str, name: str, *args: Any, **kw: Any) -> None:
        write_tensor(self, field, name, *args, **kw)
        written.append(name)
        if len(written) == 1:
            _schedule_free_eval(model, opt)  # while the snapshot is being written

    monkeypatch.setattr(ckptfmt.CheckpointWriter, "write_tensor", write_then_change)
    with pytest.raises(SourceChangedError) as caught:
        torch_state.write_snapshot(ckptfmt.open_writer(tmp_path / "ckpt"), snap)
    assert (caught.value.field, caught.value.tensor) == ("weights", "0.weight")
    assert len(written) > 1  # the change came mid-write
    with pytest.raises(CheckpointError):
        ckptfmt.open(tmp_path / "ckpt")


def test_unchanged_tensors_pass_and_the_check_is_made_once(tmp_path: Path) -> None:
    model, opt = build()
    train_step(model, opt)
    snap = deferred(model, opt)
    assert snap.sources
    snap.materialize(HostBuffers())
    assert not snap.sources
    _ema(model, opt)  # after the copy: the snapshot no longer depends on the live tensors
    snap.check_sources()


def test_a_parameter_given_other_storage_is_not_a_change_and_the_captured_values_are_kept() -> None:
    """``p.data = x`` leaves the captured storage as it was (the snapshot holds it), though the parameter's version
    counter, which the new storage takes over, moves with later changes of x."""
    model, opt = build()
    train_step(model, opt)
    expected = model.get_parameter("0.weight").detach().clone()
    snap = deferred(model, opt)
    first, last = model.get_parameter("0.weight"), model.get_parameter("2.weight")
    first.data = torch.zeros_like(first)
    opt.state[last]["exp_avg"].data = torch.ones_like(last)
    with torch.no_grad():
        first.add_(1.0)
    snap.materialize(HostBuffers())
    stored, moment = snap.tensors["weights"]["0.weight"], snap.tensors["optimizer"]["2.weight/exp_avg"]
    assert isinstance(stored, np.ndarray) and isinstance(moment, np.ndarray)
    assert np.array_equal(stored, expected.numpy())
    assert not np.array_equal(moment, np.ones((1, 8), np.float32))


# ---------------------------------------------------------------- DTensor parameters (FSDP2), one rank


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_parameters_are_checked_through_the_dtensor_and_its_local_tensor(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for change in ("dtensor", "local", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        train_step_plain(model, opt)
        snap = deferred(model, opt)
        train_forward_backward(model, opt)  # FSDP2 unshards and reshards: no change of the sharded parameters
        with torch.no_grad():
            if change == "dtensor":
                model.get_parameter("0.weight").mul_(0.5)
            elif change == "local":
                weight: Any = model.get_parameter("0.weight")  # a DTensor
                weight.to_local().add_(1.0)
        if change == "none":
            snap.materialize(HostBuffers())
        else:
            with pytest.raises(SourceChangedError) as caught:
                snap.materialize(HostBuffers())
            assert (caught.value.field, caught.value.tensor) == ("weights", "0.weight"), change


def train_step_plain(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    train_forward_backward(model, opt)
    opt.step()


def train_forward_backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)
    model(torch.randn(8, 4)).square().mean().backward()


# ---------------------------------------------------------------- through the manager


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optimizer": opt, "config": {"lr": 0.1}, "sampler": ResumableSampler(64, seed=1)}


class Held:
    """Holds a background snapshot's copy (``Snapshot.materialize`` on a thread other than the test's) until
    released; ``reached`` is set once the copy is waiting."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        materialize = Snapshot.materialize
        test_thread = threading.current_thread()

        def held(snap: Snapshot, buffers: HostBuffers | None) -> None:
            if threading.current_thread() is not test_thread:
                self.reached.set()
                assert self.go.wait(HANG_GUARD)
                self.go.clear()  # the next snapshot waits again
            materialize(snap, buffers)

        monkeypatch.setattr(Snapshot, "materialize", held)

    def wait_reached(self) -> None:
        assert self.reached.wait(HANG_GUARD)
        self.reached.clear()


@pytest.mark.parametrize("device", DEVICES)
def test_an_async_save_changed_during_its_copy_is_not_committed_and_fails_the_next_call(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = build(device)
    train_step(model, opt)
    held = Held(monkeypatch)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, preemption_signals=())
    try:
        assert mgr.checkpoint_if_due(1, every=1, **state_of(model, opt))
        held.wait_reached()  # save() returned; the copy of step 1 has not run
        _ema(model, opt)  # an EMA update placed after checkpoint_if_due
        held.go.set()
        with pytest.raises(SourceChangedError) as caught:
            mgr.checkpoint_if_due(2, every=1, **state_of(model, opt))
        assert caught.value.field == "weights"
        with pytest.raises(CheckpointError):
            ckptfmt.open(tmp_path / "run" / "step-000000001")
        assert [e.name for e in mgr.run.entries() if e.status == "committed"] == []
        assert len(opt._optimizer_step_pre_hooks) == 0  # the gate is gone: training is not held
        # the manager goes on: the next save is whole
        held.go.set()
        assert mgr.checkpoint_if_due(2, every=1, **state_of(model, opt))
        assert mgr.wait() is not None
        assert [e.step for e in mgr.run.entries() if e.status == "committed"] == [2]
    finally:
        held.go.set()
        mgr.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_memory_snapshot_changed_during_its_copy_is_not_committed(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = build(device)
    run, shm = tmp_path / "run", tmp_path / "shm"
    mgr = CheckpointManager(run, memory_every=1, memory_dir=shm, preemption_signals=())
    try:
        train_step(model, opt)
        mgr.checkpoint_if_due(1, every=100, **state_of(model, opt))
        mgr.wait_memory()
        train_step(model, opt)
        held = Held(monkeypatch)
        mgr.checkpoint_if_due(2, every=100, **state_of(model, opt))
        held.wait_reached()
        _schedule_free_eval(model, opt)
        held.go.set()
        # Refused: raised by the next call, or (where the tier skips a snapshot it cannot take) logged
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            try:
                mgr.wait_memory()
                raised = None
            except SourceChangedError as exc:
                raised = exc
        assert raised is not None or "changed in place" in caplog.text
        if raised is not None:
            assert (raised.field, raised.tensor) == ("weights", "0.weight")
        committed = [s.step for s in find_slots(shm, str(run)) if s.status == "committed"]
        assert committed == [1]  # the newest committed snapshot stays the previous step
        assert mgr._memory is not None and mgr._memory.newest is not None and mgr._memory.newest[1] == 1
    finally:
        mgr.close(persist=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["async", "memory"])
def test_a_normal_training_loop_never_trips_the_check(
    engine: str, device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each snapshot's copy is held until the trainer reaches the next ``optimizer.step()``: zero_grad (to zeros,
    not None), forward (batch-norm statistics) and backward all run while it is in flight, and nothing the library
    does (the step gate included) counts as a change. Adam's moments and step counts are checked too."""
    model, opt = build(device)
    held = Held(monkeypatch)
    in_flight = threading.Event()

    def release(*args: object) -> None:  # registered before the manager's gate, so it runs first
        if in_flight.is_set():
            in_flight.clear()
            held.wait_reached()  # the copy is still waiting: everything since the save ran beside it
            held.go.set()

    opt.register_step_pre_hook(release)
    options: dict[str, Any] = {"async_save": True} if engine == "async" else {"memory_every": 1}
    mgr = CheckpointManager(tmp_path / "run", memory_dir=tmp_path / "shm", preemption_signals=(), **options)
    try:
        for step in range(1, 6):
            train_step(model, opt)
            mgr.checkpoint_if_due(step, every=1 if engine == "async" else 2, **state_of(model, opt))
            in_flight.set()
        held.wait_reached()
        held.go.set()
        mgr.wait()
        if engine == "memory":
            assert mgr._memory is not None and mgr._memory.newest is not None and mgr._memory.newest[1] == 5
        expected = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    finally:
        held.go.set()
        mgr.close()  # the memory tier persists its newest snapshot
    assert max(e.step or 0 for e in mgr.run.entries() if e.status == "committed") == 5
    with ckptfmt.open(tmp_path / "run" / "step-000000005") as ckpt:
        for name, array in expected.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), array), name


# ---------------------------------------------------------------- two gloo ranks: one rank's change fails both at once

TWO_RANKS = """
import json, os, sys, threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ckptfmt.errors import CheckpointError
from ckptfmt.torch import CheckpointManager
from ckptfmt.torch.sampler import ResumableSampler
from ckptfmt.torch.state import Snapshot

rank = int(os.environ["RANK"])
# the peer timeout is long: a rank left waiting for the other would fail with a timeout, not the errors asserted
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=150))
torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
reached, go = threading.Event(), threading.Event()
materialize = Snapshot.materialize

def held(snap, buffers):
    if threading.current_thread() is not threading.main_thread():
        reached.set()
        go.wait(120)
    materialize(snap, buffers)

Snapshot.materialize = held
mgr = CheckpointManager(sys.argv[1], async_save=True, preemption_signals=())
objects = {"model": model, "optimizer": opt, "config": {"lr": 0.1}, "sampler": ResumableSampler(64, seed=1)}
mgr.checkpoint_if_due(1, every=1, **objects)
reached.wait(120)
if rank == 1:
    with torch.no_grad():
        model.weight.mul_(0.999)  # an EMA update after checkpoint_if_due, on one rank
go.set()
try:
    mgr.wait()
    outcome = "saved"
except CheckpointError as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print(json.dumps({"outcome": outcome}), flush=True)
os._exit(0)
"""


@pytest.mark.slow  # two processes
def test_one_rank_s_in_place_change_fails_the_async_save_on_every_rank_at_once(tmp_path: Path) -> None:
    """Every rank agrees that its state was captured before any writes: before, the failing rank never opened the
    writer and the other waited in the collective commit until its peer timeout; a failing rank that opened it and
    aborted put the two out of step (the other read its abort as the rng field)."""
    from process_ranks import launch

    script = tmp_path / "worker.py"
    script.write_text(TWO_RANKS)
    results = launch(script, [str(tmp_path / "run")], 2, timeout=240)
    said = [json.loads(r.stdout.strip().splitlines()[-1])["outcome"] for r in results]
    for outcome in said:  # the same error on both ranks, naming the rank that changed its tensor
        assert outcome.startswith("SourceChangedError") and "rank 1: changed in place" in outcome, said
    assert not (tmp_path / "run" / "step-000000001" / "manifest.json").exists()
