"""bench/compare.py --quick: the smoke run of the one benchmark (every saver, loader and the size table run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench" / "compare.py"


def test_quick_run_measures_every_peer_and_compresses(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {
        "ckptfmt-raw",
        "ckptfmt-zstd",
        "safetensors",
        "torch.save",
        "dcp.save",
        "ckptfmt",
        "ckptfmt-one-tensor",
        "ckptfmt-mmap",
        "safetensors.load_file",
        "torch.load-mmap",
        "dcp.load",
        "verify",
        "cat",
    }
    for state in ("fp32-adam", "bf16"):
        ops = report["results"][state]
        assert set(ops) == expected
        assert all(m["seconds"] > 0 and m["peak_mib"] >= 0 for m in ops.values())
        sizes = report["sizes"][state]
        # byte grouping beats plain zstd on float states, which compress at all
        assert sizes["ckptfmt-zstd"] < sizes["zstd-1"] < 1.0
    assert "disk: write+fsync" in proc.stdout and "safetensors.load_file" in proc.stdout
    # the disk section: save against O_DIRECT, load and verify (library call and command) against cold cat
    disk = report["disk_section"]
    assert disk["tensors"] == 64 and disk["filesystem"]
    assert set(disk["reads"]) == {
        "ckptfmt",
        "ckptfmt-into",
        "verify",
        "verify-warm",
        "ckpt-verify",
        "ckpt-verify-quiet",
        "cat",
        "dd-nocache",
        "cat-warm",
        "ckpt-help",
    }
    assert all(len(v) == 1 and v[0] > 0 for v in disk["reads"].values())
    (save,) = disk["saves"]
    assert save["ratio"] > 0 and save["odirect"]["seconds"] > 0
    assert {"seconds", "write_s", "fsync_s", "hash_s"} <= set(save["ckptfmt"])
    assert "O_DIRECT MB/s" in proc.stdout and "`ckpt verify DIR` (process)" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # nothing left behind
