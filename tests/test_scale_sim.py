"""bench/scale_sim.py at a small size (64 nodes of 8 ranks, racks of 8, four regions): what it reports follows from
the placement rule and the planning code it runs (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SIM = Path(__file__).resolve().parent.parent / "bench" / "scale_sim.py"
NODES, RANKS, RACK = 64, 8, 8


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_sim", SIM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def racks(job: object) -> list[str]:
    return sorted(set(job.domains.values()))  # type: ignore[attr-defined]


@pytest.mark.parametrize("k", [1, 2])
def test_placed_by_domain_every_single_rack_loss_loses_no_step(sim: ModuleType, k: int) -> None:
    job = sim.Job(NODES, RANKS, k, rack=RACK)
    assert len(racks(job)) == 8
    for rack in racks(job):
        lost = job.domain_nodes(rack)
        assert len(lost) == RACK and job.survives(lost), rack
        got = sim.restore(job, lost)
        assert got.restorable and got.moved == got.lost_bytes == RACK * RANKS * sim.RANK_BYTES, rack
    if k == 2:  # and any two racks at once
        assert all(job.survives(job.domain_nodes(a) | job.domain_nodes(b)) for a in racks(job) for b in racks(job))


def test_placed_by_node_order_a_rack_loss_loses_steps(sim: ModuleType) -> None:
    job = sim.Job(NODES, RANKS, 2, rack=RACK, labelled=False)
    assert not any(job.survives(job.domain_nodes(rack)) for rack in racks(job))


@pytest.mark.parametrize("loss", ["node", "rack", "region"])
@pytest.mark.parametrize("k", [1, 2])
def test_what_a_node_receives_is_what_the_others_send_it(sim: ModuleType, k: int, loss: str) -> None:
    job = sim.Job(NODES, RANKS, k, rack=RACK)
    middle = job.names[NODES // 2]
    lost = {"node": {middle}, "rack": job.domain_nodes(job.domains[middle]), "region": job.domain_nodes("region-1")}[
        loss
    ]
    got = sim.restore(job, lost)
    assert got.restorable
    # each lost node receives its own ranks' bytes, once; nothing goes to a node that kept its memory
    assert got.into == dict.fromkeys(lost, RANKS * sim.RANK_BYTES)
    # the senders' own view of the same pure plans: what each sends, none of it from a lost node
    assert sim.sent_by(job, lost, got.where) == got.out_of
    assert not set(got.out_of) & lost
    assert sum(got.into.values()) == sum(got.out_of.values()) == got.moved == got.lost_bytes
    assert got.max_into_node == max(got.into.values()) and got.max_out_of_node == max(got.out_of.values())
    # with copies placed one to one, no holder sends more than one lost node takes in (a region's racks all sent
    # to one rack of the next region, before: a region loss had it send 2 racks' worth)
    assert got.max_out_of_node <= got.max_into_node
    assert max(len(held) for held in job.held_ranks.values()) == (k + 1) * RANKS


def test_rank0_inbound_with_summaries_does_not_grow_with_files_per_rank(sim: ModuleType) -> None:
    lost = {"node-00032"}
    two, twelve = (sim.restore(sim.Job(NODES, RANKS, 1, rack=RACK, files=f), lost) for f in (2, 12))
    assert (two.inbound, two.largest) == (twelve.inbound, twelve.largest)
    lists = [sim.file_lists(sim.Job(NODES, RANKS, 1, rack=RACK, files=f)) for f in (2, 12)]
    assert lists[1][0] > 3 * lists[0][0]  # today's file lists grow with them (6x the files, 3.5x the bytes)
    assert two.inbound * 10 < lists[0][0]


def test_rank0_inbound_grows_linearly_with_nodes(sim: ModuleType) -> None:
    small, large = (sim.restore(sim.Job(n, RANKS, 1, rack=RACK), {"node-00001"}) for n in (64, 256))
    assert large.inbound <= 4 * small.inbound * 1.1, (small.inbound, large.inbound)


def test_traces_and_the_table(sim: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [sim.simulate(NODES, RANKS, k, rack=RACK) for k in (1, 2)]
    one, two = (r["trace_steps_lost"] for r in rows)
    assert two["random"] == 0  # two nodes lost at once never take all three copies
    assert two["correlated"] == 0  # nor a rack or a region and one more node
    assert one["random"] >= two["random"] and one["correlated"] >= two["correlated"]
    assert rows[1]["trace_steps_lost_by_node_order"]["correlated"] > 0  # a rack takes a node and its next ones
    for row in rows:
        for loss in ("node", "rack", "region"):
            assert row[f"{loss}_loss"]["restorable"] and row[f"{loss}_steps_lost"] == 0, row
    table = sim.table(rows)
    assert "| 64 x 8 | 1 |" in table and "| 64 x 8 | 2 |" in table
    assert sim.main(["--nodes", "16", "32", "--replicas", "1", "--rack", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| 16 x 8 | 1 |") == 1 and "| growth, nodes 2x | 1 |" in printed
    assert sim.main(["--nodes", "16", "--replicas", "2", "--rack", "4", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["nodes"] == 16 and row["k"] == 2 and row["node_loss"]["restorable"]
