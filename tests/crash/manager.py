"""Crash consistency of the trainer's CheckpointManager: kill a process saving steps 1..3, then restore_latest.

The model's parameters are all equal to the step they were saved at, so what was restored is read
straight off the model. Importing this module imports torch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from unittest import mock

import torch

from ckptfmt import provenance
from ckptfmt.torch import CheckpointManager, ResumableSampler

from . import killing
from .consistency import Figures

STEPS = (1, 2, 3)
CONFIG = {"lr": 0.1, "model": "linear-4-3"}


def _no_git() -> AbstractContextManager[object]:
    # The manager asks git for the code's commit; in a tree others commit to, that changes between save and
    # restore (a resume mismatch), and each lookup costs a subprocess. Neither is what is tested here.
    return mock.patch.object(provenance, "git_state", return_value=None)


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer, ResumableSampler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), ResumableSampler(64, seed=1, shuffle=False)


def _work(run_url: str, progress: killing.Progress) -> Callable[[], None]:
    def work() -> None:
        torch.set_num_threads(1)
        model, optimizer, sampler = _trainer()
        with _no_git():
            mgr = CheckpointManager(run_url, keep_last=2, preemption_signals=())
        for step in STEPS:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            sampler.advance(8)
            mgr.save(step, model=model, optimizer=optimizer, sampler=sampler, config=CONFIG)
            progress.report(step)
        mgr.close()

    return work


def _judge(run_url: str, exit_: killing.ChildExit, committed: list[int], label: str, figures: Figures) -> None:
    figures.trials += 1
    figures.killed += exit_.killed
    model, optimizer, sampler = _trainer()
    with _no_git():
        mgr = CheckpointManager(run_url, preemption_signals=(), on_mismatch="strict")
    try:
        step = mgr.restore_latest(model=model, optimizer=optimizer, sampler=sampler, config=CONFIG)
    except Exception as exc:
        figures.wrong.append(f"{label}: restore_latest raised {type(exc).__name__}: {exc}")
        return
    finally:
        mgr.close()
    last = max(committed, default=None)
    if step is None:
        figures.refused += 1
        if last is not None:
            figures.wrong.append(f"{label}: step {last} was saved, but restore_latest found nothing")
        return
    values = {float(v) for p in model.parameters() for v in p.detach().reshape(-1)}
    if values != {float(step)} or sampler.state_dict().get("global_sample_offset") != 8 * step:
        figures.wrong.append(f"{label}: restored step {step} but the model holds {sorted(values)}")
    elif last is not None and step < last:
        figures.wrong.append(f"{label}: step {last} was saved, but restore_latest resumed from {step}")
    else:
        figures.whole += 1


def kill_points(url: Callable[[int], str], *, points: list[int] | None = None) -> Figures:
    """Kill before traced os call n for each n in ``points`` (every call when None)."""
    figures = Figures("CheckpointManager kill points")
    _trainer()  # the first optimizer imports torch._dynamo (seconds): once here, not in every child
    progress = killing.Progress()
    calls = killing.count_calls(_work(url(-1), progress))
    progress.collect()
    for i, n in enumerate(list(range(1, len(calls) + 2)) if points is None else points):
        progress = killing.Progress()
        exit_ = killing.run_killed_at_call(_work(url(i), progress), n)
        _judge(url(i), exit_, progress.collect(), f"kill before call {n}/{len(calls)}", figures)
    return figures


def calls(url: str) -> int:
    _trainer()
    progress = killing.Progress()
    n = len(killing.count_calls(_work(url, progress)))
    progress.collect()
    return n


def random_kills(url: Callable[[int], str], trials: int, *, seed: int = 0) -> Figures:
    figures = Figures("CheckpointManager random kills")
    _trainer()
    rng = random.Random(seed)
    progress = killing.Progress()
    start = time.perf_counter()
    killing.reap(killing.fork(_work(url(-1), progress)))
    horizon = 1.2 * (time.perf_counter() - start)
    progress.collect()
    for i in range(trials):
        progress = killing.Progress()
        delay = rng.uniform(0, horizon)
        exit_ = killing.run_killed_after(_work(url(i), progress), delay)
        _judge(url(i), exit_, progress.collect(), f"kill after {delay * 1000:.1f} ms", figures)
    return figures
