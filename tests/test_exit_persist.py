"""An interpreter that exits normally, without ``close()``, persists the memory tier's newest snapshot (the
manager's atexit handler, spec/memory.md).

``concurrent.futures`` refuses new work once the interpreter has begun to shut its pools down, before atexit
handlers run. The persist's staged writes (``storage/direct.py``, for a file over one 32 MiB buffer) and a last
snapshot still being written at exit (the writer's pool) then run on the thread that submits them
(``ckptfmt/thread_pools.py``). A real process trains a few steps and falls off the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckptfmt
from ckptfmt.run import RunDirectory

pytestmark = pytest.mark.slow  # a trainer subprocess: left out by -m "not slow" (README)

STEPS = 3
# Two runs in one process, each with its own manager: the state of a linear layer of width W and AdamW's two
# moments, 3 * W * W float32 (2400: 66 MiB, the optimizer's file of 44 MiB over one 32 MiB staging buffer; 8: a
# few KiB). One interpreter for both, as a first optimizer costs seconds of imports (torch._dynamo) in each.
WIDTHS = {"large": 2400, "tiny": 8}

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from ckptfmt.torch import CheckpointManager, ResumableDataLoader

    base, steps, widths = sys.argv[1], int(sys.argv[2]), dict(a.split("=") for a in sys.argv[3:])
    torch.manual_seed(0)
    runs = []
    for name, width in widths.items():
        model = nn.Linear(int(width), int(width))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = ResumableDataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
        mgr = CheckpointManager(
            f"{base}/{name}-run",
            loader=loader,
            keep_last=2,
            preemption_signals=(),
            memory_every=1,
            memory_dir=f"{base}/{name}-memory",
        )
        runs.append((model, optimizer, mgr))
    for step in range(1, steps + 1):
        for model, optimizer, mgr in runs:
            model(torch.randn(2, model.in_features)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.checkpoint_if_due(step, every=10**9, model=model, optimizer=optimizer, config={})
    # no mgr.close(): the interpreter exits normally, and each manager's atexit handler persists its newest snapshot
    """
)


def test_a_normal_exit_without_close_persists_the_newest_snapshot(tmp_path: Path) -> None:
    script, base = tmp_path / "train.py", tmp_path / "runs"
    script.write_text(SCRIPT)
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(base), str(STEPS), *(f"{n}={w}" for n, w in WIDTHS.items())],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "could not be persisted" not in done.stderr, done.stderr
        for name in WIDTHS:
            run = RunDirectory(base / f"{name}-run")
            committed = [e for e in run.entries() if e.status == "committed"]
            assert [e.step for e in committed] == [STEPS], (name, done.stderr)  # durable only at exit: every=10**9
            assert run.latest()["step"] == STEPS  # type: ignore[index]
            assert ckptfmt.verify(base / f"{name}-run" / committed[0].name).ok, name
    finally:
        shutil.rmtree(base, ignore_errors=True)  # a few hundred MiB of slots and copies: not kept by pytest
