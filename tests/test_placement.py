"""Replica placement (spec/memory.md, MEM-19): k copies on nodes of distinct failure domains, none in the writer's
own where another exists, the same for any order of ranks, and refused where a node's ranks disagree on its domain."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_threads import run_ranks

from ckptfmt.errors import MalformedMessageError, ManifestError, UsageError
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.placement import Domains, domain_path, place_nodes, place_ranks, shared, sources
from ckptfmt.tier.placement_record import PLACEMENT_NAME, PlacementRecord
from ckptfmt.torch.options import MemoryOptions

TIMEOUT = 120.0  # every outcome is reached by a broadcast, never a timeout
RACKS = {"n0": "rack-a", "n1": "rack-a", "n2": "rack-b", "n3": "rack-b", "n4": "rack-c", "n5": "rack-c"}


@st.composite
def jobs(draw: st.DrawFn) -> tuple[dict[str, str], int]:
    """Up to 12 nodes in up to 5 domains (some unlabelled, some nested), and a replica count of 1 to 3."""
    count = draw(st.integers(2, 12))
    labels = draw(
        st.lists(st.sampled_from(["", "r1/a", "r1/b", "r2/a", "r2/c", "r3", "solo"]), min_size=count, max_size=count)
    )
    return {f"node-{i:02d}": label for i, label in enumerate(labels)}, draw(st.integers(1, 3))


def domain(domains: dict[str, str], node: str) -> str:
    return domains[node] or "\0" + node


@given(jobs())
@settings(max_examples=300, deadline=None)
def test_copies_go_to_distinct_domains_never_the_writer_s_own(job: tuple[dict[str, str], int]) -> None:
    domains, k = job
    placed = place_nodes(domains, k)
    distinct = {domain(domains, n) for n in domains}
    for node, targets in placed.items():
        assert node not in targets and len(set(targets)) == len(targets)
        assert len(targets) == min(k, len(domains) - 1)
        others = len(distinct) - 1
        held = [domain(domains, t) for t in targets]
        if others >= len(targets):  # enough other domains: each copy in its own, none in the writer's
            assert len(set(held)) == len(held)
            assert domain(domains, node) not in held
        else:  # every other domain is used before the writer's own, or one twice
            assert set(held) >= distinct - {domain(domains, node)}


@given(jobs(), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_placement_is_stable_across_rank_orders(job: tuple[dict[str, str], int], rng: random.Random) -> None:
    """A restarted job whose launcher put the ranks on the nodes in another order places the same nodes' copies on
    the same nodes: placement reads node keys and labels, never rank numbers."""
    domains, k = job
    nodes = [n for n in domains for _ in range(2)]
    shuffled = nodes[:]
    rng.shuffle(shuffled)

    def by_node(order: list[str]) -> dict[str, set[str]]:
        placed = place_ranks(order, domains, k)
        return {order[r]: {order[d] for d in dsts} for r, dsts in placed.items()}

    assert by_node(nodes) == by_node(shuffled)
    assert place_nodes(domains, k) == place_nodes(dict(reversed(list(domains.items()))), k)


def test_a_rack_is_never_its_own_backup_and_receivers_are_spread() -> None:
    placed = place_nodes(RACKS, 1)
    assert placed == {"n0": ("n2",), "n1": ("n3",), "n2": ("n4",), "n3": ("n5",), "n4": ("n0",), "n5": ("n1",)}
    two = place_nodes(RACKS, 2)
    assert all({RACKS[t] for t in targets} | {RACKS[n]} == {"rack-a", "rack-b", "rack-c"} for n, targets in two.items())


def test_without_labels_each_node_sends_to_the_next_by_key() -> None:
    assert place_nodes({"b": "", "a": "", "c": ""}, 1) == {"a": ("b",), "b": ("c",), "c": ("a",)}
    # node-order alone puts a copy in the writer's rack: the placement a rack loss defeats
    assert place_nodes(dict.fromkeys(RACKS, ""), 1)["n0"] == ("n1",)


def test_another_region_before_another_rack_of_the_same_region() -> None:
    domains = {"a1": "east/r1", "a2": "east/r2", "b1": "west/r1", "b2": "west/r2"}
    assert domain_path("east/r1") == ("east", "r1") and shared(("east", "r1"), ("east", "r2")) == 1
    placed = place_nodes(domains, 2)
    for node, targets in placed.items():
        assert domains[targets[0]].split("/")[0] != domains[node].split("/")[0]  # first copy: the other region
        assert len({domains[t] for t in targets}) == 2


def test_ranks_pair_by_index_and_a_single_node_has_none() -> None:
    nodes = ("n0", "n0", "n2", "n2", "n4", "n4")
    placed = place_ranks(nodes, RACKS, 1)
    assert placed == {0: (2,), 1: (3,), 2: (4,), 3: (5,), 4: (0,), 5: (1,)}
    assert sources(placed, 2) == [0]
    assert place_ranks(("a", "a"), {}, 2) == {}


def test_replicas_are_bounded_and_need_replicate() -> None:
    for bad in (0, 9, True):
        with pytest.raises(UsageError, match="replicas must be"):
            place_nodes(RACKS, bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="give replicate=True"):
        MemoryOptions(every=1, replicas=2)
    assert MemoryOptions(every=1, replicate=True, replicas=2).replicas == 2


def test_nodes_disagreeing_on_a_domain_are_refused() -> None:
    labels = [("A", "rack-1"), ("A", "rack-2"), ("B", "rack-3")]
    out = run_ranks(3, lambda _, c: NodeMap.gather(c, *labels[c.rank]), TIMEOUT)
    assert all(isinstance(e, UsageError) and "rank 1 reports failure domain 'rack-2'" in str(e) for e in out), out
    out = run_ranks(3, lambda _, c: NodeMap.gather(c, "A" if c.rank else "B", "r/x", 2), TIMEOUT)
    assert all(isinstance(m, NodeMap) and m.domain_of("A") == "r/x" and m.replicas == 2 for m in out), out
    assert out[0].domain_of("C") == "C"
    bad = run_ranks(3, lambda _, c: NodeMap.gather(c, "A", 7 if c.rank == 2 else ""), TIMEOUT)  # type: ignore[arg-type]
    assert all(isinstance(e, MalformedMessageError) and "rank 2" in str(e) for e in bad), bad


def test_the_placement_record_round_trips_and_names_a_bad_member() -> None:
    record = PlacementRecord(replicas=2, domains={"n0": "rack-a", "n2": "rack-b"})
    assert PlacementRecord.from_dict(record.to_dict()) == record
    held = record.holders(["n0", "n2", "n4"])
    assert held[0] == {"rank": 0, "node": "n0", "domain": "rack-a", "copies": ["rack-b", "n4"]}
    for bad, member in (
        ({"replicas": 0, "domains": {}}, "replicas"),
        ({"replicas": 1, "domains": {"a": 1}}, "domains"),
    ):
        with pytest.raises(ManifestError, match=member) as info:
            PlacementRecord.from_dict(bad)
        assert info.value.path == PLACEMENT_NAME


@pytest.mark.parametrize("k", [1, 2, 3])
def test_nested_domains_alike_receive_one_to_one(k: int) -> None:
    """4 regions of 5 racks of 3 nodes: each node holds the copies of exactly k nodes, and a region's racks send to
    as many racks of the next region (the next region's first rack alone took them all, before)."""
    domains = {f"n{r}{a}{i}": f"region-{r}/rack-{a}" for r in range(4) for a in range(5) for i in range(3)}
    placed = place_nodes(domains, k)
    received: dict[str, int] = dict.fromkeys(domains, 0)
    for targets in placed.values():
        for t in targets:
            received[t] += 1
    assert set(received.values()) == {k}
    assert placed["n130"][0] == "n230"  # region-1/rack-3 -> region-2/rack-3, node by node
    first = {domains[placed[n][0]] for n in domains if domains[n].startswith("region-1/")}
    assert first == {f"region-2/rack-{a}" for a in range(5)}


def test_a_group_of_fewer_racks_takes_the_writer_s_place_modulo_its_size() -> None:
    domains = {"a0": "east/r0", "a1": "east/r1", "a2": "east/r2", "b0": "west/r0", "b1": "west/r1"}
    placed = place_nodes(domains, 1)
    assert [placed[n] for n in ("a0", "a1", "a2")] == [("b0",), ("b1",), ("b0",)]
    assert [placed[n] for n in ("b0", "b1")] == [("a0",), ("a1",)]


def _picks_by_scan(tree: Domains, at: int, replicas: int) -> list[str]:
    """The rule as the module docstring states it: every other domain ranked by (levels shared with the writer's,
    the most shared with one picked, offset from the writer's place, rotation), the least taken, k times."""
    order, path, place = tree.order, tree.path, tree.place
    own = order[at]
    if not tree.labelled:
        return [order[(at + i) % len(order)] for i in range(1, min(replicas + 1, len(order)))]
    mine = path[own]

    def offset(d: str) -> tuple[int, ...]:
        theirs, out = path[d], []
        for j in range(min(shared(theirs, mine), len(theirs)), len(theirs)):
            names = place[theirs[:j]]
            at_j = place.get(mine[:j], {}).get(mine[j], 0) if j < len(mine) else 0
            out.append((names[theirs[j]] - at_j) % len(names))
        return tuple(out)

    rest = {order[(at + i) % len(order)]: i for i in range(1, len(order))}
    picked: list[str] = []
    while rest and len(picked) < replicas:
        best = min(
            rest,
            key=lambda d: (
                shared(path[d], mine),
                max((shared(path[d], path[p]) for p in picked), default=0),
                offset(d),
                rest[d],
            ),
        )
        del rest[best]
        picked.append(best)
    return picked


LABEL_PARTS = st.lists(st.sampled_from(["a", "b", "c", "d", ""]), min_size=1, max_size=4)


@given(
    st.lists(st.one_of(st.just(""), LABEL_PARTS.map("/".join)), min_size=2, max_size=40),
    st.integers(1, 8),
)
@settings(max_examples=400, deadline=None)
def test_the_walk_down_the_tree_picks_what_ranking_every_domain_picks(labels: list[str], k: int) -> None:
    """Labels of any depth, a label a prefix of another, labels equal but for empty levels (``a//b``, ``a/b``),
    unlabelled nodes among labelled ones."""
    domains = {f"node-{i:02d}": label for i, label in enumerate(labels)}
    names = sorted({(label if domain_path(label) else "\0node:" + node) for node, label in domains.items()})
    tree = Domains(names)
    for at in range(len(names)):
        assert tree.picks(at, k) == _picks_by_scan(tree, at, k), (names[at], k)


def test_the_walk_on_regions_of_racks() -> None:
    names = [f"region-{r}/rack-{a:02d}" for r in range(4) for a in range(9 + r)] + ["region-9", "solo/x/y"]
    tree = Domains(sorted(names))
    for k in (1, 2, 3, 8):
        for at in range(len(tree.order)):
            assert tree.picks(at, k) == _picks_by_scan(tree, at, k)
