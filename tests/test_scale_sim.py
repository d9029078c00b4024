"""bench/scale_sim.py at a small size: what it reports follows from the placement rule (no timings asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SIM = Path(__file__).resolve().parent.parent / "bench" / "scale_sim.py"


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_sim", SIM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_replica_by_domain_survives_a_node_a_rack_and_a_region(sim: ModuleType) -> None:
    row = sim.simulate(128, 2, 1)
    for loss in ("node", "rack", "region"):
        assert row[f"{loss}_loss"]["restorable"] and row[f"{loss}_steps_lost"] == 0, row
    assert row["trace_steps_lost"]["correlated"] == 0, row  # racks and regions: never both copies
    # a summary is a few ranges per checkpoint: far less into rank 0 than every node's file lists
    assert row["inbound"] * 4 < row["file_lists_inbound"], row
    # the lost node's 2 ranks come back from the one node holding their copies: 2 GiB, on one link
    assert row["node_loss"]["max_into_node"] == 2 * sim.RANK_BYTES, row


def test_two_replicas_survive_what_one_cannot(sim: ModuleType) -> None:
    one, two = sim.simulate(64, 2, 1), sim.simulate(64, 2, 2)
    assert two["trace_steps_lost"]["random"] == 0, two  # two nodes lost at once never take all three copies
    assert one["trace_steps_lost"]["random"] >= two["trace_steps_lost"]["random"]
    assert "| 64 x 2 | 2 |" in sim.table([two])


def test_inbound_grows_linearly_with_nodes(sim: ModuleType) -> None:
    small, large = sim.simulate(64, 2, 1), sim.simulate(256, 2, 1)
    assert large["inbound"] <= 4 * small["inbound"] * 1.1, (small["inbound"], large["inbound"])
    assert large["largest_message"] <= 2 * small["largest_message"], (small, large)
