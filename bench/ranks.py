"""What the multi-rank benches share: ranks as processes on loopback, and a disk left quiet between timings.

``launch`` runs a bench script once per rank with ``--worker --mode MODE --out OUT`` plus its own arguments, under
torch.distributed's environment variables, and reads each rank's ``result-<mode>-<world>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache: fsync each (dirty pages are not dropped), then DONTNEED."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_path(path: Path) -> None:
    """Make a file, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle() -> None:
    """Let the disk finish what earlier saves left it (a virtual disk's host may still be writing back after the
    guest's fsync), so a load is not timed against another save's writeback: sync, then a second of quiet."""
    os.sync()
    time.sleep(1.0)


def launch(script: str, mode: str, world: int, out: str, extra: Sequence[str]) -> list[Any]:
    """Run ``script`` on ``world`` ranks in ``mode`` and return each rank's result, in rank order. Every rank is
    waited for before any is judged, so none is left behind when one fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        env.update({"WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, script, "--worker", "--mode", mode, "--out", out, *extra]
        procs.append(subprocess.Popen(cmd, env=env))
    failed = [p.wait() for p in procs]
    if any(failed):
        raise SystemExit(f"{mode} on {world} ranks failed (exit codes {failed})")
    return [json.loads((Path(out) / f"result-{mode}-{world}-{r}.json").read_text()) for r in range(world)]
