"""SIGKILL one rank of a 2- or 3-rank save, ranks as processes (issue 23; spec/commit.md COM-17..COM-20).

After each kill the survivors finish within a bound, ``ckptfmt.open`` refuses or returns a checkpoint
that verifies and holds exactly what the ranks wrote, a failed coordinator leaves neither its lock nor
its files, and gc (``RunDirectory.gc``, ``ckpt gc``) removes what an uncommitted save left. CI runs a
sample; ``CKPTFMT_RELIABILITY=full`` (or scripts/reliability.py) every kill point and the published
number of random moments.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from crash import full, multirank, size
from crash.mesh import SocketCollective, keep_only, mesh
from crash.multirank import MultiFigures

import ckptfmt
from ckptfmt import CollectiveError, ThreadCollective
from ckptfmt.paths import LOCK_NAME
from ckptfmt.run import RunDirectory, checkpoint_name


def _held(figures: MultiFigures, *, expect_trials: int | None = None) -> None:
    assert not figures.wrong, "\n".join(figures.wrong[:20])  # a survivor still running at BOUND_S is there as hung
    assert figures.trials == figures.refused + figures.whole
    assert figures.loadable_but_wrong == 0 and figures.fails_verify == 0
    assert figures.gc_clean == figures.refused
    if expect_trials is not None:
        assert figures.trials == expect_trials


@pytest.mark.parametrize("world", [2, 3])
def test_kill_points_of_every_rank(tmp_path: Path, world: int) -> None:
    figures = multirank.kill_points(
        lambda i: str(tmp_path / f"run{i}"), world, per_rank=None if full() else 6, tail=size(6, 0)
    )
    _held(figures)
    assert figures.refused > 0 and figures.whole > 0
    # Not exactly trials - world (one control per rank): a rank's count varies by a few calls from run to
    # run (which rank makes a shared field directory), so a point near the end may kill or not.
    assert figures.killed > figures.trials // 2


@pytest.mark.parametrize("world", [2, 3])
def test_random_kills_of_one_rank(tmp_path: Path, world: int) -> None:
    trials = size(18, 500)
    figures = multirank.random_kills(lambda i: str(tmp_path / f"run{i}"), world, trials, seed=world)
    _held(figures, expect_trials=trials)
    assert figures.killed > 0


def test_ckpt_gc_removes_what_killed_multirank_saves_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    calls = multirank.count_calls(str(tmp_path / "count"), 3)
    assert [len(c) > 35 for c in calls] == [True] * 3  # the coordinator links its manifest after call 100
    for step, (victim, n) in enumerate([(0, 90), (1, 20), (2, 35)], 1):
        trial = multirank.run_trial(str(run / checkpoint_name(step)), 3, victim=victim, kill_at=n)
        assert trial.killed == {victim} and not trial.hung
    assert [e.status for e in RunDirectory(str(run)).entries()] == ["incomplete"] * 3
    result = run_cli("gc", str(run), "--json")
    assert result.exit_code == 0, result.stderr
    assert len(result.json()["deleted"]) == 3
    assert not [p for p in run.rglob("*") if p.is_file()]


def test_socket_collective_fails_at_once_when_a_peer_is_gone() -> None:
    ends = mesh(3)
    # a timeout no test waits out (a hang guard): had a call waited for rank 2, it would end in "did not answer";
    # "is gone" and "sending ... failed" are what the end of stream and EPIPE say at once
    peers = [SocketCollective(r, 3, ends[r], timeout=120.0) for r in range(3)]
    for sock in ends[2].values():  # rank 2 dies: the kernel closes its ends
        sock.close()
    assert peers[1].gather(b"from 1", dst=0) is None
    with pytest.raises(CollectiveError, match="rank 2 is gone"):
        peers[0].gather(b"from 0", dst=0)
    with pytest.raises(CollectiveError, match="sending to rank 2 failed"):
        peers[0].broadcast(b"outcome", src=0)  # rank 1 gets it; rank 2 cannot
    assert peers[1].broadcast(None, src=0) == b"outcome"
    keep_only(ends, None)


def test_socket_collective_round_trip_and_timeout() -> None:
    ends = mesh(2)
    a, b = SocketCollective(0, 2, ends[0], timeout=120.0), SocketCollective(1, 2, ends[1], timeout=120.0)
    assert b.gather(b"from 1", dst=0) is None
    assert a.gather(b"from 0", dst=0) == [b"from 0", b"from 1"]
    assert a.broadcast(b"hello", src=0) == b"hello"
    assert b.broadcast(None, src=0) == b"hello"
    b.timeout = 0.2  # only now: a test descheduled for 0.2 s must not fail a receive whose bytes had arrived
    with pytest.raises(CollectiveError, match="did not answer"):
        b.broadcast(None, src=0)  # rank 0 is alive and silent
    a.close()
    b.close()


def test_a_coordinator_whose_first_broadcast_fails_gives_its_lock_back(tmp_path: Path) -> None:
    """COM-20: a rank gone before the save starts fails the coordinator's first broadcast, after it took the
    lock. Its lock must go with the save: the process lives on, so gc and its own retries would see it live."""
    root = tmp_path / "ckpt"
    group = ThreadCollective.group(2, timeout=5.0)
    group[1].abandon()  # rank 1 died before the save began
    with pytest.raises(CollectiveError):
        ckptfmt.open_writer(root, profile="weights", collective=group[0])
    assert not (root / LOCK_NAME).exists()
    with ckptfmt.open_writer(root, profile="weights") as w:  # a retry in this process is not locked out
        w.write_tensor("weights", "w", np.ones(3, np.float32))
    assert ckptfmt.open(root).verify().ok
