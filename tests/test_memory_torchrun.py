"""A worker SIGKILLed at a random step under torchrun (2 FSDP2 ranks over gloo) resumes from the memory tier at
the step it completed, and the run ends bit-identical to an uninterrupted one (spec/memory.md).

The reference and the killed run go side by side (four processes on the CI machine's two cores): one module
fixture, so the cost is one torchrun start-up and one restart.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import warm_server

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
CKPT = Path(sys.executable).with_name("ckpt")
STEPS, EVERY = 10, 4  # durable every 4 steps: a kill between them loses steps without the memory tier
JOB = "ckptfmt-memory-test"


def launch(run_dir: Path, losses: Path, *args: str, restarts: int = 0, job: str | None = None) -> subprocess.Popen[str]:
    """torchrun on 2 ranks; ``job`` fixes the run id (TORCHELASTIC_RUN_ID), as a relaunched job keeps it. Forked
    warm (tests/warm_server.py); the reference (no job) from a server of its own: another string-hash seed."""
    rdzv = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={job}"] if job else ["--standalone"]
    options = [*rdzv, "--nnodes=1", "--nproc-per-node=2", f"--max-restarts={restarts}", "--monitor-interval=0.2"]
    script = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--every", str(EVERY)]
    script += ["--keep-last", "100", "--losses-out", str(losses), *args]
    cmd = warm_server.shared("default" if job else "other").torchrun(options, TRAIN, *script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("memory-torchrun")
    chooser = random.Random(os.environ.get("CKPTFMT_KILL_SEED"))
    kill_step, kill_rank = chooser.randint(2, STEPS - 1), chooser.randint(0, 1)
    print(f"[memory-torchrun] SIGKILL rank {kill_rank} after step {kill_step}")
    reference = launch(tmp / "reference", tmp / "reference.json")
    killed = launch(
        tmp / "killed",
        tmp / "killed.json",
        *("--memory-every", "1", "--memory-dir", str(tmp / "shm")),
        *("--kill-at-step", str(kill_step), "--kill-rank", str(kill_rank)),
        restarts=1,
        job=JOB,
    )
    out: dict[str, Any] = {"tmp": tmp, "kill_step": kill_step, "kill_rank": kill_rank}
    for name, proc in (("reference", reference), ("killed", killed)):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
        out[name] = stdout
    return out


def test_a_killed_worker_resumes_from_memory_at_its_last_step(runs: dict[str, Any]) -> None:
    step, out = runs["kill_step"], runs["killed"]
    assert f"rank {runs['kill_rank']}: memory snapshot of step {step} is in; SIGKILL" in out
    assert f"resumed at step {step} (ranks=2" in out and "attempt=1, from memory)" in out
    report = json.loads(re.search(r"restore report: (\{.*\})", out).group(1))  # type: ignore[union-attr]
    assert report["tier"] == "memory" and report["step"] == step and report["skipped"] == []
    killed_at = float(re.search(r"SIGKILL at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    first = float(re.search(r"first step of attempt 1 done at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    print(f"[memory-torchrun] kill to first resumed step: {first - killed_at:.1f} s, restore {report['seconds']:.3f} s")


def test_the_resumed_run_is_bit_identical_to_an_uninterrupted_one(runs: dict[str, Any]) -> None:
    tmp: Path = runs["tmp"]
    reference = json.loads((tmp / "reference.json").read_text())["losses"]
    assert json.loads((tmp / "killed.json").read_text())["losses"] == reference  # every step's loss, same bits
    final = f"step-{STEPS:09d}"
    ignore = ["--ignore", "provenance", "--ignore", "metadata.ckptfmt.memory.*"]
    diff = subprocess.run(
        [str(CKPT), "diff", *ignore, str(tmp / "reference" / final), str(tmp / "killed" / final)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr  # weights, optimizer, RNG of both ranks, data position


def test_durable_saves_came_from_memory_and_verify(runs: dict[str, Any]) -> None:
    tmp: Path = runs["tmp"]
    durable = sorted(p.name for p in (tmp / "killed").iterdir() if (p / "manifest.json").exists())
    # the final save, and at least one before it (step 4, or a later snapshot when the copy of step 4 started
    # after its slot was rewritten: spec/memory.md, persisting)
    assert durable[-1] == f"step-{STEPS:09d}" and len(durable) >= 2, durable
    verify = subprocess.run([str(CKPT), "verify", str(tmp / "killed" / f"step-{STEPS:09d}")], capture_output=True)
    assert verify.returncode == 0, verify.stdout


def test_a_shard_bad_on_one_rank_makes_every_rank_fall_back(runs: dict[str, Any]) -> None:
    """The job relaunched (same run id): the newest slot has a byte flipped in a data file only rank 1 reads
    (FSDP: each rank reads its own region); rank 0 could use the slot, but both fall back together."""
    tmp: Path = runs["tmp"]
    shm = tmp / "shm"
    slots: dict[int, list[Path]] = {}
    for slot in shm.glob("run-*/slot-*"):
        manifest = json.loads((slot / "manifest.json").read_text())
        slots.setdefault(int(manifest["metadata"]["ckptfmt.memory.step"]), []).append(slot)
    assert len(slots[max(slots)]) == 1, slots  # one snapshot a step (a save() at a snapshotted step adds none)
    newest = slots[max(slots)][0]
    target = max(newest.glob("optimizer/r00001-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x10
    target.write_bytes(bytes(data))
    again = launch(tmp / "killed", tmp / "again.json", "--memory-every", "1", "--memory-dir", str(shm), job=JOB)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stdout[-3000:] + stderr[-5000:]
    report = json.loads(re.search(r"restore report: (\{.*\})", stdout).group(1))  # type: ignore[union-attr]
    assert report["step"] == max(slots) and report["tier"] == "durable", report  # same step, from disk
    assert any("another rank cannot use it" in s and str(newest) in s for s in report["skipped"]), report
    assert "DigestMismatchError" in stderr and "r00001" in stderr  # rank 1 said why
