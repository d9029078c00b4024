"""A slow link never stalls training: replica transfers are rate-limited per link and run behind the step; a round
that cannot keep up is coalesced, and the lag (steps and seconds) rises, then falls back to 0 once the link keeps up.

Asserted by what happens, never by elapsed time: the steps complete while a transfer is provably still waiting on
the throttled link, and the lag counts them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from rank_threads import run_threads

from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import UsageError
from ckptfmt.tier.link_rate import RateLimitedChannel, TokenBucket
from ckptfmt.torch.options import MemoryOptions

JOIN_TIMEOUT = 120.0


def test_a_bucket_holds_each_link_to_its_rate_and_lets_a_burst_through() -> None:
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(100.0, burst=100.0, clock=lambda: now[0], sleep=sleep)
    bucket.take(100)  # the burst: no wait
    assert waits == []
    for _ in range(10):
        bucket.take(50)
    assert sum(waits) == pytest.approx(5.0)  # 500 bytes past the burst at 100 a second
    now[0] += 10.0  # an idle link refills to its burst, no more
    bucket.take(100)
    assert sum(waits) == pytest.approx(5.0)
    with pytest.raises(UsageError, match="replica_rate"):
        TokenBucket(0)
    with pytest.raises(UsageError, match="replica_rate"):
        MemoryOptions(every=1, replica_rate=1e6)  # without replicate=True
    assert MemoryOptions(every=1, replicate=True, replica_rate=1e6).replica_rate == 1e6


def test_a_throttled_link_makes_the_replicas_lag_never_the_steps_and_the_lag_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks on two nodes (threads), each rank's link throttled to a byte a second until step 7: every send
    waits on the link, and six steps' snapshots commit meanwhile. The first round is still in flight at each of
    them, the rounds of the others are coalesced away, and the lag counts every step; once the link is free, the
    next round copies the newest snapshot and the lag is 0."""
    import torch

    import ckptfmt.torch.memory as memory
    from ckptfmt.run import RunDirectory
    from ckptfmt.torch import ResumableSampler, api

    here = threading.local()
    monkeypatch.setattr(memory, "node_key", lambda: here.node)
    group = ThreadCollective.group(2, timeout=60)
    free = threading.Event()  # the link's throttle lifted
    throttled = threading.Event()  # a send is waiting on the throttled link
    both = threading.Barrier(2)

    def slow_link(seconds: float) -> None:
        throttled.set()
        assert free.wait(60), "hang guard: a step waited for the throttled link"

    def rank_main(rank: int) -> Any:
        here.node = "AB"[rank]
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ResumableSampler(64, seed=1, rank=rank, world_size=2)
        link = RateLimitedChannel(group[rank], 1.0, bucket=lambda: TokenBucket(1.0, burst=1.0, sleep=slow_link))
        tier = memory.MemorySnapshots(
            RunDirectory(str(tmp_path / "run")),
            memory_dir=tmp_path / "shm" / "AB"[rank],
            slots=2,
            collective=group[rank],
            replicate=True,
            channel=link,
        )
        assert tier.replicator is not None
        lags, in_flight = [], []
        for step in range(1, 8):
            if step == 7:  # the link keeps up again: the round in flight ends, the next copies the newest state
                both.wait(60)  # each rank saw its steps 1-6 done under the throttle first
                free.set()
                tier.wait_replica()
            model(torch.ones(2, 64)).sum().backward()
            opt.step()
            sampler.advance(2)
            snap = api.capture(step=step, model=model, optimizer=opt, config={"a": 1}, sampler=sampler, defer=True)
            tier.snapshot(snap, opt, persist=False)
            tier.wait_snapshot()
            if step < 7:
                in_flight.append(tier.replicator.busy())
                lags.append(tier.replica_lag())
        tier.wait_replica()
        after = tier.replica_lag()
        result = (lags, in_flight, after, tier.replicator.skipped, link.link(1 - rank).waited, tier.replicator.failures)
        tier.close(persist=False)
        return result

    results = run_threads(2, rank_main, JOIN_TIMEOUT)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert throttled.is_set()
    for lags, in_flight, after, skipped, waited, failures in results:
        assert in_flight == [True] * 6, results  # every step of 1-6 completed while the first copy was on the link
        assert [lag.steps for lag in lags] == [1, 2, 3, 4, 5, 6], lags  # rises with every step not copied
        assert all(lag.seconds >= 0.0 for lag in lags) and lags[-1].seconds >= lags[0].seconds
        assert skipped == 5 and waited > 0, results  # the rounds of steps 2-6 coalesced into step 7's
        assert after.steps == 0 and after.seconds == 0.0, after  # and recovered
        assert failures == [], failures
