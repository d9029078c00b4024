"""A few seeded cases of the lying-rank campaign (tests/hostile/peer_campaign.py) on every test run: mutated
holdings reports and mutated transfers from rank 1 never hang a rank, never escape as a builtin error, never
split the ranks' options, never yield a wrong row, and never touch anything outside the memory directories.
The documented longer run: ``.venv/bin/python tests/hostile/peer_campaign.py --cases 2000``."""

from __future__ import annotations

from pathlib import Path
from random import Random

import pytest
from hostile.peer_campaign import run_case

CASES = 60  # about 0.1 s each


@pytest.mark.parametrize("mode", ["report", "wire"])
def test_a_lying_rank_costs_a_refusal_never_a_wrong_state(tmp_path: Path, mode: str) -> None:
    outcomes = []
    for i in range(CASES // 2):
        work = tmp_path / f"case-{i}"
        work.mkdir()
        outcome, violation = run_case(work, mode, Random(1_000 + i))
        assert violation is None, violation
        outcomes.append(outcome)
    assert outcomes  # each case ended in one of the oracle's accepted outcomes
