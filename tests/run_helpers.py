"""Helpers for the run-directory and ``ckpt gc`` tests: small checkpoints by step, writer locks live and dead.

Imported by path (pytest's importlib mode keeps tests/ off sys.path): each test module inserts
its own directory first.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import ckptfmt
from ckptfmt.run import checkpoint_name


def write_step(run: Path, step: int, *, name: str | None = None) -> str:
    """A small committed weights checkpoint named by ``step`` (provenance carries the step); returns its name."""
    name = name or checkpoint_name(step)
    with ckptfmt.open_writer(str(run / name), profile="weights") as w:
        w.write_tensors("weights", {"w": np.full((4,), step, dtype=np.float32)})
        w.write_context("provenance", {"step": step})
    return name


def write_remains(run: Path, name: str, lock: dict[str, object] | None) -> None:
    """What a writer leaves before its manifest: a data file and, unless None, its lock."""
    (run / name / "weights").mkdir(parents=True)
    (run / name / "weights" / "r00000-00000.safetensors").write_bytes(b"x" * 10)
    if lock is not None:
        (run / name / ".writer-lock").write_text(json.dumps(lock))


def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def lock_of(pid: int, *, host: str | None = None, started_at: str = "2026-01-02T03:04:05Z") -> dict[str, object]:
    return {"host": host or socket.gethostname(), "pid": pid, "nonce": "00", "started_at": started_at}


@contextmanager
def live_process() -> Iterator[int]:
    """A process of this host that runs until the block ends: a live writer's pid."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
