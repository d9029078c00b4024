"""Concurrent writers racing for the same checkpoint, local and S3 (issue 9): exactly one commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crash import race, size


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
