"""Killing a writer: instrumented kill points (the Nth os call or HTTP request) and random moments.

Children are forked from a parent that has already imported numpy and ckptfmt, so a trial costs
milliseconds. A child never returns into the parent's code (pytest included): it leaves through
``os._exit``, with status 0 when its work finished and 3 when it raised.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# The os functions LocalStore (and the run directory through it) calls to change what is on disk.
TRACED_OS = ("open", "write", "fsync", "rename", "link", "unlink", "mkdir", "rmdir", "close")


@dataclass(frozen=True, slots=True)
class ChildExit:
    killed: bool  # SIGKILLed (by the parent or at its own kill point)
    finished: bool  # the work returned normally (exit 0)
    status: int


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL cannot be caught


class Counter:
    """A thread-safe count of traced calls, optionally SIGKILLing the process just before call ``kill_at``."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at = kill_at
        self._next = itertools.count(1)
        self.calls = 0
        self.names: list[str] = []

    def tick(self, name: str) -> None:
        n = next(self._next)  # atomic under the GIL: threads of the writer's pool share it
        self.calls = max(self.calls, n)
        self.names.append(name)
        if self.kill_at is not None and n >= self.kill_at:
            _die()


@contextmanager
def traced_os(counter: Counter, names: tuple[str, ...] = TRACED_OS) -> Iterator[Counter]:
    """Route the named os functions through ``counter.tick`` (in this process, every thread)."""
    originals = {name: getattr(os, name) for name in names}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            counter.tick(name)
            return real(*args, **kwargs)

        return traced

    for name, real in originals.items():
        setattr(os, name, wrap(name, real))
    try:
        yield counter
    finally:
        for name, real in originals.items():
            setattr(os, name, real)


@contextmanager
def traced_http(counter: Counter) -> Iterator[Counter]:
    """Route every HTTP request s3fs (aiobotocore) sends through ``counter.tick``."""
    from aiobotocore.endpoint import AioEndpoint  # type: ignore[import-untyped]

    real = AioEndpoint._send

    async def traced(self: Any, request: Any) -> Any:
        counter.tick(f"{request.method} {request.url.split('?')[0].rsplit('/', 1)[-1]}")
        return await real(self, request)

    AioEndpoint._send = traced
    try:
        yield counter
    finally:
        AioEndpoint._send = real


def fork(work: Callable[[], None], *, setup: Callable[[], None] | None = None) -> int:
    """Run ``work`` in a forked child; returns its pid. ``setup`` runs in the child first."""
    pid = os.fork()
    if pid:
        return pid
    status = 0
    try:
        if setup is not None:
            setup()
        work()
    except BaseException:
        traceback.print_exc()
        status = 3
    finally:
        os._exit(status)


def reap(pid: int, *, timeout: float = 60.0) -> ChildExit:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child {pid} hung for {timeout} s")
        time.sleep(0.001)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finished = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if not killed and not finished:
        raise AssertionError(f"child failed with status {status} (its traceback is on stderr)")
    return ChildExit(killed=killed, finished=finished, status=status)


def run_killed_at_call(work: Callable[[], None], kill_at: int, *, http: bool = False) -> ChildExit:
    """Fork ``work`` with SIGKILL just before its ``kill_at``-th traced os call (HTTP request if ``http``)."""

    def traced_work() -> None:
        counter = Counter(kill_at)
        with traced_http(counter) if http else traced_os(counter):
            work()

    return reap(fork(traced_work))


def run_killed_after(work: Callable[[], None], delay_s: float) -> ChildExit:
    """Fork ``work`` and SIGKILL it after ``delay_s`` seconds (unless it finished by then)."""
    pid = fork(work)
    time.sleep(delay_s)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return reap(pid)


def count_calls(work: Callable[[], None], *, http: bool = False) -> list[str]:
    """The traced calls ``work`` makes when nothing kills it, in order (run in a child, so nothing leaks)."""
    read_fd, write_fd = os.pipe()

    def counted() -> None:
        counter = Counter()
        with traced_http(counter) if http else traced_os(counter):
            work()
        payload = "\n".join(counter.names).encode()
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)

    pid = fork(counted)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as src:
        data = src.read()
    exit_ = reap(pid)
    assert exit_.finished, "the uninterrupted run failed"
    return data.decode().split("\n") if data else []


class Progress:
    """A child reports the steps it committed through a pipe; the parent reads them after the child dies."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._lock = threading.Lock()
        self._real_write = os.write  # never a traced call: reporting is not part of the work

    def report(self, step: int) -> None:
        with self._lock:
            self._real_write(self._write, f"{step}\n".encode())

    def collect(self) -> list[int]:
        """In the parent, after the child is reaped."""
        os.close(self._write)
        chunks = []
        while True:
            data = os.read(self._read, 1 << 16)
            if not data:
                break
            chunks.append(data)
        os.close(self._read)
        return [int(line) for line in b"".join(chunks).decode().split()]
