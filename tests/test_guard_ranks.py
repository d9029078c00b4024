"""The step guard on 2 gloo ranks (tests/guard_worker.py): bad data on one rank is rolled back, replayed and
quarantined, and the run ends bit-identical to a clean run without those samples; a transient fault costs nothing;
a resume on another world size skips exactly the quarantined samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from process_ranks import launch

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("guard_worker.py")
SAMPLES, SEED, PER_RANK = 240, 3, 4


def run(out: Path, world: int, *args: str, killed: bool = False) -> dict[str, Any]:
    done = launch(WORKER, [str(out), *args], world, timeout=240, check=not killed)
    if killed:
        assert [r.returncode for r in done] == [-9] * world, [r.stdout[-2000:] for r in done]
    result: dict[str, Any] = json.loads((out / f"result-{world}.json").read_text())
    return result


def order() -> list[int]:
    return [int(i) for i in np.random.Generator(np.random.PCG64([SEED, 0])).permutation(SAMPLES)]


def test_bad_data_on_one_rank_is_quarantined_and_the_run_ends_as_a_clean_run_without_it(tmp_path: Path) -> None:
    step6 = order()[5 * 2 * PER_RANK : 6 * 2 * PER_RANK]  # the global batch of step 6 on 2 ranks
    bad = step6[1]  # rank 1's share: the odd places of the global batch (round-robin)
    guarded = run(tmp_path / "guarded", 2, "--nan-sample", str(bad))
    kinds = [(e["step"], e["kind"]) for e in guarded["events"]]
    assert kinds == [(6, "rolled_back"), (6, "quarantined")]
    quarantined = guarded["events"][1]["samples"]
    assert guarded["events"][1]["ranks"] == [1] and sorted(quarantined) == sorted(step6[1::2])
    record = guarded["record"]
    assert len(record) == 1 and record[0]["step"] == 6 and sorted(record[0]["samples"]) == sorted(quarantined)
    assert all(bad not in batch for batch in guarded["batches"].values())

    clean = run(tmp_path / "clean", 2, "--quarantined", ",".join(map(str, quarantined)))
    assert clean["events"] == [] and clean["digest"] == guarded["digest"]


def test_a_transient_fault_on_one_rank_is_replayed_and_costs_nothing(tmp_path: Path) -> None:
    faulty = run(tmp_path / "faulty", 2, "--transient", "5:0")
    assert [(e["step"], e["kind"], e["ranks"]) for e in faulty["events"]] == [
        (5, "rolled_back", [0]),
        (5, "transient", [0]),
    ]
    assert faulty["record"] == []
    clean = run(tmp_path / "clean", 2)
    assert clean["digest"] == faulty["digest"]


def test_a_resume_on_another_world_size_skips_exactly_the_quarantined_samples(tmp_path: Path) -> None:
    bad = order()[5 * 2 * PER_RANK + 1]
    args = ("--nan-sample", str(bad), "--total", "20", "--durable-every", "10")
    first = run(tmp_path, 2, *args, "--die-after", "10", killed=True)  # SIGKILLed after step 10's durable save
    quarantined = set(first["events"][1]["samples"])
    second = run(tmp_path, 1, "--total", "20")  # the run directory's newest checkpoint, on one rank
    assert second["events"] == [] and len(second["record"]) == 1  # the record travels with the data position
    seen = [i for step in range(1, 11) for i in first["batches"][str(step)]]
    seen += [i for step in range(11, 21) for i in second["batches"][str(step)]]
    expected = [i for i in order() if i not in quarantined]
    assert seen == expected[: len(seen)]  # none skipped but the quarantined, none repeated
