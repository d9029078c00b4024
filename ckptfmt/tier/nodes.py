"""Which rank runs on which node, learned from the ranks themselves, and who replicates to whom.

A node is what :func:`~ckptfmt.tier.binding.node_key` names (``$CKPTFMT_NODE_KEY``, else host and boot id),
gathered from every rank at start: never inferred from rank numbers, since a launcher may place ranks in
any order, and a restarted job may place them differently (spec/memory.md, MEM-9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..collective import Collective
from ..errors import CollectiveError


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeMap:
    """The node of each rank, by rank."""

    nodes: tuple[str, ...]

    @classmethod
    def gather(cls, collective: Collective | None, node: str) -> NodeMap:
        """Every rank's node key, on every rank (a collective call)."""
        if collective is None:
            return cls(nodes=(node,))
        keys = collective.gather(node.encode("utf-8"), dst=0)
        data = json.dumps([k.decode("utf-8", "replace") for k in keys]).encode() if keys is not None else None
        nodes = json.loads(collective.broadcast(data, src=0))
        if not isinstance(nodes, list) or len(nodes) != collective.world_size:
            raise CollectiveError("the node map gathered is malformed")
        return cls(nodes=tuple(str(n) for n in nodes))

    @property
    def names(self) -> tuple[str, ...]:
        """The distinct nodes, in order of their lowest rank."""
        return tuple(dict.fromkeys(self.nodes))

    @property
    def multi_node(self) -> bool:
        return len(self.names) > 1

    def ranks_of(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def leader(self, node: str) -> int:
        """The rank that speaks for a node's memory directory: its lowest."""
        return self.ranks_of(node)[0]

    def store_of_rank(self) -> tuple[int, ...]:
        """The index of each rank's node: ranks with one index share a memory directory."""
        index = {n: i for i, n in enumerate(self.names)}
        return tuple(index[n] for n in self.nodes)

    def partners(self) -> dict[int, int]:
        """Source rank -> the rank on another node that holds its replica: the j-th rank of a node sends to the
        j-th rank (modulo its size) of the next node in order, so each copy is on another node and the receivers
        are spread. Empty for a single node: there is nowhere else to put a copy."""
        names = self.names
        if len(names) < 2:
            return {}
        out: dict[int, int] = {}
        for i, node in enumerate(names):
            there = self.ranks_of(names[(i + 1) % len(names)])
            for j, rank in enumerate(self.ranks_of(node)):
                out[rank] = there[j % len(there)]
        return out

    def sources_of(self, rank: int) -> list[int]:
        """The ranks that send their replicas to ``rank``, in rank order."""
        return sorted(src for src, dst in self.partners().items() if dst == rank)
