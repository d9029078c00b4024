"""bench/multirank.py at a tiny size: every world size runs, and the reshard rows report bytes per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench" / "multirank.py"


@pytest.mark.skipif(
    os.environ.get("CKPTFMT_BENCH_SMOKE") != "1",
    reason="starts 13 process groups (about 30 s); set CKPTFMT_BENCH_SMOKE=1 (the bench itself is run by hand)",
)
def test_tiny_run_reports_every_world_and_reshard(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size-mib", "4", "--repeat", "1", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["worlds"]) == {"1", "2", "4"}
    for m in report["worlds"].values():
        timed = {"ckptfmt_save", "dcp_save", "safetensors_save", "ckptfmt_load", "dcp_load"}
        timed |= {"ckptfmt_restart", "dcp_restart"}
        ratios = {"save_ratios", "safetensors_save_ratios", "load_ratios", "restart_ratios"}
        assert set(m) == timed | ratios
        assert all(m[k] > 0 for k in timed)
        assert m["load_ratios"] == [m["dcp_load"] / m["ckptfmt_load"]]  # one repetition: its ratio
        assert m["save_ratios"] == [m["dcp_save"] / m["ckptfmt_save"]]
        assert m["safetensors_save_ratios"] == [m["safetensors_save"] / m["ckptfmt_save"]]
        assert m["restart_ratios"] == [m["dcp_restart"] / m["ckptfmt_restart"]]
    assert set(report["reshard"]) == {"4->3", "4->2"}
    for label, m in report["reshard"].items():
        world = int(label.split("->")[1])
        assert len(m["per_rank"]) == world and m["ideal"] == 1 / world
        # fractions of the checkpoint; together the ranks read all of it at least once
        assert all(0 < f <= 1 for f in m["per_rank"]) and m["sum"] >= 0.99
        assert m["ratios"] == [m["dcp_load"] / m["ckptfmt_read"]]
        assert m["ckptfmt_restart"] > 0 and m["restart_ratios"] == [m["dcp_restart"] / m["ckptfmt_restart"]]
    assert "| ranks | ckptfmt save |" in proc.stdout and "| 3 ranks |" in proc.stdout
    assert "Durable saves" in proc.stdout and "Loaded by a restart" in proc.stdout
    assert "| 4-rank checkpoint restored on |" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # nothing left behind
