"""A thread that acts on a termination signal at once, even while the trainer's thread is blocked.

A Python signal handler runs only when the main thread returns to the interpreter, which a trainer blocked in a
collective with a dead peer never does before torchrun's SIGKILL. The C-level handler writes the signal number to
the wakeup fd (``signal.set_wakeup_fd``), which the watcher thread reads at once. The memory tier uses it to
persist its newest snapshot on SIGTERM (:meth:`~ckptfmt.torch.memory.MemorySnapshots.start_watcher`).

Call sequence (main thread)::

    watcher = SignalWatcher(on_signal)
    watcher.start(signals)   # no-op off the main thread, or when another owner (asyncio) holds the wakeup fd
    watcher.stop()           # at close; idempotent

No lock: ``start`` and ``stop`` run on the trainer's thread; the watcher thread only calls ``on_signal``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from ..errors import CheckpointError
from ..tier.persist import Persisted

log = logging.getLogger("ckptfmt")


class SignalWatcher:
    """Calls ``on_signal`` (a persist of the newest snapshot) from a thread of its own when a watched signal arrives;
    logs what it made durable, or why it could not."""

    def __init__(self, on_signal: Callable[[], Persisted | None]) -> None:
        self._on_signal = on_signal
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None

    def start(self, signals: tuple[signal.Signals, ...]) -> None:
        """Watch ``signals`` (main thread only, and only when nobody else owns the wakeup fd)."""
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        wanted = {int(s) for s in signals}

        def watch() -> None:
            while True:
                try:
                    data = os.read(read_fd, 64)
                except OSError:
                    return
                if not data:
                    return
                if wanted & set(data):
                    try:
                        done = self._on_signal()
                        if done is not None:
                            log.warning(
                                "signal received: memory snapshot of step %d is durable (%s)", done.step, done.status
                            )
                    except CheckpointError as exc:
                        log.error("signal received: the newest memory snapshot could not be persisted: %s", exc)

        self._thread = threading.Thread(target=watch, name="ckptfmt-sigterm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._wakeup is None:
            return
        read_fd, write_fd = self._wakeup
        self._wakeup = None
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        os.close(write_fd)
        os.close(read_fd)
