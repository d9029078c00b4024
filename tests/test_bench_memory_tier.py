"""bench/memory_tier.py's interleaved comparison runs its whole path at a small size (figures not judged)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import memory_tier


def test_the_interleaved_comparison_rotates_the_arms_and_snapshots_every_memory_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = argparse.Namespace(rounds=3, block=3, batch=4)
    work = tmp_path / "w"
    work.mkdir()
    (work / "shm").mkdir()
    monkeypatch.setattr(memory_tier, "WIDTH", 64)  # 1 MiB of state: 21 layers
    out = memory_tier.interleaved(args, 1, work)
    assert (out["rounds"], out["block"]) == (3, 3)
    # one warm-up block, then one block per round: a snapshot at each of their steps
    assert out["snapshots"] == (1 + 3) * 3
    # each round starts with the next arm: no arm always runs first (after the other arms' warm-up or its own)
    assert out["orders"] == [
        ("plain", "memory", "torch.save"),
        ("memory", "torch.save", "plain"),
        ("torch.save", "plain", "memory"),
    ]
    for arm in ("memory", "torch.save"):
        figures = out[arm]
        assert len(figures["ratios"]) == 3 and all(r > 0 for r in figures["ratios"])
        assert figures["min"] <= figures["median"] <= figures["max"]
    assert out["plain_step_s"] > 0
    assert (work / "shm" / "torch.pt").is_file()  # the peer wrote where the snapshots went
