"""A replica link's rate limit: a token bucket per receiving rank, in front of a :class:`PeerChannel`'s sends.

Replica rounds run beside training on threads of their own (:mod:`.replica`), so a slow or shared link (one
across regions) costs a lagging replica, never a step; the limit keeps the copies from taking the link from the
job's own traffic. It never blocks the step: only the round's sending thread waits for tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..collective import PeerChannel
from ..errors import UsageError


class TokenBucket:
    """``rate`` bytes a second, ``burst`` bytes at once. :meth:`take` runs into debt and then waits it off, so one
    message larger than the burst goes whole (a piece is never split), after the wait its size calls for."""

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if not rate > 0:
            raise UsageError(f"replica_rate must be a positive number of bytes a second, not {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds of waits asked for, in all

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited += wait
        if wait:
            self._sleep(wait)


class RateLimitedChannel:
    """A :class:`PeerChannel` whose sends to each rank (each link) share that link's :class:`TokenBucket`;
    receives pass through."""

    def __init__(self, inner: PeerChannel, rate: float, *, bucket: Callable[[], TokenBucket] | None = None) -> None:
        self.inner = inner
        self.rank = inner.rank
        self._make = bucket or (lambda: TokenBucket(rate))
        TokenBucket(rate)  # the rate refused here, where it is given, not at the first send
        self._buckets: dict[int, TokenBucket] = {}
        self._lock = threading.Lock()

    def link(self, dst: int) -> TokenBucket:
        with self._lock:
            if dst not in self._buckets:
                self._buckets[dst] = self._make()
            return self._buckets[dst]

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        self.link(dst).take(len(data))
        self.inner.send(data, dst=dst, tag=tag)

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        return self.inner.recv(src=src, tag=tag, max_size=max_size)
