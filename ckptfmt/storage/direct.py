"""Writing a file around the page cache (``O_DIRECT``) through a reused, page-aligned staging buffer.

A checkpoint's bytes are written once and not read back by the writer, so passing them through the
page cache buys nothing and costs: a copy into freshly allocated cache pages (on a virtual machine
whose host backs guest memory lazily, slower than the disk itself),
a dirty-page flush at ``fsync``, and a training node's dataset cache evicted by bytes nobody reads.

Bytes are copied into an aligned buffer and written from it in whole buffers with ``O_DIRECT``; the
last partial block goes through the page cache (``O_DIRECT`` cleared), and ``fsync`` then makes the
file durable as before. A file smaller than one buffer never turns ``O_DIRECT`` on. Where the
filesystem refuses ``O_DIRECT`` (``EINVAL``), the file is written through the page cache instead.

A full buffer is written on a small shared pool of writer threads while the caller fills the other
buffer (copy, hashing): the disk never waits for the CPU, nor the CPU for the disk. At most one write per
file is in flight, so writes stay in order.
Once the interpreter has begun to exit, the pool takes no more work: the write then runs on the caller's
thread (:mod:`ckptfmt.thread_pools`; a persist at exit).

Memory: two ``BUFFER_BYTES`` buffers per file being written, taken from a pool that keeps at most
``POOL_IDLE`` of them between files (reused pages: no page faults on the next save).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ..thread_pools import submit_or_run

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every file goes through the page cache
ALIGN = 4096  # buffer address, write length and file offset: a multiple of every logical block size in use
# 32 MiB: one O_DIRECT write of it keeps several requests in flight at the device (8 of the disk's 4 MiB ones),
# where 8 and 16 MiB buffers kept it at a queue depth of one or two and saved slower (docs/benchmarks.md).
BUFFER_BYTES = 32 << 20
POOL_IDLE = 4
_WRITER_THREADS = 4


def _new_writers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_WRITER_THREADS, thread_name_prefix="ckptfmt-direct")


_WRITERS = _new_writers()  # the writes themselves


class _BufferPool:
    def __init__(self) -> None:
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        # Anonymous mappings are page-aligned. Private, not Python's default MAP_SHARED: a shared one would be the
        # same memory in a forked child, which would then stage its bytes into the buffer its parent is filling.
        return mmap.mmap(-1, BUFFER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._idle) < POOL_IDLE:
                self._idle.append(buffer)
                return
        buffer.close()


_POOL = _BufferPool()


def _after_fork_in_child() -> None:
    """A forked child starts with its own pool and writer threads: the parent's threads do not exist in it, yet
    its executor would count them as idle and queue writes nobody runs (a hang)."""
    global _POOL, _WRITERS
    _POOL = _BufferPool()
    _WRITERS = _new_writers()


os.register_at_fork(after_in_child=_after_fork_in_child)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class StagedWriter:
    """The bytes written to ``fd`` (opened for writing at offset 0), staged and flushed as described above."""

    def __init__(self, fd: int, *, direct: bool) -> None:
        self._fd = fd
        self._allow_direct = direct and bool(O_DIRECT)
        self._direct = False
        self._buffer: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._fill = 0
        self._pending: Future[None] | None = None  # the write of the other buffer, in flight
        self._spare: tuple[mmap.mmap, memoryview] | None = None  # the other buffer (being written, or free)

    def write(self, data: memoryview) -> None:
        if self._view is None:
            self._buffer = _POOL.take()
            self._view = memoryview(self._buffer)
        while data:
            n = min(len(data), BUFFER_BYTES - self._fill)
            self._view[self._fill : self._fill + n] = data[:n]
            self._fill += n
            data = data[n:]
            if self._fill == BUFFER_BYTES:
                self._flush_full()

    def finish(self) -> None:
        """Write what is staged; the file then holds every byte written (not yet fsynced)."""
        if self._view is None:
            return
        self._wait()
        view, fill = self._view, self._fill
        aligned = fill - fill % ALIGN if self._direct else 0
        if aligned:
            self._write_direct(view[:aligned])
        if self._direct:
            self._set_direct(False)
        write_all(self._fd, view[aligned:fill])
        self._fill = 0
        self.release()

    def release(self) -> None:
        """Return the staging buffers to the pool once no write uses them (idempotent; also on abort)."""
        if self._pending is not None:
            self._pending.exception()  # wait; the error, if any, was or will be reported by the caller's path
            self._pending = None
        if self._spare is not None:
            buffer, view = self._spare
            view.release()
            _POOL.give(buffer)
            self._spare = None
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._buffer is not None:
            _POOL.give(self._buffer)
            self._buffer = None

    def _wait(self) -> None:
        """Wait for the write in flight and raise its error (an OSError, as a synchronous write would)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _flush_full(self) -> None:
        assert self._view is not None and self._buffer is not None
        self._wait()  # the other buffer is free again, and the flags are no longer in use by a write
        if self._allow_direct and not self._direct:
            self._direct = self._set_direct(True)
            self._allow_direct = self._direct
        self._pending = submit_or_run(_WRITERS, self._write_direct if self._direct else self._write_cached, self._view)
        full = (self._buffer, self._view)
        if self._spare is None:
            buffer = _POOL.take()
            self._spare = (buffer, memoryview(buffer))
        self._buffer, self._view = self._spare
        self._spare = full
        self._fill = 0

    def _write_cached(self, data: memoryview) -> None:
        write_all(self._fd, data)

    def _write_direct(self, data: memoryview) -> None:
        while data:
            try:
                data = data[os.write(self._fd, data) :]
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                # A filesystem that took the flag but not the write: the rest goes through the page cache.
                self._set_direct(False)
                self._allow_direct = False

    def _set_direct(self, on: bool) -> bool:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, (flags | O_DIRECT) if on else (flags & ~O_DIRECT))
        except OSError:
            if on:
                return False  # not supported here: stay on the page cache
            raise
        self._direct = on
        return on


__all__ = ["ALIGN", "BUFFER_BYTES", "O_DIRECT", "StagedWriter"]
