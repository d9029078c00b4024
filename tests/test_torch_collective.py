"""TorchCollective over a real gloo group of two processes: gather collects to the destination only.

It used to be an all-gather padded to the longest message: a rank sending 5 bytes while another sent 64 MiB
allocated world x 64 MiB (issue 23). Here rank 1 sends 5 bytes and its peak memory must not move.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

WORKER = textwrap.dedent(
    """
    import os, resource, sys
    import torch.distributed as dist
    from ckptfmt.torch.collective import TorchCollective

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    collective = TorchCollective()
    big = bytes(range(256)) * (64 << 12)  # 64 MiB on rank 0
    mine = big if rank == 0 else b"hello"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gathered = collective.gather(mine, dst=0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        assert gathered is not None and gathered[0] == big and gathered[1] == b"hello", "gathered wrong bytes"
    else:
        assert gathered is None
    echoed = collective.broadcast(b"done" if rank == 0 else None, src=0)
    assert echoed == b"done"
    print(f"rank {rank} grew {(after - before) / 1024:.1f} MiB", flush=True)
    dist.destroy_process_group()
    """
)


def test_gather_allocates_nothing_on_a_rank_that_sends_little(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    grew = float(outs[1].split("grew ")[1].split(" MiB")[0])
    assert grew < 16, outs[1]  # was 324 MiB: the all-gather padded every slot to the longest message
