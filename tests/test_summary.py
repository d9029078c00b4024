"""Per-node completeness summaries (ckptfmt/tier/summary.py): the coordinator chooses the same checkpoint from a few
ranges of ranks per node as from every node's file lists, never a checkpoint some rank's files are missing from, and
each node plans its own fetches from the broadcast map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt.errors import MalformedMessageError
from ckptfmt.tier import run_identity
from ckptfmt.tier.holdings import Holding, complete, node_holdings, rank_of_file
from ckptfmt.tier.summary import (
    OTHER,
    Completeness,
    choose,
    covers,
    holders_of,
    minus,
    parse_ranges,
    plan_fetches,
    rank_groups,
    summarize,
    to_ranges,
)
from tests.test_replicas import RUN, replicate, spread_snapshot

IDS = [f"sha256:{i:064x}" for i in range(3)]


def groups(writers: int) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {r: {f"weights/r{r:05d}-00000.safetensors": 100 + r} for r in range(writers)}
    out[0]["context.msgpack"] = 7
    out[OTHER] = {"extra/blob.bin": 3}
    return out


@st.composite
def holdings(draw: st.DrawFn) -> tuple[dict[str, list[Holding]], dict[str, dict[int, dict[str, int]]]]:
    """Up to 6 nodes, each holding whole rank groups of up to 3 checkpoints (sometimes one file short)."""
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 6)))]
    of = {cid: groups(draw(st.integers(1, 8))) for cid in IDS}
    out: dict[str, list[Holding]] = {}
    for node in nodes:
        for step, cid in enumerate(IDS):
            ranks = draw(st.sets(st.sampled_from(sorted(of[cid]))))
            files = {p: s for r in ranks for p, s in of[cid][r].items()}
            if files and draw(st.booleans()) and draw(st.booleans()):
                files.pop(sorted(files)[0])  # a torn copy: that rank does not count as held here
            if files:
                holding = Holding(
                    node=node, path=f"/{node}/{cid[-4:]}", kind="peer", checkpoint_id=cid, step=step, files=files
                )
                out.setdefault(node, []).append(holding)
    return out, of


@given(holdings())
@settings(max_examples=300, deadline=None)
def test_the_choice_from_summaries_is_the_choice_from_file_lists(
    job: tuple[dict[str, list[Holding]], dict[str, dict[int, dict[str, int]]]],
) -> None:
    held, of = job
    summaries = {node: summarize(hs, of) for node, hs in held.items()}
    wire = {
        n: [Completeness.from_dict(json.loads(json.dumps(c.to_dict())), rank=0) for c in cs]
        for n, cs in summaries.items()
    }
    assert wire == summaries
    expected = sorted(
        (
            (step, cid)
            for step, cid in enumerate(IDS)
            if all(
                any(
                    all(h.files.get(p) == s for p, s in files.items())
                    for hs in held.values()
                    for h in hs
                    if h.checkpoint_id == cid
                )
                for files in of[cid].values()
            )
        ),
        reverse=True,
    )
    assert choose(summaries) == expected
    for _step, cid in expected:  # every node that needs a rank's files is told a node that holds them whole
        where = holders_of(summaries, cid)
        for node in held:
            for rank, source in plan_fetches(node, of[cid], where).items():
                assert source != node and source in where[rank]


def test_a_node_disagreeing_on_a_checkpoint_s_writers_makes_it_pass_over() -> None:
    honest = Completeness(checkpoint_id=IDS[0], step=5, writers=((0, 4),), held=((0, 4),))
    liar = Completeness(checkpoint_id=IDS[0], step=9, writers=((0, 4),), held=((0, 4),))
    assert choose({"a": [honest]}) == [(5, IDS[0])]
    assert choose({"a": [honest], "b": [liar]}) == []


@pytest.mark.parametrize(
    "doc, member",
    [
        ({"checkpoint_id": "sha256:../x", "step": 1, "writers": [], "held": []}, "not a checkpoint id"),
        ({"checkpoint_id": IDS[0], "step": -1, "writers": [], "held": []}, "step"),
        ({"checkpoint_id": IDS[0], "step": 1, "writers": [[3, 2]], "held": []}, "writers"),
        ({"checkpoint_id": IDS[0], "step": 1, "writers": [], "held": [[0, 4], [2, 6]]}, "held"),
        ({"checkpoint_id": IDS[0], "step": 1, "writers": []}, "four members"),
    ],
)
def test_a_malformed_summary_is_refused_naming_its_sender(doc: object, member: str) -> None:
    with pytest.raises(MalformedMessageError, match=f"rank 3.*{member}|{member}.*rank 3|rank 3"):
        Completeness.from_dict(doc, rank=3)


def test_ranges() -> None:
    assert to_ranges([5, 0, 1, 2, 7, 6, -1]) == ((-1, 3), (5, 8))
    assert covers([((0, 2),), ((2, 4), (6, 7))], ((0, 4),)) and not covers([((0, 2),)], ((0, 3),))
    assert parse_ranges([[-1, 3], [5, 8]], "rank 2", "needs") == ((-1, 3), (5, 8))
    with pytest.raises(MalformedMessageError, match=r"rank 2.*needs"):
        parse_ranges([[0, 3], [2, 8]], "rank 2", "needs")


@given(
    st.sets(st.integers(-1, 40)),
    st.lists(st.sets(st.integers(-1, 40)), max_size=4),
)
def test_minus_is_the_set_difference_without_expanding_ranks(wanted: set[int], taken: list[set[int]]) -> None:
    got = minus(to_ranges(wanted), [to_ranges(t) for t in taken])
    assert got == to_ranges(wanted - set().union(*taken))


def test_real_holdings_after_a_node_loss_summarize_to_the_same_choice(tmp_path: Path) -> None:
    nodes = ("A", "A", "B", "B")
    a, b = spread_snapshot(tmp_path, nodes)
    replicate((a, b), nodes)
    held, manifests = node_holdings(a, node="A", run_id=run_identity(RUN), run_dir=RUN, slot_count=2)
    of = {cid: rank_groups(data) for cid, data in manifests.items()}
    assert choose({"A": summarize(held, of)}) == complete(held, manifests) != []
    slots = [h for h in held if h.kind == "slot"]
    assert choose({"A": summarize(slots, of)}) == complete(slots, manifests) == []


def _whole_by_scanning(held: list[Holding], groups: dict[int, dict[str, int]]) -> set[int]:
    """summarize's rule as first written: every named rank checked against every holding (O(holdings x ranks))."""
    named = {rank_of_file(p) for h in held for p in h.files}
    candidates = {c for c in (OTHER if r is None else r for r in named) if c in groups}
    return {r for r in candidates if any(all(h.files.get(p) == s for p, s in groups[r].items()) for h in held)}


@st.composite
def one_node(draw: st.DrawFn) -> tuple[list[Holding], dict[int, dict[str, int]]]:
    """One checkpoint's holdings on one node, against groups that may break the naming rule (a rank's group listing
    another rank's file, an empty group) and holdings that may be torn, resized or hold extra files."""
    paths = [f"weights/r{r:05d}-0000{i}.safetensors" for r in range(4) for i in range(2)]
    paths += ["context.msgpack", "context.r00002.msgpack", "extra/blob.bin"]
    of: dict[int, dict[str, int]] = {
        rank: {p: draw(st.integers(1, 3)) for p in draw(st.lists(st.sampled_from(paths), max_size=3, unique=True))}
        for rank in draw(st.sets(st.sampled_from([OTHER, 0, 1, 2, 3])))
    }
    held = []
    for i in range(draw(st.integers(0, 5))):
        chosen = draw(st.lists(st.sampled_from(paths), max_size=6, unique=True))
        files = {p: draw(st.integers(1, 3)) for p in chosen}
        held.append(Holding(node="n", path=f"/n/{i}", kind="peer", checkpoint_id=IDS[0], step=1, files=files))
    return held, of


@given(one_node())
@settings(max_examples=500, deadline=None)
def test_summarize_holds_whole_the_ranks_a_scan_of_every_holding_finds(
    node: tuple[list[Holding], dict[int, dict[str, int]]],
) -> None:
    held, groups = node
    got = summarize(held, {IDS[0]: groups})
    if not held:
        assert got == []
        return
    (summary,) = got
    assert summary.held == to_ranges(_whole_by_scanning(held, groups))
