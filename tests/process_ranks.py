"""Ranks as processes on loopback: one script per rank under torch.distributed's environment variables, each
forked from a warm interpreter (tests/warm_ranks.py)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from warm_ranks import WarmProcess


def launch(
    script: Path,
    args: Sequence[str],
    world: int,
    *,
    env: Sequence[Mapping[str, str]] = (),
    timeout: float = 180,
    check: bool = True,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script args`` once per rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set, plus ``env[rank]``) and
    wait for all; a rank that has not finished within ``timeout`` seconds kills them all and raises. ``check``: a
    rank that exits non-zero raises (False: the caller looks at the return codes, e.g. of ranks that kill
    themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        variables = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            **(env[rank] if rank < len(env) else {}),
        }
        procs.append(WarmProcess(script, list(args), env=variables, stderr_to_stdout=True))  # see warm_ranks.py
    results = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    except subprocess.TimeoutExpired as exc:
        said = []
        for rank, proc in enumerate(procs):
            status = proc.returncode  # None: still running when the time ran out
            proc.kill()
            proc.wait()
            state = "running" if status is None else f"exited {status}"
            said.append(f"--- rank {rank} ({state}):\n{proc.output()[-3000:]}")
        raise AssertionError(f"{script.name} on {world} ranks hung\n" + "\n".join(said)) from exc
    for rank, result in enumerate(results):
        assert not check or result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return results
