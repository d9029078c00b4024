"""Exact resume for loops written the way people write them: SIGKILL after a checkpoint, resume in a fresh
process, compare bit for bit with the uninterrupted run (every loss, final weights, optimizer state).

The loop (``main`` below, run as a subprocess) is the plain one: ``for xb, yb in loader`` inside
``while step < steps``, no ``advance()`` call, dropout in the model, Python, numpy and torch global RNG
drawn in the loop body, a learning-rate scheduler, optionally gradient accumulation (several batches per
optimizer step). 40 samples, batch 4: an epoch is 10 batches. Runs checkpoint every 5 optimizer steps.

Matrix (each resumed run against one shared uninterrupted reference per configuration):
- ResumableDataLoader, killed with 2 workers right after the step-10 checkpoint (an epoch boundary),
  resumed with 2 workers at 10, and with 0 workers at 5 (mid-epoch; the step-10 checkpoint removed);
- ResumableDataLoader with gradient accumulation (3 batches per step), killed at step 5 (batch 15,
  mid-epoch) with 2 workers, resumed with 0;
- torchdata's StatefulDataLoader with 2 workers, killed at step 5 (mid-epoch);
- negative controls: a plain DataLoader without generator= warns on resume and does diverge; a
  ResumableSampler never advanced makes the first save fail, naming the fix.

The three killed runs die holding their DataLoader's queues and events: 42 POSIX semaphores that no process of
theirs unlinks. multiprocessing's resource tracker (this pytest process's) unlinks them at the session's end and
says so ("There appear to be 42 leaked semaphore objects"; 56 in the whole slow lane): expected, as after any
preempted trainer, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm_ranks
from concurrent_runs import Jobs

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

SCRIPT = Path(__file__).resolve()
STEPS, EVERY = 20, 5


# ---------------------------------------------------------------- the trainer (subprocess)


def main(argv: Sequence[str]) -> int:
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from ckptfmt.torch import CheckpointManager, ResumableDataLoader, ResumableSampler

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--loader", choices=["resumable", "stateful", "plain-no-generator", "never-advanced"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--kill-at", type=int)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(7)
    x = torch.randn(40, 8, generator=data)
    dataset = TensorDataset(x, x @ torch.randn(8, 1, generator=data) + 0.1 * torch.randn(40, 1, generator=data))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    sampler = None
    if args.loader == "resumable":
        loader = ResumableDataLoader(dataset, batch_size=4, seed=1234, num_workers=args.workers)
    elif args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(1234))
        loader = StatefulDataLoader(
            dataset, batch_size=4, sampler=order, num_workers=args.workers, generator=torch.Generator().manual_seed(9)
        )
    else:  # the README's old path, each with one of the two misuses of issue 11
        sampler = ResumableSampler(len(dataset), seed=1234)
        generator = torch.Generator().manual_seed(9) if args.loader == "never-advanced" else None
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=args.workers, generator=generator)  # type: ignore[arg-type]

    mgr = CheckpointManager(args.run_dir, keep_last=None, loader=loader)
    step = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched) or 0
    print(f"start {step}", flush=True)
    log: list[list[object]] = json.loads(Path(args.losses).read_text())["steps"] if step else []
    del log[step:]  # a resumed run redoes the steps after its checkpoint
    micro: list[str] = []
    while step < args.steps:
        for xb, yb in loader:
            model.train()
            jitter = 1 + 1e-3 * (random.random() + np.random.rand() + torch.rand(()).item())  # global RNGs in the loop
            loss = F.mse_loss(model(xb), yb) * jitter
            (loss / args.accum).backward()
            micro.append(float(loss.detach()).hex())
            if sampler is not None and args.loader == "plain-no-generator":
                sampler.advance(len(xb))
            if len(micro) < args.accum:
                continue
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            log.append([step, micro])
            micro = []
            tmp = Path(args.losses + ".tmp")
            tmp.write_text(json.dumps({"steps": log}))
            os.replace(tmp, args.losses)
            saved = mgr.checkpoint_if_due(step, every=EVERY, model=model, optimizer=opt, scheduler=sched, config={})
            if saved and step == args.kill_at:
                mgr.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.steps:
                break
    mgr.close()
    return 0


# ---------------------------------------------------------------- the tests


@dataclass(frozen=True)
class Run:
    run_dir: Path
    steps: list[list[object]]  # [step, [micro-batch losses as float.hex]] up to where this run got
    proc: subprocess.CompletedProcess[str]


def run(run_dir: Path, *args: str, expect: int = 0) -> Run:
    losses = run_dir.parent / f"{run_dir.name}.json"
    argv = ["--run-dir", str(run_dir), "--losses", str(losses), *args]
    proc = warm_ranks.run(SCRIPT, argv, timeout=300)  # forked warm: tests/warm_ranks.py
    assert proc.returncode == expect, f"{run_dir.name}: {proc.stderr[-3000:]}"
    steps = json.loads(losses.read_text())["steps"] if losses.exists() else []
    return Run(run_dir, steps, proc)


def resume(base: Run, dest: Path, *args: str, drop_after: int | None = None) -> Run:
    """Resume a copy of ``base``'s run directory (and loss log); ``drop_after`` removes newer checkpoints."""
    from ckptfmt.run import checkpoint_name

    shutil.copytree(base.run_dir, dest)
    shutil.copy(base.run_dir.parent / f"{base.run_dir.name}.json", dest.parent / f"{dest.name}.json")
    start = int(base.steps[-1][0])  # type: ignore[call-overload]
    if drop_after is not None:
        for step in range(drop_after + 1, start + 1):
            shutil.rmtree(dest / checkpoint_name(step), ignore_errors=True)
        start = drop_after
    resumed = run(dest, *args)
    assert resumed.proc.stdout.startswith(f"start {start}\n"), resumed.proc.stdout
    return resumed


KILLED = -signal.SIGKILL
RESUMABLE, STATEFUL, NOGEN = (
    ("--loader", "resumable"),
    ("--loader", "stateful", "--workers", "2"),
    ("--loader", "plain-no-generator"),
)
FIRST = {  # name: (arguments, expected exit status); independent runs, started a few at a time
    "reference": (RESUMABLE, 0),
    "killed": ((*RESUMABLE, "--workers", "2", "--kill-at", "10"), KILLED),
    "accum-reference": ((*RESUMABLE, "--accum", "3"), 0),
    "accum-killed": ((*RESUMABLE, "--accum", "3", "--workers", "2", "--kill-at", "5"), KILLED),
    "stateful-reference": (STATEFUL, 0),
    "stateful-killed": ((*STATEFUL, "--kill-at", "5"), KILLED),
    "nogen-reference": (NOGEN, 0),
    "never-advanced": (("--loader", "never-advanced"), 1),
}
THEN = {  # name: (the run it resumes, arguments, drop checkpoints after)
    "at-10": ("killed", (*RESUMABLE, "--workers", "2"), None),
    "at-5": ("killed", (*RESUMABLE, "--workers", "0"), 5),
    "accum-resumed": ("accum-killed", (*RESUMABLE, "--accum", "3"), None),
    "stateful-resumed": ("stateful-killed", STATEFUL, None),
    # the negative control resumes from the reference's own step-5 checkpoint: no kill needed to show it
    "nogen-resumed": ("nogen-reference", NOGEN, 5),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Every run, a few at a time; each resume starts as soon as the run it resumes is done (concurrent_runs.py)."""
    work = tmp_path_factory.mktemp("matrix")
    jobs = Jobs(workers=3)
    bases = {base for base, _, _ in THEN.values()}
    for name, (args, expect) in sorted(FIRST.items(), key=lambda item: item[0] not in bases):  # bases first
        jobs.add(name, lambda n=name, a=args, e=expect: run(work / n, *a, expect=e))
    for name, (base, args, drop) in THEN.items():
        jobs.add(name, lambda done, n=name, a=args, d=drop: resume(done, work / n, *a, drop_after=d), base)
    return jobs.run()


def assert_same_final_state(a: Path, b: Path) -> None:
    import ckptfmt
    from ckptfmt.run import checkpoint_name

    with ckptfmt.open(str(a / checkpoint_name(STEPS))) as ca, ckptfmt.open(str(b / checkpoint_name(STEPS))) as cb:
        for field in ("weights", "optimizer"):
            ta, tb = ca.read_tensors(field), cb.read_tensors(field)
            assert set(ta) == set(tb)
            for name in ta:
                assert ta[name].tobytes() == tb[name].tobytes(), f"{field}/{name}"
        for field in ("optimizer", "scheduler", "data", "rng"):
            assert json.dumps(ca.read_context(field), default=str) == json.dumps(cb.read_context(field), default=str)


def test_killed_runs_died_after_their_checkpoint(runs: Jobs) -> None:
    from ckptfmt.run import RunDirectory

    for name, last in (("killed", 10), ("accum-killed", 5), ("stateful-killed", 5)):
        assert [s for s, _ in runs[name].steps] == list(range(1, last + 1)), name
        latest = RunDirectory(runs[name].run_dir).latest()
        assert latest is not None and latest["step"] == last, name


def test_workers_do_not_change_the_run(runs: Jobs) -> None:
    """The loader draws nothing from the global RNG, so 2 workers give the 0-worker run's numbers."""
    assert runs["killed"].steps == runs["reference"].steps[:10]


@pytest.mark.parametrize(
    ("resumed", "reference"),
    [
        ("at-10", "reference"),  # right after an epoch boundary (10 batches an epoch), 2 workers
        ("at-5", "reference"),  # mid-epoch, resumed with 0 workers where the first run had 2
        ("accum-resumed", "accum-reference"),  # 3 batches per optimizer step: killed at batch 15, mid-epoch
        ("stateful-resumed", "stateful-reference"),  # torchdata's StatefulDataLoader, 2 workers, mid-epoch
    ],
)
def test_resumed_run_is_bit_identical(runs: Jobs, resumed: str, reference: str) -> None:
    assert [s for s, _ in runs[reference].steps] == list(range(1, STEPS + 1))
    assert runs[resumed].steps == runs[reference].steps  # every micro-batch loss of every step, bit for bit
    assert_same_final_state(runs[reference].run_dir, runs[resumed].run_dir)
    assert "InexactResumeWarning" not in runs[resumed].proc.stderr


def test_negative_control_plain_dataloader_without_generator(runs: Jobs) -> None:
    """The old misuse: resume is loud about it, and the run does diverge (the comparison can fail)."""
    ref, resumed = runs["nogen-reference"], runs["nogen-resumed"]
    assert "InexactResumeWarning" not in ref.proc.stderr
    assert "InexactResumeWarning: resume will not be exact: the DataLoader has generator=None" in resumed.proc.stderr
    assert "generator=torch.Generator().manual_seed(SEED)" in resumed.proc.stderr
    assert resumed.steps[:5] == ref.steps[:5] and resumed.steps[5] != ref.steps[5]


def test_negative_control_sampler_never_advanced(runs: Jobs) -> None:
    from ckptfmt.run import RunDirectory

    bad = runs["never-advanced"]
    assert "UsageError" in bad.proc.stderr and "sampler.advance(len(batch))" in bad.proc.stderr
    assert "re-read the samples it already trained on" in bad.proc.stderr
    assert [s for s, _ in bad.steps] == list(range(1, EVERY + 1))  # it trained; the first save refused
    assert RunDirectory(bad.run_dir).latest() is None  # nothing committed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
