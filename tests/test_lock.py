"""The writer lock (ckptfmt/lock.py): one writer per checkpoint, stale locks of dead writers taken over, live or
unreadable ones respected, and the lock record itself. Writers racing for one checkpoint: test_concurrent_writers.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import ckptfmt
from ckptfmt.errors import CheckpointExistsError, CheckpointLockedError
from ckptfmt.lock import WriterLock, read_lock


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
