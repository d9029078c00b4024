"""Ranks as threads: a multi-rank save through the library API without processes (``ThreadCollective``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ckptfmt import ThreadCollective


def run_threads(world: int, body: Callable[[int], object], join_timeout: float) -> list[Any]:
    """Run ``body(rank)`` on ``world`` threads; each result or raised exception, by rank.

    A thread still running ``join_timeout`` seconds after its turn to be joined fails the test ("a rank hung")
    rather than leaving it waiting forever.
    """
    results: list[Any] = [None] * world

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "a rank hung"
    return results


def run_ranks(
    world: int,
    body: Callable[[int, ThreadCollective], object],
    timeout: float = 20.0,
    group: list[ThreadCollective] | None = None,
    join_timeout: float | None = None,
) -> list[Any]:
    """Run ``body(rank, collective)`` on ``world`` threads; each result or raised exception, by rank.

    ``timeout`` is the collective's (a fresh ``ThreadCollective.group``) unless ``group`` is given: a group the
    test built itself (wrapped, shared with other code), of which rank r's body gets ``group[r]``. A rank still
    running ``join_timeout`` (default ``timeout * 4``) seconds after its turn to be joined fails the test.
    """
    ranks = group if group is not None else ThreadCollective.group(world, timeout=timeout)
    return run_threads(
        world, lambda rank: body(rank, ranks[rank]), timeout * 4 if join_timeout is None else join_timeout
    )
