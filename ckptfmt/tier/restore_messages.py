"""The messages of the restore across nodes (:mod:`.agreed`), parsed strictly and alike on every rank (MEM-16).

A leader's completeness summaries, the coordinator's choice (the chosen checkpoints, the map of which node holds
which writer ranks, whom it asks for a manifest), its options, each rank's needs and the nodes' union of them: each
a bounded record whose every member is checked, the sender named in the error. No file, no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..decide import COORDINATOR
from ..errors import MalformedMessageError
from ..manifest import checkpoint_id
from .holdings import check_checkpoint_id
from .nodes import NodeMap
from .summary import Completeness, Ranges, parse_ranges

log = logging.getLogger("ckptfmt")

MAX_SUMMARIES = 1024  # checkpoints one node holds: its slots and the replicas it keeps, far fewer


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOption:
    """A checkpoint whose every writer rank's files some live node's memory holds whole."""

    step: int
    checkpoint_id: str
    manifest_bytes: bytes


class RestoreMessages:
    """The parsers of a job's node map: each rank's node (``node_of``) and each node's ranks, lowest first (looked up
    once: :class:`~.nodes.NodeMap`'s ``leader`` and ``ranks_of`` cost O(world) a call)."""

    def __init__(self, nodes: NodeMap) -> None:
        self.node_of = tuple(nodes.nodes)
        self.ranks: dict[str, list[int]] = {}
        for r, n in enumerate(self.node_of):
            self.ranks.setdefault(n, []).append(r)

    def parse_summaries(self, values: Sequence[object]) -> dict[str, list[Completeness]]:
        """Each node's summaries, by the node of the leader that sent them: a leader speaks only for its own node."""
        if len(values) != len(self.node_of):
            raise MalformedMessageError(f"{len(values)} ranks answered, the node map has {len(self.node_of)}")
        out: dict[str, list[Completeness]] = {}
        for rank, value in enumerate(values):
            node = self.node_of[rank]
            if self.ranks[node][0] != rank:
                if value is not None:
                    log.warning(
                        "rank %d is not the leader of node %r, only that node's leader speaks for it", rank, node
                    )
                continue
            if not isinstance(value, dict) or set(value) != {"summaries"} or not isinstance(value["summaries"], list):
                raise MalformedMessageError(f"rank {rank} sent summaries that are not an object of a list")
            if len(value["summaries"]) > MAX_SUMMARIES:
                raise MalformedMessageError(f"rank {rank} sent more than {MAX_SUMMARIES} summaries")
            parsed = [Completeness.from_dict(c, rank=rank) for c in value["summaries"]]
            if len({c.checkpoint_id for c in parsed}) != len(parsed):
                raise MalformedMessageError(f"rank {rank} sent two summaries of one checkpoint")
            out[node] = parsed
        return out

    def parse_choice(
        self, chosen: object
    ) -> tuple[list[tuple[int, str]], dict[str, dict[str, Ranges]], dict[str, int]]:
        """The coordinator's choice, parsed alike on every rank."""
        who = f"rank {COORDINATOR}"
        if not isinstance(chosen, dict) or set(chosen) != {"chosen", "held", "ask"}:
            raise MalformedMessageError(f"{who} sent a choice that is not an object of chosen, held and ask")
        raw, raw_held, raw_ask = chosen["chosen"], chosen["held"], chosen["ask"]
        if not isinstance(raw, list) or not isinstance(raw_held, dict) or not isinstance(raw_ask, dict):
            raise MalformedMessageError(f"{who} sent a choice whose members are not of their types")
        steps: list[tuple[int, str]] = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and is_count(item[0])):
                raise MalformedMessageError(f"{who} sent a chosen checkpoint that is not [step, checkpoint id]")
            steps.append((item[0], check_checkpoint_id(item[1], who)))
        ids = {cid for _, cid in steps}
        if len(ids) != len(steps) or set(raw_held) != ids or not set(raw_ask) <= ids:
            raise MalformedMessageError(f"{who} sent a map of holders or of manifests of other checkpoints")
        held: dict[str, dict[str, Ranges]] = {}
        for cid, by_node in raw_held.items():
            if not isinstance(by_node, dict) or not set(by_node) <= self.ranks.keys():
                raise MalformedMessageError(f"{who} sent holders of {cid} that are not nodes of the job")
            held[cid] = {n: parse_ranges(r, who, f"held by {n[:80]}") for n, r in by_node.items()}
        ask: dict[str, int] = {}
        for cid, rank in raw_ask.items():
            if not (is_count(rank) and rank < len(self.node_of) and rank == self.ranks[self.node_of[rank]][0]):
                raise MalformedMessageError(f"{who} asked a rank that is no node's leader for the manifest of {cid}")
            ask[cid] = rank
        return steps, held, ask

    def node_needs(self, values: Sequence[object]) -> object:
        """The coordinator's union of each node's ranks' needs (writer ranks, as ranges)."""
        if len(values) != len(self.node_of):
            raise MalformedMessageError(f"{len(values)} ranks answered, the node map has {len(self.node_of)}")
        by_node: dict[str, list[Ranges]] = {}
        for rank, value in enumerate(values):
            by_node.setdefault(self.node_of[rank], []).append(parse_ranges(value, f"rank {rank}", "needs"))
        return {node: [list(r) for r in union(ranges)] for node, ranges in by_node.items()}

    def parse_needs(self, decided: object) -> dict[str, Ranges]:
        who = f"rank {COORDINATOR}"
        if not isinstance(decided, dict) or decided.keys() != self.ranks.keys():
            raise MalformedMessageError(f"{who} sent needs that are not an object of the job's nodes")
        return {node: parse_ranges(value, who, f"needs of {node[:80]}") for node, value in decided.items()}


def parse_options(decision: object, steps: Sequence[tuple[int, str]]) -> list[MemoryOption]:
    """The coordinator's options, parsed alike on every rank: each one chosen, its manifest hashing to its id and
    listing the writer ranks the holders were counted against."""
    who = f"rank {COORDINATOR}"
    if not isinstance(decision, list):
        raise MalformedMessageError(f"{who} sent memory options that are not a list")
    chosen = set(steps)
    options: list[MemoryOption] = []
    for raw in decision:
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[2], str) and is_count(raw[0])):
            raise MalformedMessageError(f"{who} sent a memory option that is not [step, checkpoint id, manifest]")
        ckpt_id = check_checkpoint_id(raw[1], who)
        if (raw[0], ckpt_id) not in chosen:
            raise MalformedMessageError(f"{who} sent a memory option it had not chosen: {ckpt_id}")
        data = raw[2].encode("utf-8", "surrogatepass")
        if checkpoint_id(data) != ckpt_id:
            raise MalformedMessageError(f"{who} sent a memory option whose manifest does not hash to {ckpt_id}")
        options.append(MemoryOption(step=raw[0], checkpoint_id=ckpt_id, manifest_bytes=data))
    return options


def held_doc(summaries: Mapping[str, Sequence[Completeness]], ckpt_id: str) -> dict[str, list[list[int]]]:
    return {
        node: [list(r) for c in cs if c.checkpoint_id == ckpt_id for r in c.held]
        for node, cs in summaries.items()
        if any(c.checkpoint_id == ckpt_id and c.held for c in cs)
    }


def union(ranges: Iterable[Ranges]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for rs in ranges for r in rs):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
