"""Crash consistency: SIGKILL a writer at every kill point and at random moments, then judge what is left.

Two workloads, each on local disk or S3 (a URL maker and storage options):

- ``single``: one multi-file training save into a fresh root. After the kill, the root is refused or
  whole; when the child finished, it is whole. Remains of a refused one are removed by gc.
- ``run``: four saves into a run directory (set_latest, then retention keep_last=2 and gc after each,
  as CheckpointManager does). Every committed checkpoint is whole, and resuming picks the newest one,
  never older than the last save whose commit returned.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ckptfmt
from ckptfmt.run import RunDirectory, checkpoint_name

from . import killing, payload

RUN_STEPS = (1, 2, 3, 4)
KEEP_LAST = 2


@dataclass(slots=True)
class Figures:
    """Counts of one harness run; ``wrong`` lists every violation (empty when everything held)."""

    name: str
    trials: int = 0
    killed: int = 0
    refused: int = 0
    whole: int = 0
    wrong: list[str] = field(default_factory=list)

    def add(self, other: Figures) -> None:
        self.trials += other.trials
        self.killed += other.killed
        self.refused += other.refused
        self.whole += other.whole
        self.wrong += other.wrong


@dataclass(frozen=True, slots=True)
class Target:
    """Where trials write: ``url(i)`` is a fresh run directory URL for trial ``i``."""

    url: Callable[[int], str]
    storage_options: Mapping[str, Any] | None = None
    http: bool = False  # kill points count HTTP requests instead of os calls


def _single_work(run_url: str, options: Mapping[str, Any] | None) -> Callable[[], None]:
    def work() -> None:
        payload.write(f"{run_url}/{checkpoint_name(1)}", 1, storage_options=options)

    return work


def _run_work(run_url: str, options: Mapping[str, Any] | None, progress: killing.Progress) -> Callable[[], None]:
    def work() -> None:
        run = RunDirectory(run_url, options)
        for step in RUN_STEPS:
            name = checkpoint_name(step)
            ckpt_id = payload.write(run.child_url(name), step, storage_options=options, overwrite=True)
            progress.report(step)
            run.set_latest(name, step, ckpt_id)
            run.gc(keep_last=KEEP_LAST, protect={name})

    return work


def _leftovers(run_url: str, options: Mapping[str, Any] | None) -> list[str]:
    """What gc leaves of a run directory holding no committed checkpoint (should be nothing)."""
    run = RunDirectory(run_url, options)
    run.gc(keep_last=None)
    left = [p for p in run.store.list() if p != "latest.json"]
    left += [f"pending upload {p}" for p, _ in run.store.pending_uploads()]
    return left


def _judge_single(run_url: str, target: Target, exit_: killing.ChildExit, label: str, figures: Figures) -> None:
    figures.trials += 1
    figures.killed += exit_.killed
    url = f"{run_url}/{checkpoint_name(1)}"
    verdict = payload.judge(url, 1, storage_options=target.storage_options)
    if verdict.outcome == "wrong":
        figures.wrong.append(f"{label}: loadable but wrong: {verdict.detail}")
        return
    if exit_.finished and verdict.outcome != "whole":
        figures.wrong.append(f"{label}: the save returned but the checkpoint is {verdict.outcome} ({verdict.detail})")
        return
    if verdict.outcome == "whole":
        figures.whole += 1
        return
    figures.refused += 1
    left = _leftovers(run_url, target.storage_options)
    if left:
        figures.wrong.append(f"{label}: gc left {left}")


def newest_good(run_url: str, options: Mapping[str, Any] | None) -> tuple[int | None, list[str]]:
    """Resume as restore_latest does (newest committed that opens and holds its payload), checking all of them.

    Returns the step resumed from and every committed checkpoint that is not whole.
    """
    run = RunDirectory(run_url, options)
    chosen: int | None = None
    bad = []
    for entry in run.entries():
        if entry.status != "committed":
            continue
        assert entry.step is not None
        verdict = payload.judge(run.child_url(entry.name), entry.step, storage_options=options)
        if verdict.outcome != "whole":
            bad.append(f"{entry.name} is committed but {verdict.outcome}: {verdict.detail}")
        elif chosen is None:
            chosen = entry.step
    return chosen, bad


def _judge_run(
    run_url: str, target: Target, exit_: killing.ChildExit, committed: Sequence[int], label: str, figures: Figures
) -> None:
    figures.trials += 1
    figures.killed += exit_.killed
    chosen, bad = newest_good(run_url, target.storage_options)
    figures.wrong += [f"{label}: {b}" for b in bad]
    last = max(committed, default=None)
    if last is not None and (chosen is None or chosen < last):
        figures.wrong.append(f"{label}: step {last} was committed, but resume finds {chosen}")
    if chosen is None:
        figures.refused += 1
    else:
        figures.whole += 1


def kill_points(target: Target, *, workload: str = "single", points: Sequence[int] | None = None) -> Figures:
    """SIGKILL the workload just before each of its traced calls (``points``: 1-based call numbers; all if None).

    The run past the last call (nothing killed) is included as the control.
    """
    figures = Figures(f"kill points ({workload})")
    scratch = target.url(-1)
    progress = killing.Progress()
    calls = killing.count_calls(
        _single_work(scratch, target.storage_options)
        if workload == "single"
        else _run_work(scratch, target.storage_options, progress),
        http=target.http,
    )
    progress.collect()
    chosen = list(range(1, len(calls) + 2)) if points is None else list(points)
    for i, n in enumerate(chosen):
        run_url = target.url(i)
        label = f"kill before call {n}/{len(calls)} ({calls[n - 1] if n <= len(calls) else 'none: control'})"
        if workload == "single":
            exit_ = killing.run_killed_at_call(_single_work(run_url, target.storage_options), n, http=target.http)
            _judge_single(run_url, target, exit_, label, figures)
        else:
            progress = killing.Progress()
            work = _run_work(run_url, target.storage_options, progress)
            exit_ = killing.run_killed_at_call(work, n, http=target.http)
            _judge_run(run_url, target, exit_, progress.collect(), label, figures)
    return figures


def random_kills(target: Target, trials: int, *, workload: str = "single", seed: int = 0) -> Figures:
    """SIGKILL the workload at ``trials`` random moments, uniform over 1.2x its uninterrupted duration."""
    figures = Figures(f"random kills ({workload})")
    rng = random.Random(seed)
    durations = []
    for i in range(3 if trials >= 20 else 1):  # how long an uninterrupted run takes, forks included
        progress = killing.Progress()
        run_url = target.url(-2 - i)
        work = (
            _single_work(run_url, target.storage_options)
            if workload == "single"
            else _run_work(run_url, target.storage_options, progress)
        )
        start = time.perf_counter()
        killing.reap(killing.fork(work))
        durations.append(time.perf_counter() - start)
        progress.collect()
    horizon = 1.2 * sorted(durations)[len(durations) // 2]
    for i in range(trials):
        run_url = target.url(i)
        delay = rng.uniform(0, horizon)
        label = f"kill after {delay * 1000:.2f} ms (trial {i})"
        if workload == "single":
            exit_ = killing.run_killed_after(_single_work(run_url, target.storage_options), delay)
            _judge_single(run_url, target, exit_, label, figures)
        else:
            progress = killing.Progress()
            exit_ = killing.run_killed_after(_run_work(run_url, target.storage_options, progress), delay)
            _judge_run(run_url, target, exit_, progress.collect(), label, figures)
    return figures


def open_or_refuse(url: str, options: Mapping[str, Any] | None = None) -> str:
    """For ad-hoc use: 'refused: code' or 'opened'."""
    try:
        with ckptfmt.open(url, options):
            return "opened"
    except ckptfmt.CheckpointError as exc:
        return f"refused: {exc.code}"
