"""ckptfmt.torch: the full training state round-trips, mismatches are named, the manager restores the newest
good checkpoint, async failures surface, one save at a time."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

import ckptfmt
import ckptfmt.canonical
import ckptfmt.context
import ckptfmt.digests
from ckptfmt.errors import (
    CheckpointError,
    ContextError,
    FieldNotFoundError,
    ResumeMismatchError,
    StorageError,
    UsageError,
)
from ckptfmt.run import RunDirectory, checkpoint_name
from ckptfmt.torch import CheckpointManager, DatasetIdentity, ResumableSampler, api, read_state

# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure and bit-identical tensors (NaN-safe, dtype-exact)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert bits(a) == bits(b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


def tiny_state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, ResumableSampler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), ResumableSampler(32, seed=seed)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, model[0].in_features, generator=gen)  # type: ignore[index]
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# ---------------------------------------------------------------- weights


def test_tied_weights_are_stored_once_and_restored_tied(tmp_path: Path) -> None:
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(torch.arange(10)).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    url = str(tmp_path / "ckpt")
    api.save(url, step=1, model=model, optimizer=opt, sampler=ResumableSampler(4), config={})
    ckpt = ckptfmt.open(url)
    assert set(ckpt.fields["weights"].tensors) == {"embed.weight", "body.weight", "body.bias"}
    assert ckpt.read_context("weights")["aliases"] == {"head.weight": "embed.weight"}

    fresh = Tied()
    api.load(url, model=fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert_same(fresh.state_dict(), model.state_dict())


# ---------------------------------------------------------------- optimizers


def _optimizer_cases() -> dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    cases: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
        "SGD": lambda p: torch.optim.SGD(
            [{"params": p[:2], "lr": 0.05}, {"params": p[2:], "lr": 0.01, "nesterov": True, "dampening": 0.0}],
            lr=0.1,
            momentum=0.9,
        ),
        "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95)),
        "Adadelta": lambda p: torch.optim.Adadelta(p),
        "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
        "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
        "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05, t0=1),
        "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
        "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
        "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
        "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
        "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, history_size=3, max_iter=3),
        "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
        "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
        "Muon": lambda p: torch.optim.Muon([q for q in p if q.ndim == 2], lr=0.01),
    }
    return cases


OPTIMIZERS = _optimizer_cases()


def test_every_torch_optimizer_is_covered() -> None:
    classes = {
        name
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }
    assert classes <= set(OPTIMIZERS), f"no round-trip case for {sorted(classes - set(OPTIMIZERS))}"


class OptModel(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 6, sparse=sparse)
        self.l1 = nn.Linear(6, 5)
        self.l2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(self.embed(x))))


def _opt_steps(model: OptModel, opt: torch.optim.Optimizer, steps: int, start: int) -> None:
    for i in range(start, start + steps):
        x = torch.arange(12).roll(i)[:8]

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).sin().sum()
            loss.backward()
            return loss

        if isinstance(opt, torch.optim.LBFGS):
            opt.step(closure)
        else:
            closure()
            opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_round_trip(name: str, tmp_path: Path) -> None:
    """State tensors, scalars, step counters and param groups round-trip, and training continues bit for bit."""
    sparse = name == "SparseAdam"
    model = OptModel(sparse)
    params = list(model.parameters()) if not sparse else [model.embed.weight]
    opt = OPTIMIZERS[name](params)
    _opt_steps(model, opt, 3, 0)
    url = str(tmp_path / "ckpt")
    api.save(url, step=3, model=model, optimizer=opt, sampler=ResumableSampler(4), config={"opt": name})
    stored = ckptfmt.open(url)
    assert stored.read_context("optimizer")["class"] == name
    assert stored.fields["optimizer"].tensors or (name == "SGD" and not opt.state_dict()["state"])

    fresh = OptModel(sparse)
    fresh_params = list(fresh.parameters()) if not sparse else [fresh.embed.weight]
    fresh_opt = OPTIMIZERS[name](fresh_params)
    api.load(url, model=fresh, optimizer=fresh_opt)
    assert_same(fresh_opt.state_dict(), opt.state_dict(), name)

    _opt_steps(model, opt, 2, 3)
    _opt_steps(fresh, fresh_opt, 2, 3)
    assert_same(fresh.state_dict(), model.state_dict(), name)
    assert_same(fresh_opt.state_dict(), opt.state_dict(), name)


def test_optimizer_state_is_tensors_not_pickles(tmp_path: Path) -> None:
    model, opt, sampler = tiny_state()
    train(model, opt, 2)
    url = str(tmp_path / "ckpt")
    api.save(url, step=2, model=model, optimizer=opt, sampler=sampler, config={})
    names = set(ckptfmt.open(url).fields["optimizer"].tensors)
    first = next(name for name, _ in model.named_parameters())
    assert {f"{first}/exp_avg", f"{first}/exp_avg_sq", f"{first}/step"} <= names  # keyed by parameter name
    assert not any(p.suffix in (".pt", ".pkl", ".pickle") for p in Path(url).rglob("*"))


def test_optimizer_class_mismatch_is_refused(tmp_path: Path) -> None:
    model, opt, sampler = tiny_state()
    train(model, opt, 1)
    url = str(tmp_path / "ckpt")
    api.save(url, step=1, model=model, optimizer=opt, sampler=sampler, config={})
    with pytest.raises(CheckpointError, match="AdamW state, the optimizer is SGD"):
        api.load(url, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------------- scheduler, scaler, generators, config


def test_scheduler_and_grad_scaler(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
        model, opt, _ = tiny_state()
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[3])
        return model, opt, sched, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    def run(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: torch.amp.GradScaler, n: int) -> None:
        gen = torch.Generator().manual_seed(n)
        for i in range(n):
            x = torch.randn(4, 3, generator=gen)
            if i == 1:
                x[0, 0] = float("inf")  # an overflow: the scaler skips the step and backs off
            loss = model(x).square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

    model, opt, sched, scaler = build()
    run(model, opt, sched, scaler, 4)
    url = str(tmp_path / "ckpt")
    api.save(
        url, step=4, model=model, optimizer=opt, sampler=ResumableSampler(4), config={}, scheduler=sched, scaler=scaler
    )
    f_model, f_opt, f_sched, f_scaler = build()
    api.load(url, model=f_model, optimizer=f_opt, scheduler=f_sched, scaler=f_scaler)
    assert_same(f_sched.state_dict(), sched.state_dict())
    assert f_scaler.state_dict() == scaler.state_dict()
    assert (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]) == (2.0**9, 2)  # backed off, growing
    run(model, opt, sched, scaler, 4)
    run(f_model, f_opt, f_sched, f_scaler, 4)
    assert_same(f_model.state_dict(), model.state_dict())
    assert sched.get_last_lr() == f_sched.get_last_lr() and f_scaler.get_scale() == scaler.get_scale()


def test_rng_generators_and_numpy_generators(tmp_path: Path) -> None:
    import random

    model, opt, sampler = tiny_state()
    augment = np.random.default_rng(5)
    noise = np.random.Generator(np.random.Philox(9))
    augment.random(3)
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    url = str(tmp_path / "ckpt")
    api.save(
        url,
        step=1,
        model=model,
        optimizer=opt,
        sampler=sampler,
        config={},
        generators={"augment": augment, "noise": noise},
    )
    expected = (augment.random(4), noise.integers(0, 1 << 40, 4), random.random(), np.random.rand(), torch.rand(3))

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    fresh_augment, fresh_noise = np.random.default_rng(0), np.random.Generator(np.random.Philox(0))
    api.load(url, model=model, generators={"augment": fresh_augment, "noise": fresh_noise})
    got = (
        fresh_augment.random(4),
        fresh_noise.integers(0, 1 << 40, 4),
        random.random(),
        np.random.rand(),
        torch.rand(3),
    )
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2:4] == expected[2:4] and torch.equal(got[4], expected[4])
    generators = ckptfmt.open(url).read_context("rng")["generators"]
    assert {k: v["kind"] for k, v in generators.items()} == {
        "python": "python.random",
        "numpy": "numpy.random_state",
        "augment": "numpy.bit_generator",
        "noise": "numpy.bit_generator",
        "torch": "torch.cpu",
    }
    with pytest.raises(ContextError, match="'missing' is missing"):
        api.load(url, model=model, generators={"missing": np.random.default_rng()})


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float = 0.01
    layers: int = 2
    name: str = "tiny"
    tags: tuple[str, ...] = ("a", "b")


def test_dataclass_config(tmp_path: Path) -> None:
    model, opt, sampler = tiny_state()
    url = str(tmp_path / "ckpt")
    api.save(url, step=1, model=model, optimizer=opt, sampler=sampler, config=Config())
    stored = ckptfmt.open(url).read_context("config")
    assert stored["config"] == {"lr": 0.01, "layers": 2, "name": "tiny", "tags": ["a", "b"]}
    assert (
        stored["hash"] == api.state.config_field({"lr": 0.01, "layers": 2, "name": "tiny", "tags": ["a", "b"]})["hash"]
    )
    assert api.load(url, model=model, config=Config(), on_mismatch="strict").mismatches == ()
    with pytest.raises(CheckpointError, match="config must be a dict or a dataclass"):
        api.save(str(tmp_path / "other"), step=1, model=model, optimizer=opt, sampler=sampler, config=[1, 2])


# ---------------------------------------------------------------- resuming under a different run


def _git_repo(path: Path, content: str) -> str:
    path.mkdir()
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    (path / "train.py").write_text(content)
    for cmd in (["git", "init", "-q"], ["git", "add", "train.py"], ["git", "commit", "-q", "-m", "x"]):
        subprocess.run(cmd, cwd=path, check=True, env=env)
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=path, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def mismatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A checkpoint written from repository A, config lr=0.01, dataset v1; the current run: repository B,
    lr=0.02, dataset v2 with another shard list."""
    old_commit = _git_repo(tmp_path / "a", "print('a')")
    new_commit = _git_repo(tmp_path / "b", "print('b')")
    model, opt, _ = tiny_state()
    written = ResumableSampler(32, dataset=DatasetIdentity(name="c", version="v1", shards=("s0", "s1")))
    url = str(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path / "a")
    api.save(url, step=1, model=model, optimizer=opt, sampler=written, config=Config())
    monkeypatch.chdir(tmp_path / "b")
    current = ResumableSampler(32, dataset=DatasetIdentity(name="c", version="v2", shards=("s0", "s2")))
    return {
        "url": url,
        "model": model,
        "sampler": current,
        "config": dataclasses.replace(Config(), lr=0.02),
        "old": old_commit,
        "new": new_commit,
    }


def test_strict_refuses_and_names_every_difference(mismatched: dict[str, Any]) -> None:
    m = mismatched
    with pytest.raises(ResumeMismatchError) as info:
        api.load(m["url"], model=m["model"], sampler=m["sampler"], config=m["config"], on_mismatch="strict")
    message = str(info.value)
    assert "(differing keys: lr)" in message
    assert f"code commit {m['old']} in the checkpoint, {m['new']} now" in message
    assert "dataset version 'v1' in the checkpoint, 'v2' now" in message
    assert "dataset digest 'sha256:" in message
    assert m["sampler"].consumed == 0  # nothing applied


def test_warn_logs_and_resumes(mismatched: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    m = mismatched
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        restored = api.load(m["url"], model=m["model"], sampler=m["sampler"], config=m["config"])
    assert restored.step == 1 and len(restored.mismatches) == 4
    (record,) = [r for r in caplog.records if "under a different run" in r.getMessage()]
    assert record.levelno == logging.WARNING and "differing keys: lr" in record.getMessage()


def test_ignore_is_silent(mismatched: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    m = mismatched
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        restored = api.load(m["url"], model=m["model"], sampler=m["sampler"], config=m["config"], on_mismatch="ignore")
    assert restored.step == 1 and restored.mismatches and not caplog.records


def test_no_git_never_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, opt, sampler = tiny_state()
    url = str(tmp_path / "ckpt")
    api.save(url, step=1, model=model, optimizer=opt, sampler=sampler, config={})
    provenance = ckptfmt.open(url).read_context("provenance")
    assert "code" not in provenance and provenance["step"] == 1
    assert api.load(url, model=model, config={}, on_mismatch="strict").mismatches == ()


# ---------------------------------------------------------------- the manager


def _manager_run(run: Path, steps: tuple[int, ...], **kwargs: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at ``steps`` through a manager; returns the model state at each."""
    model, opt, sampler = tiny_state()
    states = {}
    with CheckpointManager(run, keep_last=None, **kwargs) as mgr:
        done = 0
        for step in steps:
            train(model, opt, step - done, seed=step)
            sampler.advance(step - done)
            done = step
            mgr.save(step, model=model, optimizer=opt, sampler=sampler, config={"k": 1})
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def test_restore_latest_falls_back_from_a_corrupt_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    states = _manager_run(run, (2, 4, 6))
    newest = run / checkpoint_name(6)
    data = sorted((newest / "weights").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # one flipped bit in a weight: the per-chunk digest catches it
    data.write_bytes(bytes(raw))
    model, opt, sampler = tiny_state(seed=9)
    sampler = ResumableSampler(32, seed=0)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        step = CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=sampler)
    assert step == 4
    assert_same(model.state_dict(), states[4])
    assert sampler.consumed == 4
    (record,) = [r for r in caplog.records if checkpoint_name(6) in r.getMessage()]
    assert record.levelno == logging.WARNING and "manifest says" in record.getMessage()


def test_restore_latest_skips_an_incomplete_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    states = _manager_run(run, (2, 4, 6))
    (run / checkpoint_name(6) / "manifest.json").unlink()  # as if killed before the commit
    model, opt, sampler = tiny_state(seed=9)
    sampler = ResumableSampler(32, seed=0)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        assert CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=sampler) == 4
    assert_same(model.state_dict(), states[4])
    assert any(checkpoint_name(6) in r.getMessage() and "incomplete" in r.getMessage() for r in caplog.records)


def test_restore_latest_on_an_empty_run(tmp_path: Path) -> None:
    model, opt, sampler = tiny_state()
    assert CheckpointManager(tmp_path / "run").restore_latest(model=model, optimizer=opt, sampler=sampler) is None


def test_manager_retention_latest_and_pins(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, opt, sampler = tiny_state()
    with CheckpointManager(run, keep_last=2, keep_every=4) as mgr:
        for step in range(1, 8):
            if step == 3:
                mgr.pin(1)
            mgr.save(step, model=model, optimizer=opt, sampler=sampler, config={})
    rd = RunDirectory(run)
    assert [e.step for e in rd.entries()] == [7, 6, 4, 1]  # last two, multiples of 4, the pinned one
    latest = rd.latest()
    assert latest is not None and latest["step"] == 7 and latest["checkpoint_id"] == mgr.last_checkpoint_id
    parents = [ckptfmt.open(str(run / checkpoint_name(s))).read_context("provenance").get("parent") for s in (6, 7)]
    assert parents[1] == ckptfmt.open(str(run / checkpoint_name(6))).id and parents[0] is not None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_is_raised_never_swallowed(tmp_path: Path, async_save: bool) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / checkpoint_name(2)).write_text("a file where the checkpoint directory must go")  # storage refuses
    model, opt, sampler = tiny_state()
    mgr = CheckpointManager(run, async_save=async_save)
    mgr.save(1, model=model, optimizer=opt, sampler=sampler, config={})
    if async_save:
        mgr.save(2, model=model, optimizer=opt, sampler=sampler, config={})  # returns: the write is in the background
        with pytest.raises(StorageError):
            mgr.save(3, model=model, optimizer=opt, sampler=sampler, config={})  # the next call raises it
        mgr.save(3, model=model, optimizer=opt, sampler=sampler, config={})  # raised once, then saving goes on
    else:
        with pytest.raises(StorageError):
            mgr.save(2, model=model, optimizer=opt, sampler=sampler, config={})
    mgr.close()
    latest = RunDirectory(run).latest()
    assert latest is not None and latest["step"] == (3 if async_save else 1)


def test_a_background_failure_surfaces_in_checkpoint_if_due_and_wait(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / checkpoint_name(4)).write_text("in the way")
    model, opt, sampler = tiny_state()
    mgr = CheckpointManager(run, async_save=True)
    kw: dict[str, Any] = {"model": model, "optimizer": opt, "sampler": sampler, "config": {}}
    assert mgr.checkpoint_if_due(4, every=4, **kw)
    with pytest.raises(StorageError):
        for step in range(5, 1000):  # not due: each call still checks the save in flight
            mgr.checkpoint_if_due(step, every=1000, **kw)
            time.sleep(0.01)
    assert mgr.checkpoint_if_due(8, every=4, **kw)
    assert mgr.wait() is not None
    with pytest.raises(StorageError):
        bad = CheckpointManager(run, async_save=True)
        (run / checkpoint_name(12)).write_text("in the way")
        bad.save(12, **kw)
        bad.wait()
    mgr.close()


class SlowMemoryFS(MemoryFileSystem):
    """The memory file system, whose manifest commits each wait for a permit from the test; records how many
    writer locks exist at each new one, and which thread made each commit."""

    protocol = ("slowmem", "memory")
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    locks_at_create: ClassVar[list[int]] = []
    commit_permits: ClassVar[threading.Semaphore] = threading.Semaphore(0)
    commit_threads: ClassVar[list[threading.Thread]] = []

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        if path.endswith("/.writer-lock"):
            root = path.rsplit("/", 2)[0]
            others = [p for p in self.store if p.startswith(root) and p.endswith("/.writer-lock")]
            self.locks_at_create.append(len(others))
        if path.endswith("/manifest.json"):
            self.commit_threads.append(threading.current_thread())
            # made on the caller's thread, the commit would block save() itself: fail there, not hang
            if threading.current_thread() is not threading.main_thread():
                assert self.commit_permits.acquire(timeout=60), "hang guard: the test never released this commit"
        super().pipe_file(path, value, mode=mode, **kwargs)


@pytest.fixture
def slow_url() -> Iterator[str]:
    fsspec.register_implementation("slowmem", SlowMemoryFS, clobber=True)
    SlowMemoryFS.locks_at_create.clear()
    SlowMemoryFS.commit_threads.clear()
    SlowMemoryFS.commit_permits = threading.Semaphore(0)
    yield f"slowmem://run-{uuid.uuid4().hex}"


def test_at_most_one_save_in_flight(slow_url: str) -> None:
    model, opt, sampler = tiny_state()
    kw: dict[str, Any] = {"model": model, "optimizer": opt, "sampler": sampler, "config": {}}
    mgr = CheckpointManager(slow_url, async_save=True, keep_last=None)
    rd = RunDirectory(slow_url)
    mgr.save(1, **kw)
    # returned while its commit cannot have happened: that needs a permit, and none was given yet
    assert threading.main_thread() not in SlowMemoryFS.commit_threads
    assert {e.step: e.status for e in rd.entries()}.get(1) != "committed"
    for step in (2, 3):
        # the previous commit is let through only once this save has begun; the call must wait for it
        releaser = threading.Timer(0.05, SlowMemoryFS.commit_permits.release)
        releaser.start()
        mgr.save(step, **kw)
        releaser.join()
        assert {e.step: e.status for e in rd.entries()}[step - 1] == "committed"
    SlowMemoryFS.commit_permits.release()  # the last one's
    mgr.close()
    assert SlowMemoryFS.locks_at_create == [0, 0, 0]  # never two writers at once
    assert [e.status for e in rd.entries()] == ["committed"] * 3
    assert threading.main_thread() not in SlowMemoryFS.commit_threads
    assert threading.active_count() < 50


def test_preemption_flag_saves_and_exits(tmp_path: Path) -> None:
    model, opt, sampler = tiny_state()
    kw: dict[str, Any] = {"model": model, "optimizer": opt, "sampler": sampler, "config": {}}
    mgr = CheckpointManager(tmp_path / "run", async_save=True)
    assert not mgr.checkpoint_if_due(3, every=10, **kw)
    mgr.request_preemption()
    with pytest.raises(SystemExit) as info:
        mgr.checkpoint_if_due(5, every=10, **kw)
    assert info.value.code == 0
    latest = RunDirectory(tmp_path / "run").latest()
    assert latest is not None and latest["step"] == 5  # durable before the exit


def test_restore_latest_does_not_fall_back_when_the_run_differs(tmp_path: Path) -> None:
    """A verified checkpoint that this run refuses (strict mismatch, another data order) is an error, not a
    reason to resume from an older checkpoint or from scratch."""
    run = tmp_path / "run"
    _manager_run(run, (2, 4))
    model, opt, _ = tiny_state()
    with pytest.raises(ResumeMismatchError, match="differing keys: k"):
        CheckpointManager(run, on_mismatch="strict").restore_latest(model=model, optimizer=opt, config={"k": 2})
    with pytest.raises(ContextError, match="sampler seed is 9 here but 0"):
        CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=9))


# ---------------------------------------------------------------- never half-loaded; restore_latest falls back


def test_restore_latest_skips_a_weights_profile_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    states = _manager_run(run, (2, 4))
    model, _, _ = tiny_state()
    with ckptfmt.open_writer(str(run / checkpoint_name(6)), profile="weights") as w:  # e.g. an exported model
        w.write_tensors("weights", {k: v.detach().numpy() for k, v in model.state_dict().items()})
        w.write_context("provenance", {"step": 6})
    model, opt, sampler = tiny_state(seed=9)
    sampler = ResumableSampler(32, seed=0)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        assert CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=sampler) == 4
    assert_same(model.state_dict(), states[4])
    (record,) = [r for r in caplog.records if checkpoint_name(6) in r.getMessage()]
    assert "no optimizer, data, rng field (profile 'weights')" in record.getMessage()
    # loaded on its own, a weights checkpoint restores the model; asked for more, it names what is missing
    api.load(run / checkpoint_name(6), model=model)
    with pytest.raises(FieldNotFoundError, match="no optimizer, rng field"):
        api.load(run / checkpoint_name(6), model=model, optimizer=opt)


def test_restore_latest_falls_back_from_a_checkpoint_that_fails_when_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever reading the newest raises (here an OverflowError from a tensor, as a hostile shape could),
    restore_latest logs it and resumes from the one before; the model is touched only by that one."""
    run = tmp_path / "run"
    states = _manager_run(run, (2, 4, 6))
    real = ckptfmt.reader.Checkpoint.read_regions

    def read_regions(self: Any, targets: Any, *args: Any, **kwargs: Any) -> Any:
        if self.url.rstrip("/").endswith(checkpoint_name(6)) and any(t.field == "optimizer" for t in targets):
            raise OverflowError("cannot fit 'int' into an index-sized integer")
        return real(self, targets, *args, **kwargs)

    monkeypatch.setattr(ckptfmt.reader.Checkpoint, "read_regions", read_regions)
    model, opt, _ = tiny_state(seed=9)
    sampler = ResumableSampler(32, seed=0)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        assert CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=sampler) == 4
    assert_same(model.state_dict(), states[4])
    (record,) = [r for r in caplog.records if checkpoint_name(6) in r.getMessage()]
    assert "cannot be read: OverflowError" in record.getMessage()


def test_restore_latest_falls_back_from_a_context_failing_its_schema(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    states = _manager_run(run, (2, 4))
    model, opt, sampler = tiny_state()
    sampler.advance(2)
    api.save(run / checkpoint_name(6), step=6, model=model, optimizer=opt, sampler=sampler, config={"k": 1})
    # rewrite the data blob with an epoch of -1 (FLD-5): the checkpoint opens, and fails only when the
    # field is decoded
    blob = run / checkpoint_name(6) / "data" / "context.msgpack"
    body = ckptfmt.context.decode(blob.read_bytes())
    body["epoch"] = -1
    raw = ckptfmt.context.encode(body)
    blob.write_bytes(raw)
    ckpt_dir = run / checkpoint_name(6)
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    (entry,) = [f for f in manifest["files"] if f["path"] == "data/context.msgpack"]
    entry["size"], entry["digest"] = len(raw), ckptfmt.digests.digest_of("xxh3-128", raw)
    (ckpt_dir / "manifest.json").write_bytes(ckptfmt.canonical.canonical_json(manifest))
    with pytest.raises(ContextError, match="epoch"):
        ckptfmt.open(str(ckpt_dir)).read_context("data")
    model, opt, _ = tiny_state(seed=9)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        step = CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0))
    assert step == 4
    assert_same(model.state_dict(), states[4])
    assert any(checkpoint_name(6) in r.getMessage() and "epoch" in r.getMessage() for r in caplog.records)


def _live_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "scheduler": copy.deepcopy(sched.state_dict()),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].tobytes(),
    }


def test_a_failed_apply_leaves_every_live_object_as_it_was(tmp_path: Path) -> None:
    """Refused before anything is applied (another optimizer class), or failing late (a generator of
    another kind, after the optimizer, scheduler and global RNGs were applied): all put back."""
    model, opt, sampler = tiny_state()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 3)
    sched.step()
    sampler.advance(2)
    url = tmp_path / "c"
    api.save(url, step=3, model=model, optimizer=opt, sampler=sampler, scheduler=sched, config={},
             generators={"aug": np.random.default_rng(1)})  # fmt: skip

    model, opt, _ = tiny_state(seed=5)
    sampler = ResumableSampler(32, seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    random.seed(11)
    np.random.seed(12)
    before = _live_state(model, opt, sched)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="holds AdamW state, the optimizer is SGD"):
        api.load(url, model=model, optimizer=sgd, sampler=sampler)
    assert_same(_live_state(model, opt, sched), before)
    other_kind = {"aug": np.random.Generator(np.random.MT19937(0))}
    with pytest.raises(ContextError, match="aug"):
        api.load(url, model=model, optimizer=opt, sampler=sampler, scheduler=sched, generators=other_kind)
    assert_same(_live_state(model, opt, sched), before)
    assert sampler.consumed == 0  # the data position is applied after the RNG: untouched too
    api.load(url, model=model, optimizer=opt, sampler=sampler, scheduler=sched,
             generators={"aug": np.random.default_rng(0)})  # fmt: skip
    assert sampler.consumed == 2


def test_manager_on_two_ranks_saves_together_and_restores_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks as threads (ThreadCollective): one checkpoint per step written by both, the run directory kept by
    rank 0; a checkpoint that only rank 1 cannot read is skipped by both, so the job never splits."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptfmt.collective import ThreadCollective

    run = tmp_path / "run"
    group = ThreadCollective.group(2)

    built = [tiny_state() for _ in range(2)]  # here, not in the threads: torch's global RNG is one for all

    def save(rank: int) -> dict[int, dict[str, torch.Tensor]]:
        model, opt, _ = built[rank]
        sampler = ResumableSampler(32, seed=0, rank=rank, world_size=2)
        states = {}
        with CheckpointManager(run, keep_last=None, collective=group[rank]) as mgr:
            for step in (2, 4, 6):
                train(model, opt, 2, seed=step)
                sampler.advance(2)
                mgr.save(step, model=model, optimizer=opt, sampler=sampler, config={"k": 1})
                states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return states

    with ThreadPoolExecutor(2) as pool:
        saved = list(pool.map(save, range(2)))
    latest = RunDirectory(run).latest()
    assert latest is not None and latest["step"] == 6
    assert ckptfmt.open(str(run / checkpoint_name(6))).read_context("data")["global_sample_offset"] == 12

    real = read_state.read_snapshot

    def read_snapshot(ckpt: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.endswith("_1") and ckpt.url.rstrip("/").endswith(checkpoint_name(6)):
            raise OSError("rank 1 lost its connection to the store")
        return real(ckpt, *args, **kwargs)

    monkeypatch.setattr(read_state, "read_snapshot", read_snapshot)

    fresh = [tiny_state(seed=9) for _ in range(2)]

    def restore(rank: int) -> tuple[int | None, dict[str, torch.Tensor], int]:
        model, opt, _ = fresh[rank]
        sampler = ResumableSampler(32, seed=0, rank=rank, world_size=2)
        step = CheckpointManager(run, collective=group[rank]).restore_latest(
            model=model, optimizer=opt, sampler=sampler
        )
        return step, model.state_dict(), sampler.consumed

    with caplog.at_level(logging.WARNING, logger="ckptfmt"), ThreadPoolExecutor(2) as pool:
        restored = list(pool.map(restore, range(2)))
    for step, weights, consumed in restored:
        assert step == 4 and consumed == 8
        assert_same(weights, saved[0][4])
    assert any("another rank cannot use it" in r.getMessage() for r in caplog.records)


def test_restore_logs_a_change_of_topology(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _manager_run(
        run,
        (2,),
    )
    model, opt, _ = tiny_state()
    now = {"world_size": 2, "mesh": {"dims": ["dp"], "shape": [2]}}
    monkeypatch.setattr(api, "topology", lambda mesh=None: now)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        CheckpointManager(run).restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0))
    assert any(
        r.getMessage() == f"resuming {checkpoint_name(2)} saved on 1 rank(s) on 2 rank(s) with mesh {{'dp': 2}}"
        for r in caplog.records
    )
