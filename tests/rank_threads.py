"""Ranks as threads: a multi-rank save through the library API without processes (``ThreadCollective``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckptfmt import ThreadCollective


def run_ranks(world: int, body: Callable[[int, ThreadCollective], object], timeout: float = 20.0) -> list[object]:
    """Run ``body(rank, collective)`` on ``world`` threads; each result or raised exception, by rank."""
    group = ThreadCollective.group(world, timeout=timeout)
    results: list[object] = [None] * world

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, group[rank])
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
        assert not t.is_alive(), "a rank hung"
    return results
