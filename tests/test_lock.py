"""The writer lock (ckptfmt/lock.py): one writer per checkpoint, stale locks of dead writers taken over, live or
unreadable ones respected, and the lock record itself. Writers racing for one checkpoint: test_concurrent_writers.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import ckptfmt
import ckptfmt.commit
import ckptfmt.run
from ckptfmt.errors import CheckpointExistsError, CheckpointLockedError
from ckptfmt.lock import WriterLock, read_lock, takeover_marker


def listing(url: str) -> dict[str, int]:
    """Every file under the root, hidden ones (the lock) included."""
    return ckptfmt.open_store(url).list()


# ---------------------------------------------------------------- one writer per checkpoint


def test_a_second_writer_is_refused_by_the_lock(store_url: str, fill_writer: Callable[..., None]) -> None:
    first = ckptfmt.open_writer(store_url, profile="training")
    assert ".writer-lock" in listing(store_url)
    with pytest.raises(CheckpointLockedError) as info:
        ckptfmt.open_writer(store_url, profile="training")
    assert isinstance(info.value, CheckpointExistsError)
    assert str(os.getpid()) in str(info.value)  # says who holds it
    with first:
        fill_writer(first, profile="training")
    assert ".writer-lock" not in listing(store_url)
    assert ckptfmt.verify(store_url).ok


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def put_lock(url: str, **holder: Any) -> None:
    ckptfmt.open_store(url).put_exclusive(".writer-lock", json.dumps(holder).encode())


def test_a_stale_lock_of_a_dead_pid_is_taken_over(store_url: str, fill_writer: Callable[..., None]) -> None:
    put_lock(store_url, host=socket.gethostname(), pid=dead_pid(), nonce="x", started_at="2026-01-01T00:00:00Z")
    with ckptfmt.open_writer(store_url, profile="training") as w:
        fill_writer(w, profile="training")
    assert ".writer-lock" not in listing(store_url)
    assert ckptfmt.verify(store_url).ok


@pytest.mark.parametrize(
    "holder",
    [
        {"host": socket.gethostname(), "pid": os.getpid()},  # alive
        {"host": "some-other-host", "pid": 1},  # cannot tell: another host
        {"host": socket.gethostname()},  # no pid
    ],
)
def test_a_live_or_unknown_lock_is_respected(store_url: str, holder: dict[str, Any]) -> None:
    put_lock(store_url, **holder)
    with pytest.raises(CheckpointLockedError):
        ckptfmt.open_writer(store_url, profile="weights")
    assert set(listing(store_url)) == {".writer-lock"}


def test_a_garbage_lock_is_respected(store_url: str) -> None:
    ckptfmt.open_store(store_url).put_exclusive(".writer-lock", b"\xff not json")
    with pytest.raises(CheckpointLockedError):
        ckptfmt.open_writer(store_url, profile="weights")


# ---------------------------------------------------------------- the record


def test_a_lock_round_trips_and_names_its_holder(store_url: str) -> None:
    mine = WriterLock.mine(bases=("step-1",))
    store = ckptfmt.open_store(store_url)
    store.put_exclusive(".writer-lock", mine.to_bytes())
    assert read_lock(store) == mine
    assert str(os.getpid()) in mine.holder() and socket.gethostname() in mine.holder()
    assert not mine.holder_is_dead()
    mine.abandon()
    assert mine.holder_is_dead()  # abandoned by this process: known gone


@pytest.mark.parametrize(
    "doc",
    [
        {"host": "h", "pid": 0, "nonce": "n", "started_at": "t"},  # no pid a host could have
        {"host": "h", "pid": "1", "nonce": "n", "started_at": "t"},
        {"host": "h", "pid": 1, "nonce": "n"},
        ["not", "an", "object"],
    ],
)
def test_an_unreadable_lock_reads_as_none(store_url: str, doc: object) -> None:
    store = ckptfmt.open_store(store_url)
    store.put_exclusive(".writer-lock", json.dumps(doc).encode())
    assert read_lock(store) is None


@pytest.mark.parametrize(
    ("started_at", "known"), [("2026-01-01T00:00:00Z", True), ("2026-01-01T00:00:00", False), ("soon", False)]
)
def test_a_locks_age_is_known_only_for_a_utc_time(started_at: str, known: bool) -> None:
    lock = WriterLock(host="h", pid=1, nonce="n", started_at=started_at)
    age = lock.age_seconds()
    assert (age is not None and age > 0) if known else age is None


# ---------------------------------------------------------------- two takers of one stale lock (redteam-3 finding 09)


class ScriptedReads:
    """Stands in for ``ckptfmt.commit.read_lock``: after thread NAME's N-th read of a lock, ``steps[(NAME, N)]``
    runs (waits on or sets events), so two takers interleave as a test says."""

    def __init__(self, steps: dict[tuple[str, int], Callable[[], object]]) -> None:
        self.real = ckptfmt.commit.read_lock
        self.steps = steps
        self.count: Counter[str] = Counter()

    def __call__(self, store: Any, path: str = ".writer-lock") -> Any:
        lock = self.real(store, path)
        name = threading.current_thread().name
        self.count[name] += 1
        step = self.steps.get((name, self.count[name]))
        if step is not None:
            step()
        return lock


def waiting(event: threading.Event) -> None:
    assert event.wait(timeout=60), "the other taker never got there"


def open_together(url: str, returned: dict[str, threading.Event]) -> dict[str, Any]:
    """Writers A and B open ``url`` at once, in threads of those names; what each constructor gave (a writer,
    or the error it raised). ``returned[name]`` is set when that constructor is done."""
    outcome: dict[str, Any] = {}

    def open_one(name: str) -> None:
        try:
            outcome[name] = ckptfmt.open_writer(url, profile="training")
        except BaseException as exc:  # kept for the test's assertions
            outcome[name] = exc
        finally:
            if name in returned:
                returned[name].set()

    threads = [threading.Thread(target=open_one, args=(name,), name=name) for name in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return outcome


def check_one_writer(outcome: dict[str, Any], url: str, fill_writer: Callable[..., None]) -> None:
    """Every writer given the root writes the same file names and commits, A first (as the report's steps);
    then exactly A must have held it, B been refused, and A's checkpoint be whole."""
    for name in ("A", "B"):
        w = outcome[name]
        if isinstance(w, ckptfmt.CheckpointWriter):
            try:
                with w:
                    fill_writer(w, profile="training", seed=ord(name))
            except CheckpointExistsError:
                pass  # a second holder's commit fails, and its abort runs
    assert isinstance(outcome["A"], ckptfmt.CheckpointWriter), outcome
    assert isinstance(outcome["B"], CheckpointLockedError), outcome
    assert ckptfmt.verify(url).ok
    assert not [p for p in listing(url) if "writer-lock" in p]  # no lock, no takeover marker left


def stale_lock(url: str) -> None:
    put_lock(url, host=socket.gethostname(), pid=dead_pid(), nonce="dead", started_at="2026-01-01T00:00:00Z")


def test_a_taker_of_a_stale_lock_that_another_took_over_first_is_refused(
    store_url: str, fill_writer: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B both read the dead lock; B goes on only once A's constructor has returned (holding the root)."""
    stale_lock(store_url)
    both_read = threading.Barrier(2, timeout=60)
    a_returned = threading.Event()
    steps = {("A", 1): both_read.wait, ("B", 1): lambda: (both_read.wait(), waiting(a_returned))}
    monkeypatch.setattr(ckptfmt.commit, "read_lock", ScriptedReads(steps))
    check_one_writer(open_together(store_url, {"A": a_returned}), store_url, fill_writer)


def test_two_takers_that_both_still_see_the_stale_lock_are_not_both_let_through(
    store_url: str, fill_writer: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B both read the dead lock; A reads it once more (about to delete it) and waits there until B is done.
    Comparing the lock before deleting it would let both through: both would still see the dead one."""
    stale_lock(store_url)
    both_read = threading.Barrier(2, timeout=60)
    a_ready, b_returned = threading.Event(), threading.Event()

    def a_about_to_delete() -> None:
        a_ready.set()
        waiting(b_returned)

    steps = {
        ("A", 1): both_read.wait,
        ("A", 2): a_about_to_delete,
        ("B", 1): lambda: (both_read.wait(), waiting(a_ready)),
    }
    monkeypatch.setattr(ckptfmt.commit, "read_lock", ScriptedReads(steps))
    # a_ready is also set when A's constructor returns, for a taker that does not read the lock twice
    check_one_writer(open_together(store_url, {"A": a_ready, "B": b_returned}), store_url, fill_writer)


def test_a_takeover_marker_left_by_a_killed_taker_refuses_and_gc_removes_it(
    store_url: str, fill_writer: Callable[..., None]
) -> None:
    """A taker killed between making the marker and taking the lock over: the root stays refused, never taken
    by two, until `ckpt gc` removes the dead lock and the marker (named as the lock's temp file)."""
    root = f"{store_url}/step-000000005"
    stale_lock(root)
    dead = read_lock(ckptfmt.open_store(root))
    assert dead is not None
    ckptfmt.open_store(root).put_exclusive(takeover_marker(dead), b"a taker that died")
    with pytest.raises(CheckpointLockedError):
        ckptfmt.open_writer(root, profile="training")
    assert [e.name for e in ckptfmt.run.RunDirectory(store_url).gc(keep_last=1)] == ["step-000000005"]
    assert not listing(root)
    with ckptfmt.open_writer(root, profile="training") as w:
        fill_writer(w, profile="training")
    assert ckptfmt.verify(root).ok
