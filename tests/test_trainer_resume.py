"""A resumed run is the same run: examples/train.py killed (SIGKILL, SIGTERM) and resumed in a fresh process
reproduces an uninterrupted run bit for bit; withholding the RNG, data position or optimizer state breaks it.

Every run here is a real subprocess. The run is STEPS = 2N = 24 optimizer steps, checkpoints every 4,
SIGKILL right after the checkpoint at step N = 12 is durable.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import warm_ranks
from concurrent_runs import Jobs

import ckptfmt
from ckptfmt.run import RunDirectory, checkpoint_name

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
CKPT = Path(sys.executable).parent / "ckpt"
STEPS, KILL, EVERY = 24, 12, 4
FINAL = checkpoint_name(STEPS)
WITHHELD = ("rng", "data", "optimizer")


@dataclass(frozen=True)
class Run:
    run_dir: Path
    losses: list[list[float]]  # [step, loss] for the steps this process ran
    proc: subprocess.CompletedProcess[str]


def train(run_dir: Path, *args: str, name: str = "losses", check: bool = True) -> Run:
    losses_file = run_dir.parent / f"{run_dir.name}-{name}.json"
    argv = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--every", str(EVERY), "--losses-out", str(losses_file)]
    proc = warm_ranks.run(TRAIN, [*argv, *args], timeout=300)  # forked warm: tests/warm_ranks.py
    if check:
        assert proc.returncode == 0, proc.stderr
    losses = json.loads(losses_file.read_text())["losses"] if losses_file.exists() else []
    return Run(run_dir, losses, proc)


def killed(run_dir: Path, *args: str) -> Run:
    run = train(run_dir, "--kill-after-checkpoint-step", str(KILL), *args, name="killed", check=False)
    assert run.proc.returncode == -signal.SIGKILL, run.proc.stderr
    assert [s for s, _ in run.losses] == list(range(1, KILL + 1))
    latest = RunDirectory(run_dir).latest()
    assert latest is not None and latest["step"] == KILL  # the checkpoint was durable before the kill
    return run


def resumed_copy(base: Run, dest: Path, *args: str) -> Run:
    """Resume a copy of ``base``'s run directory, so one killed run serves several resumes."""
    shutil.copytree(base.run_dir, dest)
    run = train(dest, *args, name="resumed")
    assert run.proc.stdout.startswith(f"resumed at step {KILL}"), run.proc.stdout
    return run


def ckpt_diff(a: Path, b: Path, *ignore: str) -> subprocess.CompletedProcess[str]:
    args = [arg for glob in ("provenance", *ignore) for arg in ("--ignore", glob)]
    return subprocess.run(
        [str(CKPT), "diff", str(a / FINAL), str(b / FINAL), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_same_state(a: Path, b: Path) -> None:
    """Final weights and optimizer state bit-identical (tensors and context), and ``ckpt diff`` agrees."""
    with ckptfmt.open(str(a / FINAL)) as ca, ckptfmt.open(str(b / FINAL)) as cb:
        for field in ("weights", "optimizer"):
            ta, tb = ca.read_tensors(field), cb.read_tensors(field)
            assert set(ta) == set(tb)
            for name in ta:
                assert ta[name].dtype == tb[name].dtype and ta[name].tobytes() == tb[name].tobytes(), name
        for field in ("optimizer", "scheduler", "data", "config"):
            assert json.dumps(ca.read_context(field), default=str) == json.dumps(cb.read_context(field), default=str)
    diff = ckpt_diff(a, b)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert json.loads(diff.stdout)["identical"] is True


def reference_run(work: Path) -> Run:
    """The uninterrupted run: 24 steps, one process, no DataLoader workers."""
    run = train(work / "reference")
    assert [s for s, _ in run.losses] == list(range(1, STEPS + 1))
    return run


@dataclass(frozen=True)
class Stopped:
    """The first process of the SIGTERM test: its exit status, stderr, losses, and the run's latest checkpoint
    when it had exited (before the resume adds more)."""

    run_dir: Path
    returncode: int
    stderr: str
    losses: list[list[float]]
    latest: dict[str, Any] | None


def sigterm_after_step_5(run_dir: Path) -> Stopped:
    losses_file = run_dir.parent / f"{run_dir.name}-first.json"
    cmd = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), "--steps", str(STEPS), "--every", str(EVERY)]
    proc = subprocess.Popen(
        [*cmd, "--losses-out", str(losses_file), "--step-sleep", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 5 "):
            proc.send_signal(signal.SIGTERM)  # lands right after step 5, or while step 6 sleeps
            break
    _, err = proc.communicate(timeout=120)
    losses = json.loads(losses_file.read_text())["losses"] if losses_file.exists() else []
    return Stopped(run_dir, proc.returncode, err, losses, RunDirectory(run_dir).latest())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Every training process of this module, independent ones side by side (see concurrent_runs.py).

    ``killed`` is 12 steps with two DataLoader workers prefetching, then SIGKILL right after the step-12
    checkpoint; four tests resume copies of it.
    """
    work = tmp_path_factory.mktemp("trainer")
    jobs = Jobs()
    jobs.add("killed", lambda: killed(work / "killed", "--workers", "2"))
    jobs.add("sigterm", lambda: sigterm_after_step_5(work / "sigterm"))
    jobs.add("threads-killed", lambda: killed(work / "threads", "--threads", "2"))
    jobs.add("async-killed", lambda: killed(work / "async", "--async"))
    jobs.add("reference", lambda: reference_run(work))
    jobs.add(
        "threads-reference", lambda: train(work / "threads-reference", "--threads", "2", "--threads-at", f"{KILL}:1")
    )
    jobs.add("resumed", lambda base: resumed_copy(base, work / "resumed", "--workers", "2"), "killed")
    for withheld in WITHHELD:
        jobs.add(
            f"withheld-{withheld}",
            lambda base, w=withheld: resumed_copy(base, work / f"withheld-{w}", "--withhold", w),
            "killed",
        )
    jobs.add("sigterm-resumed", lambda first: train(first.run_dir, name="resumed"), "sigterm")
    jobs.add("threads-resumed", lambda first: train(first.run_dir, "--threads", "1", name="resumed"), "threads-killed")
    jobs.add("async-resumed", lambda first: train(first.run_dir, "--async", name="resumed"), "async-killed")
    return jobs.run()


def test_sigkill_and_resume_is_bit_identical(runs: Jobs) -> None:
    reference, killed_run, resumed = runs["reference"], runs["killed"], runs["resumed"]
    assert killed_run.losses + resumed.losses == reference.losses  # every step's loss, bit for bit
    assert_same_state(reference.run_dir, resumed.run_dir)
    verify = subprocess.run(
        [str(CKPT), "verify", str(resumed.run_dir / FINAL)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    provenance = ckptfmt.open(str(resumed.run_dir / checkpoint_name(16))).read_context("provenance")
    assert provenance["parent"] == ckptfmt.open(str(killed_run.run_dir / checkpoint_name(KILL))).id


@pytest.mark.parametrize(
    ("withheld", "first_divergent_step"),
    [("rng", KILL + 1), ("data", KILL + 1), ("optimizer", KILL + 2)],
)
def test_negative_controls_detect_a_withheld_field(runs: Jobs, withheld: str, first_divergent_step: int) -> None:
    """The comparison can fail: resuming without one field diverges, and both the losses and ckpt diff show it."""
    reference, killed_run, resumed = runs["reference"], runs["killed"], runs[f"withheld-{withheld}"]
    losses = killed_run.losses + resumed.losses
    assert [s for s, _ in losses] == [s for s, _ in reference.losses]
    differing = [s for (s, a), (_, b) in zip(losses, reference.losses, strict=True) if a != b]
    # dropout masks / batches differ at once; fresh AdamW moments first change the update after the next loss
    assert differing and differing[0] == first_divergent_step
    diff = ckpt_diff(reference.run_dir, resumed.run_dir)
    assert diff.returncode == 1, diff.stdout + diff.stderr
    doc = json.loads(diff.stdout)
    changed = {t["field"] for t in doc["tensors"]["changed"]}
    assert {"weights", "optimizer"} <= changed
    if withheld == "data":
        assert any(c["field"] == "data" for c in doc["context"])  # the position itself differs too


def test_resume_under_another_thread_count(runs: Jobs) -> None:
    """Checkpoint written with 2 torch threads, resumed with 1.

    torch's CPU kernels are not bit-identical across thread counts (matmul and reduction splits change
    the rounding), so 2N steps on 1 thread is not the reference. The reference is one uninterrupted
    process that switches from 2 threads to 1 after step N: the same kernels on the same steps, so any
    difference comes from the checkpoint and restart alone.
    """
    reference, first, resumed = runs["threads-reference"], runs["threads-killed"], runs["threads-resumed"]
    assert first.losses + resumed.losses == reference.losses
    assert_same_state(reference.run_dir, resumed.run_dir)
    topology = ckptfmt.open(str(first.run_dir / checkpoint_name(16))).read_context("topology")
    assert topology["threads"] == 1


def test_sigterm_mid_training_saves_exits_and_resumes(runs: Jobs) -> None:
    """SIGTERM lands inside a step: the step finishes, an emergency checkpoint is written, the process exits 0."""
    reference, stopped_run = runs["reference"], runs["sigterm"]
    run_dir = stopped_run.run_dir
    assert stopped_run.returncode == 0, stopped_run.stderr
    first = stopped_run.losses
    stopped = first[-1][0]
    assert 5 <= stopped < STEPS  # the step in progress when the signal landed, mid-training
    assert "emergency checkpoint" in stopped_run.stderr
    latest = stopped_run.latest
    assert latest is not None and latest["step"] == stopped  # the step in progress finished and was saved
    resumed = runs["sigterm-resumed"]
    assert resumed.proc.stdout.startswith(f"resumed at step {stopped}")
    assert first + resumed.losses == reference.losses
    assert_same_state(reference.run_dir, run_dir)


def test_async_saves_give_the_same_run(runs: Jobs) -> None:
    reference, first, resumed = runs["reference"], runs["async-killed"], runs["async-resumed"]
    assert first.losses + resumed.losses == reference.losses
    assert_same_state(reference.run_dir, resumed.run_dir)
