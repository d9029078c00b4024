"""submit_or_run: a pool's refusal at interpreter shutdown runs the work on the caller's thread; any other refusal
is raised (the real shutdown is exercised by tests/test_exit_persist.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import pytest

from ckptfmt.thread_pools import submit_or_run, try_submit


class ExitingPool(Executor):
    """A pool as concurrent.futures leaves every pool once the interpreter has begun to exit."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")


def test_a_pool_that_works_runs_the_work_on_its_thread() -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = submit_or_run(pool, threading.current_thread)
        assert future.result() is not threading.current_thread()


def test_at_interpreter_shutdown_the_work_runs_on_the_callers_thread() -> None:
    future = submit_or_run(ExitingPool(), lambda a, *, b: (threading.current_thread(), a + b), 1, b=2)
    assert future.done() and future.result() == (threading.current_thread(), 3)


def test_at_interpreter_shutdown_the_works_error_comes_from_result() -> None:
    def fail() -> None:
        raise OSError(28, "No space left on device")

    future = submit_or_run(ExitingPool(), fail)
    with pytest.raises(OSError, match="No space left"):
        future.result()


def test_a_pool_shut_down_by_its_owner_still_refuses() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="after shutdown"):
        submit_or_run(pool, ran.append, 1)
    assert ran == []


def test_try_submit_says_none_at_interpreter_shutdown_and_raises_any_other_refusal() -> None:
    assert try_submit(ExitingPool(), threading.current_thread) is None
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        try_submit(pool, threading.current_thread)


def test_at_exit_a_pool_that_marked_itself_shut_down_runs_the_work_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At exit an idle worker that takes concurrent.futures' stop sentinel marks its pool shut down, and the pool
    then says "after shutdown", as one its owner shut down does: with the exit flag set, that is the exit's."""
    import concurrent.futures.thread as pool_threads

    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    monkeypatch.setattr(pool_threads, "_shutdown", True)
    future = submit_or_run(pool, threading.current_thread)
    assert future.result() is threading.current_thread()
    assert try_submit(pool, threading.current_thread) is None
