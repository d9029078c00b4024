"""What the multi-rank benches share: ranks as processes on loopback, a disk left quiet between timings, and memory
the hypervisor already backs before each timed save or load.

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


def warm_page_cache(directory: Path, nbytes: int) -> None:
    """Write ``nbytes`` to a scratch file in ``directory`` and delete it before writeback (no disk I/O), so the save
    timed next writes through the page cache into memory the hypervisor already backs. This VM's host backs guest
    memory lazily and takes back what the guest frees: a new file of 256 MiB took 0.5-0.6 s to write into such
    memory and 0.05 s into page-cache memory freed a second before (fsync 0.08 s either way); anonymous memory
    written and freed first did not help. Without this, a save through the page cache was fast or slow by whether
    the save before it had just removed its files. Bare-metal nodes have no such cost."""
    scratch = directory / f".warm-page-cache-{os.getpid()}"
    piece = memoryview(bytes(4 << 20))
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, piece[: nbytes - written])
    finally:
        os.close(fd)
        scratch.unlink()


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
