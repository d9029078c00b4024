"""bench/cuda_snapshot.py, the memory tier's CUDA path as one short script (issue 44), run on the CPU so that it
works the day a GPU is at hand: it trains, snapshots every step, restores from memory into a fresh model and says
the restore is exact. Its figures are not judged (tests assert behaviour, never time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "cuda_snapshot.py"


def test_the_script_runs_its_whole_path_on_the_cpu_and_restores_the_newest_snapshot_exactly(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--mib", "16", "--steps", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["bit_identical"] is True and figures["restored_step"] == 3 and figures["restored_from"] == "memory"
    assert figures["copy_gb_s"] > 0 and figures["step_s_snapshot"] > 0
    assert "| cpu |" in run.stdout


def test_without_a_gpu_the_default_says_so_and_measures_nothing(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU is here: the default is the real run, not this refusal
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1 and "no CUDA device" in run.stderr
