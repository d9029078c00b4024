"""Concurrent writers racing for the same checkpoint, local and S3 (issue 9): exactly one commits."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crash import race, size

import ckptfmt


def test_local_writers_race_exactly_one_commits(tmp_path: Path) -> None:
    rounds = size(6, 100)
    figures = race.race(lambda r: str(tmp_path / f"c{r}"), rounds=rounds, writers=4)
    assert not figures.wrong, "\n".join(figures.wrong)
    assert figures.one_winner == rounds


def test_s3_writers_race_exactly_one_commits(moto_server: Any) -> None:
    bucket = moto_server.create_bucket()
    rounds = size(1, 20)
    figures = race.race(lambda r: f"s3://{bucket}/c{r}", rounds=rounds, writers=4)
    assert not figures.wrong, "\n".join(figures.wrong)
    assert figures.one_winner == rounds


def stale_roots(make: Callable[[int], str]) -> Callable[[int], str]:
    """Each round's root already holding the lock of a writer that died (a persist killed by SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    lock = {"host": socket.gethostname(), "pid": proc.pid, "nonce": "dead", "started_at": "2026-01-01T00:00:00Z"}

    def root(r: int) -> str:
        url = make(r)
        ckptfmt.open_store(url).put_exclusive(".writer-lock", json.dumps(lock).encode())
        return url

    return root


def test_local_writers_race_over_a_stale_lock_exactly_one_commits(tmp_path: Path) -> None:
    """Every writer reads the dead lock and takes it over at once (redteam-3 finding 09): one holds the root."""
    rounds = size(6, 100)
    figures = race.race(stale_roots(lambda r: str(tmp_path / f"c{r}")), rounds=rounds, writers=4)
    assert not figures.wrong, "\n".join(figures.wrong)
    assert figures.one_winner == rounds


def test_s3_writers_race_over_a_stale_lock_exactly_one_commits(moto_server: Any) -> None:
    bucket = moto_server.create_bucket()
    rounds = size(1, 20)
    figures = race.race(stale_roots(lambda r: f"s3://{bucket}/c{r}"), rounds=rounds, writers=4)
    assert not figures.wrong, "\n".join(figures.wrong)
    assert figures.one_winner == rounds
