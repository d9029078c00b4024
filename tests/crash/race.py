"""Concurrent writers racing for one checkpoint: N forked processes released together; exactly one commits.

Each child writes the payload of its own seed with ``overwrite=False`` and reports through its exit
status: 0 committed, 10 CheckpointLockedError, 11 CheckpointExistsError (anything else is a failure).
The committed checkpoint must verify and hold exactly the winner's payload.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ckptfmt

from . import killing, payload

LOCKED, EXISTS = 10, 11


@dataclass(slots=True)
class RaceFigures:
    name: str
    rounds: int = 0
    writers: int = 0
    one_winner: int = 0
    wrong: list[str] = field(default_factory=list)


def _contender(url: str, seed: int, gate: int, options: Mapping[str, Any] | None) -> Callable[[], None]:
    def work() -> None:
        os.read(gate, 1)  # wait for the start
        try:
            payload.write(url, seed, storage_options=options)
        except ckptfmt.CheckpointLockedError:
            os._exit(LOCKED)
        except ckptfmt.CheckpointExistsError:
            os._exit(EXISTS)

    return work


def race(
    url: Callable[[int], str], *, rounds: int, writers: int, options: Mapping[str, Any] | None = None
) -> RaceFigures:
    figures = RaceFigures(f"{writers} concurrent writers")
    for r in range(rounds):
        target = url(r)
        gate_read, gate_write = os.pipe()
        pids = [killing.fork(_contender(target, 100 + i, gate_read, options)) for i in range(writers)]
        os.close(gate_read)
        os.write(gate_write, b"x" * writers)  # release all at once
        os.close(gate_write)
        statuses = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            statuses.append(os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)
        figures.rounds += 1
        figures.writers += writers
        winners = [i for i, s in enumerate(statuses) if s == 0]
        if len(winners) != 1 or any(s not in (0, LOCKED, EXISTS) for s in statuses):
            figures.wrong.append(f"round {r}: exit statuses {statuses} (0 commit, {LOCKED} locked, {EXISTS} exists)")
            continue
        verdict = payload.judge(target, 100 + winners[0], storage_options=options)
        if verdict.outcome != "whole":
            figures.wrong.append(f"round {r}: the winner's checkpoint is {verdict.outcome}: {verdict.detail}")
            continue
        figures.one_winner += 1
    return figures
