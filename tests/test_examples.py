"""The README's demos, run as `scripts/demo.sh` runs them: from the repository root, with the installed package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), str(out)],
        cwd=ROOT,  # as scripts/demo.sh: the source tree is on sys.path first, cli/ is not mapped there
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_the_story_demo_runs_and_proves_the_resume(tmp_path: Path) -> None:
    proc = run_example("story.py", tmp_path / "story")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed at step 12" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_format_demo_runs_and_catches_the_flipped_byte(tmp_path: Path) -> None:
    proc = run_example("demo.py", tmp_path / "demo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "corruption caught" in proc.stdout
    assert "digest_mismatch" in proc.stdout + proc.stderr
