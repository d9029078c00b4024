"""bench/cpu_per_gib.py runs its whole path at a small size (its figures are not judged: tests assert behaviour)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "cpu_per_gib.py"


def test_the_bench_measures_every_row_and_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--mib", "8", "--repeat", "1", "--dir", str(tmp_path / "w"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    for key in ("cpu_s_per_gib", "user_s_per_gib"):
        figures = report[key]
        assert set(figures) == {"xxh3", "copy", "hashes", "save", "snapshot", "verify"}
        assert all(v >= 0 for v in figures.values())
    assert report["digest"] == "xxh3-128-tree"  # the library's default
    assert list((tmp_path / "w").iterdir()) == []  # its checkpoint and run directory removed
