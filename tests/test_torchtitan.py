"""torchtitan's own trainer and CheckpointManager saving and resuming through ckptfmt's DCP storage layer
(examples/torchtitan): 4 uninterrupted steps against 2 steps, a SIGKILL right after the step-2 checkpoint, and a
resume to step 4; the two step-4 checkpoints are bit-identical and ``ckpt verify`` passes.

It runs where ``CKPTFMT_TORCHTITAN`` names the python of a venv made by scripts/torchtitan_env.sh: scripts/test.sh
(CI) makes one in .venv-torchtitan (torchtitan 0.3.0 and its pinned packages over this venv's torch, about 10 s)
and sets it; the three trainer runs take about 45 s. A plain ``pytest`` without it skips this module, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchtitan"
CKPT = Path(sys.executable).with_name("ckpt")
PYTHON = os.environ.get("CKPTFMT_TORCHTITAN", "")
RUN_TIMEOUT = 150  # one run takes ~15 s on one core

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not PYTHON,
        reason="needs torchtitan: run scripts/torchtitan_env.sh and set CKPTFMT_TORCHTITAN to the python it prints",
    ),
]


def compare_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchtitan_compare", EXAMPLE / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(dump: Path, log: Path, *, kill_at_step: int = -1) -> int:
    """One 1-rank torchrun of examples/torchtitan/launch.py to step 4; its exit status. The trainer leads its own
    process group, killed whole on the way out, so a failure or a timeout leaves no process behind."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(EXAMPLE / "launch.py")]
    cmd += ["--module", "cpu_config", "--config", "llama3_debugmodel_cpu", "--dump-folder", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPTFMT_TITAN_KILL_AT_STEP": str(kill_at_step)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=dump.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=RUN_TIMEOUT)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def test_a_killed_and_resumed_torchtitan_run_ends_bit_identical(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert train(straight, tmp_path / "straight.log") == 0, (tmp_path / "straight.log").read_text()[-5000:]

    assert train(killed, tmp_path / "killed.log", kill_at_step=2) != 0
    steps = sorted(p.name for p in (killed / "checkpoint").iterdir())
    assert steps == ["step-2"], steps
    assert (killed / "checkpoint" / "step-2" / "manifest.json").is_file()

    log = tmp_path / "resumed.log"
    assert train(killed, log) == 0, log.read_text()[-5000:]
    text = log.read_text()
    assert f"Loading the checkpoint from {killed / 'checkpoint' / 'step-2'}." in text, text[-5000:]

    a, b = straight / "checkpoint" / "step-4", killed / "checkpoint" / "step-4"
    problems, compared = compare_module().differences(str(a), str(b))
    assert problems == []
    assert compared > 100  # the model's and the optimizer's tensors, not an empty field
    for path in (a, b):
        proc = subprocess.run([str(CKPT), "verify", str(path)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
