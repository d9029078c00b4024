"""Work handed to a thread pool while the interpreter exits.

``concurrent.futures`` shuts its pools down from ``threading._register_atexit``, which runs before :mod:`atexit`
handlers: from then on every ``ThreadPoolExecutor.submit`` raises ``RuntimeError``, even from a pool's own thread
still finishing its queue. The memory tier persists its newest snapshot from an atexit handler (and a snapshot
still being written at exit finishes during that shutdown), and both reach pools: the staged writes, a writer's
and a reader's pools. There the work runs on the caller's thread instead, which gives the same result in the
same order (the caller waits for its futures anyway) and the same error, delivered by the returned future.
"""

from __future__ import annotations

import concurrent.futures.thread as pool_threads
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# ThreadPoolExecutor.submit's words once the interpreter shuts its pools down (3.9+); a pool shut down by its
# owner says "cannot schedule new futures after shutdown", a bug that must still raise, except at exit (below).
_INTERPRETER_SHUTDOWN = "after interpreter shutdown"
_OWN_SHUTDOWN = "after shutdown"


def refused_at_exit(exc: RuntimeError) -> bool:
    """Whether a pool refused work because the interpreter is exiting. At exit an idle worker that takes the stop
    sentinel marks its own pool shut down, so that pool then says "after shutdown" like one its owner shut down
    (seen in CI: a snapshot finishing during the exit submitted to such a pool); concurrent.futures' exit flag
    (private, read defensively) tells the two apart."""
    message = str(exc)
    if _INTERPRETER_SHUTDOWN in message:
        return True
    return _OWN_SHUTDOWN in message and bool(getattr(pool_threads, "_shutdown", False))


def submit_or_run(pool: Executor, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``pool.submit(fn, *args, **kwargs)``; when the pool refuses it because the interpreter is exiting, ``fn``
    runs now on the calling thread and the future returned is done (its result, or its exception, as a pool
    thread would have left it). Every other error of ``submit`` is raised."""
    submitted = try_submit(pool, fn, *args, **kwargs)
    if submitted is not None:
        return submitted
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # as a pool's worker does: the caller gets it from result()
        future.set_exception(exc)
    else:
        future.set_result(result)
    return future


def try_submit(pool: Executor, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T] | None:
    """``pool.submit(fn, *args, **kwargs)``, or None when the pool refuses it because the interpreter is exiting:
    for work that cannot run on the caller's thread in its place (a producer the caller consumes from)."""
    try:
        return pool.submit(fn, *args, **kwargs)
    except RuntimeError as exc:
        if not refused_at_exit(exc):
            raise
    return None


__all__ = ["submit_or_run", "try_submit"]
