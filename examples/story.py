"""The whole story in one command: train, get killed, resume, verify, and prove the resumed run is the same run.

    python examples/story.py [OUT_DIR]        (default: story-out; takes well under a minute on a laptop CPU)

1. Train examples/train.py uninterrupted for 24 steps (checkpoints every 4) in OUT_DIR/reference.
2. Train it again in OUT_DIR/run, and SIGKILL the process right after its step-12 checkpoint is durable.
3. Start it again: it resumes from the newest good checkpoint and runs to step 24.
4. ``ckpt ls`` the run directory and ``ckpt verify`` the final checkpoint (every byte re-hashed).
5. Compare: the per-step losses of 2+3 against 1, and ``ckpt diff`` of the two final checkpoints
   (``--ignore provenance``: the time, host and parent of two runs always differ). Both must be identical.
6. The memory tier: the run again with a snapshot in node memory every step and durable saves every 8
   steps, SIGKILLed at step 14, between two durable saves; started again, it resumes at step 14 from
   memory (from disk it would lose 6 steps) and still ends bit-identical to 1.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
# The installed entry point, not `python -m ckptfmt`: run from a checkout, that would import the source
# tree's ckptfmt/, where cli/ is not mapped to ckptfmt.cli (only an install maps it).
CKPT = [str(Path(sys.executable).with_name("ckpt"))]
STEPS, KILL, EVERY = 24, 12, 4
MEMORY_EVERY, MEMORY_KILL = 8, 14  # durable saves at 8 and 16: the kill falls between them


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def shown(cmd: list[str]) -> str:
    return " ".join(
        ["ckpt", *cmd[len(CKPT) :]]
        if cmd[: len(CKPT)] == CKPT
        else ["python", *(Path(c).name if c == str(TRAIN) else c for c in cmd[1:])]
    )


def execute(cmd: list[str], after: Future[Any] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (once ``after`` is done), output captured; :func:`show` prints it in the story's order."""
    if after is not None:
        after.result()
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def show(proc: subprocess.CompletedProcess[str], *, expect: int = 0) -> subprocess.CompletedProcess[str]:
    print(f"$ {shown(list(proc.args))}", flush=True)
    for line in (*proc.stdout.splitlines(), *proc.stderr.splitlines()):
        print(f"  {line}")
    if proc.returncode != expect:
        sys.exit(f"story: expected exit code {expect}, got {proc.returncode}")
    return proc


def run(cmd: list[str], *, expect: int = 0) -> subprocess.CompletedProcess[str]:
    return show(execute(cmd), expect=expect)


def train_cmd(run_dir: Path, losses: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), "--steps", str(STEPS), "--every", str(EVERY)]
    return [*cmd, "--losses-out", str(losses), "--quiet", *extra]


def losses_of(path: Path) -> list[list[float]]:
    return json.loads(path.read_text())["losses"]  # type: ignore[no-any-return]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "story-out")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    memory = ["--memory-every", "1", "--memory-dir", str(out / "node-memory"), "--every", str(MEMORY_EVERY)]
    kill = ["--workers", "2", "--kill-after-checkpoint-step", str(KILL)]
    # The training runs go two at a time (the reference beside the killed run, each resume after its kill);
    # their output is printed below in the story's order.
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref_job = pool.submit(execute, train_cmd(out / "reference", out / "reference-losses.json"))
        killed_job = pool.submit(execute, train_cmd(out / "run", out / "run-losses-1.json", *kill))
        resumed_job = pool.submit(
            execute, train_cmd(out / "run", out / "run-losses-2.json", "--workers", "2"), killed_job
        )
        memory_killed = train_cmd(
            out / "memory-run", out / "memory-losses-1.json", *memory, "--kill-at-step", str(MEMORY_KILL)
        )
        memory_killed_job = pool.submit(execute, memory_killed)
        durable_job = pool.submit(
            lambda: (memory_killed_job.result(), sorted(p.name for p in (out / "memory-run").glob("step-*")))[1]
        )
        memory_resumed_job = pool.submit(
            execute, train_cmd(out / "memory-run", out / "memory-losses-2.json", *memory), durable_job
        )

        banner(f"1. the reference: {STEPS} steps, uninterrupted")
        show(ref_job.result())
        reference = losses_of(out / "reference-losses.json")

        banner(f"2. the same run, SIGKILLed right after its step-{KILL} checkpoint (2 DataLoader workers)")
        show(killed_job.result(), expect=-signal.SIGKILL)
        first = losses_of(out / "run-losses-1.json")
        print(f"  killed: exit status -{signal.SIGKILL} (SIGKILL) after step {first[-1][0]}")

        banner("3. start it again: it resumes from the newest good checkpoint")
        show(resumed_job.result())
        second = losses_of(out / "run-losses-2.json")
        print(f"  resumed at step {second[0][0] - 1}, ran to step {second[-1][0]}")

        final = f"step-{STEPS:09d}"
        banner("4. list the run and verify its final checkpoint")
        run([*CKPT, "ls", str(out / "run")])
        run([*CKPT, "verify", str(out / "run" / final)])

        banner("5. is the resumed run the same run?")
        losses = first + second
        same = losses == reference
        print(f"  per-step losses, steps 1-{STEPS}: {'bit-identical' if same else 'DIFFERENT'} to the reference")
        for (step, a), (_, b) in zip(reference, losses, strict=True):
            if step in (1, KILL, KILL + 1, STEPS) or a != b:
                print(f"    step {step:2d}: reference {a!r:<20} resumed {b!r}")
        run([*CKPT, "diff", str(out / "reference" / final), str(out / "run" / final), "--ignore", "provenance"])
        if not same:
            sys.exit("story: the resumed run diverged")

        title = (
            f"6. the memory tier: a snapshot every step, durable every {MEMORY_EVERY}; SIGKILL at step {MEMORY_KILL}"
        )
        banner(title)
        show(memory_killed_job.result(), expect=-signal.SIGKILL)
        killed = losses_of(out / "memory-losses-1.json")
        print(f"  killed after step {killed[-1][0]}; durable checkpoints: {', '.join(durable_job.result())}")
        show(memory_resumed_job.result())
        resumed = losses_of(out / "memory-losses-2.json")
    print(f"  resumed at step {resumed[0][0] - 1} from node memory (without it: step {MEMORY_EVERY}), ran to {STEPS}")
    run([*CKPT, "verify", str(out / "memory-run" / final)])
    ignore = ["--ignore", "provenance", "--ignore", "metadata.ckptfmt.memory.*"]
    run([*CKPT, "diff", str(out / "reference" / final), str(out / "memory-run" / final), *ignore])
    if resumed[0][0] - 1 != MEMORY_KILL or killed + resumed != reference:
        sys.exit("story: the memory tier did not resume at the step it died at, bit for bit")
    print(
        "\nThe killed-and-resumed run reproduced the uninterrupted one bit for bit "
        f"({time.perf_counter() - started:.1f} s)."
    )


if __name__ == "__main__":
    main()
