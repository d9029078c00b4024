"""Recovery end to end under torchrun: examples/train.py on 4 FSDP2 ranks (gloo), one rank SIGKILLed after a
checkpoint, torchrun restarts the group, the run resumes from the newest committed checkpoint and ends
bit-identical to an uninterrupted 4-rank run; then the same run goes on with 2 ranks and continues the
same global sample order (no sample repeated or skipped).

The costliest test of the suite (a dozen processes importing torch): one module-scoped set of runs, the
reference side by side with the killed run and its continuation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_server
from concurrent_runs import Jobs

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
CKPT = Path(sys.executable).with_name("ckpt")
EVERY, KILL, STEPS_4, STEPS_2 = 2, 6, 10, 18  # 4 ranks x 16 = 64 samples a step, 256 an epoch


def torchrun(
    ranks: int, run_dir: Path, steps: int, *args: str, restarts: int = 0, server: str = "default"
) -> subprocess.CompletedProcess[str]:
    """torchrun and its workers forked warm (tests/warm_server.py); ``server`` picks the string-hash seed."""
    options = ["--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={restarts}", "--monitor-interval=0.5"]
    script = ["--run-dir", str(run_dir), "--steps", str(steps), "--every", str(EVERY), "--keep-last", "100", *args]
    cmd = warm_server.shared(server).torchrun(options, TRAIN, *script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def losses(path: Path) -> list[list[float]]:
    return json.loads(path.read_text())["losses"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def runs(tmp: Path) -> Jobs:
    """The uninterrupted 4-rank run side by side with the killed one and its 2-rank continuation: each is
    start-up and rendezvous for much of its time, so together they use the cores better (concurrent_runs.py)."""
    jobs = Jobs(workers=2)
    jobs.add(
        "killed",
        lambda: torchrun(
            4,
            tmp / "killed",
            STEPS_4,
            *("--kill-after-checkpoint-step", str(KILL), "--kill-rank", "2"),
            *("--losses-out", str(tmp / "killed.json"), "--samples-out", str(tmp / "samples")),
            restarts=1,
        ),
    )
    jobs.add(
        "reference",
        lambda: torchrun(4, tmp / "reference", STEPS_4, "--losses-out", str(tmp / "reference.json"), server="other"),
    )
    jobs.add(
        "smaller",
        lambda _: torchrun(
            2,
            tmp / "killed",
            STEPS_2,
            *("--losses-out", str(tmp / "killed.json"), "--samples-out", str(tmp / "samples")),
        ),
        "killed",
    )
    return jobs.run()


def test_a_killed_rank_is_restarted_and_the_run_ends_bit_identical(runs: Jobs, tmp: Path) -> None:
    out = runs["killed"].stdout
    assert f"rank 2: checkpoint at step {KILL} is durable; SIGKILL" in out
    assert f"resumed at step {KILL} (ranks=4" in out and "attempt=1" in out
    killed_at = float(re.search(r"SIGKILL at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    first = float(re.search(r"first step of attempt 1 done at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    print(f"[torchrun] kill to first resumed step: {first - killed_at:.1f} s")
    assert runs["reference"].returncode == 0
    reference = losses(tmp / "reference.json")
    assert losses(tmp / "killed.json")[:STEPS_4] == reference  # every step's loss, the same bits
    final = f"step-{STEPS_4:09d}"
    diff = subprocess.run(
        [str(CKPT), "diff", "--ignore", "provenance", str(tmp / "reference" / final), str(tmp / "killed" / final)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr  # weights, optimizer, RNG of every rank, data


def _reference_order(epochs: int) -> list[int]:
    """The global sample order a 1-rank run of the same loader hands out, epoch after epoch."""
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train as example  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    cfg = example.TrainConfig()
    loader = example.build(cfg, indexed=True).loader
    order: list[int] = []
    for _ in range(epochs):
        for batch in loader:
            order.extend(int(i) for i in batch[2])
    return order


def test_resuming_on_two_ranks_continues_the_global_sample_order(runs: Jobs, tmp: Path) -> None:
    assert f"resumed at step {STEPS_4} (ranks=2" in runs["smaller"].stdout
    per_rank = [json.loads((tmp / f"samples.rank{r}.json").read_text())["steps"] for r in range(4)]
    reference = _reference_order(4)
    seen: list[int] = []
    for step in range(1, STEPS_2 + 1):
        ranks = range(4) if step <= STEPS_4 else range(2)  # ranks 0 and 1 went on alone
        block = [i for r in ranks for i in per_rank[r][str(step)]]
        # each step consumes the next len(block) samples of the global order, whichever rank got which
        assert sorted(block) == sorted(reference[len(seen) : len(seen) + len(block)]), f"step {step}"
        seen.extend(block)
    samples = 4 * 16 * STEPS_4 + 2 * 16 * (STEPS_2 - STEPS_4)  # 640 + 256: the world changed mid-epoch 2
    assert len(seen) == samples
    for epoch in range(samples // 256):  # no sample repeated or skipped within an epoch
        assert sorted(seen[epoch * 256 : (epoch + 1) * 256]) == list(range(256)), f"epoch {epoch}"
