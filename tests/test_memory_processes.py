"""The memory tier across real process deaths: SIGTERM mid-run, SIGTERM while the trainer's thread is blocked
(only the watcher thread can act), and a restart after SIGKILL that resumes from memory (spec/memory.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ckptfmt
from ckptfmt.run import RunDirectory

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def start(run_dir: Path, shm: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), "--memory-every", "1", "--memory-dir", str(shm)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 120.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line starting {prefix!r}: {''.join(seen)[-3000:]}")


def test_sigterm_mid_run_makes_the_newest_snapshot_durable_and_exits(tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    proc = start(run_dir, shm, "--steps", "40", "--every", "100", "--step-sleep", "0.2")
    wait_for_line(proc, "step 3 ")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    entries = [e for e in RunDirectory(run_dir).entries() if e.status == "committed"]
    assert entries, out
    step = entries[0].step
    assert f"emergency checkpoint at step {step} is durable (from memory)" in out
    assert step is not None and 3 <= step < 40
    assert ckptfmt.verify(run_dir / f"step-{step:09d}").ok


BLOCKED = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from ckptfmt.torch import CheckpointManager, ResumableDataLoader

    run_dir, shm = sys.argv[1], sys.argv[2]
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ResumableDataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, seed=1)
    mgr = CheckpointManager(run_dir, loader=loader, memory_every=1, memory_dir=shm)
    for step, (x,) in enumerate(loader, start=1):
        model(x).sum().backward()
        opt.step()
        mgr.checkpoint_if_due(step, every=1000, model=model, optimizer=opt, config={"a": 1})
        if step == 3:
            break
    mgr.wait_memory()
    print("blocked", flush=True)
    r, w = os.pipe()
    os.read(r, 1)  # blocked for good, as a trainer waiting on a dead peer's collective is
    """
)


def test_sigterm_while_the_trainer_is_blocked_is_handled_by_the_watcher(tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(shm)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, "blocked")
        assert not (run_dir / "step-000000003").exists()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        # latest.json is written last, after the checkpoint commits (its manifest appearing is not the end)
        while not (run_dir / "latest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None  # still blocked: the persist came from the watcher thread
        assert ckptfmt.verify(run_dir / "step-000000003").ok
        assert json.loads((run_dir / "latest.json").read_text())["step"] == 3
    finally:
        proc.kill()
        proc.communicate()


def test_ckpt_rescue_after_a_sigkill_makes_the_last_step_durable(tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    proc = start(run_dir, shm, "--steps", "20", "--every", "100", "--kill-at-step", "6")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out
    assert not (run_dir / "step-000000006").exists()  # durable saves every 100 steps: only memory has it
    ckpt = Path(sys.executable).with_name("ckpt")
    done = subprocess.run([str(ckpt), "rescue", str(shm), str(run_dir), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = {s["slot"]["step"]: s["status"] for s in json.loads(done.stdout)["slots"]}
    assert statuses[6] == "persisted", statuses
    assert ckptfmt.verify(run_dir / "step-000000006").ok
    assert json.loads((run_dir / "latest.json").read_text())["step"] == 6
