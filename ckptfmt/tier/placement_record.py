"""The replica placement of a job, recorded in its run directory (``replica-placement.json``) for ``ckpt ls``.

A record, never read to restore: a restore finds copies by what they are (MEM-11), not by where this says they
went. It holds the replica count and each node's failure-domain label; with a snapshot's ``ckptfmt.memory.nodes``
(the node of each rank that wrote it) the placement is recomputed (it is pure, :mod:`.placement`), so a reader can
tell which domains hold each rank's files of that snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ManifestError
from .placement import MAX_REPLICAS, place_ranks

PLACEMENT_NAME = "replica-placement.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementRecord:
    """``replicas`` copies of each rank's files; ``domains``: node key -> failure-domain label (absent: its own)."""

    replicas: int
    domains: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"replicas": self.replicas, "domains": dict(sorted(self.domains.items()))}

    @classmethod
    def from_dict(cls, data: object) -> PlacementRecord:
        """Parse a record; a :class:`~ckptfmt.errors.ManifestError` naming the member and the file otherwise."""
        if not isinstance(data, dict):
            raise ManifestError("not a JSON object", path=PLACEMENT_NAME)
        replicas = data.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
            raise ManifestError(f"replicas: {replicas!r} is not a count from 1 to {MAX_REPLICAS}", path=PLACEMENT_NAME)
        domains = data.get("domains")
        if not isinstance(domains, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in domains.items()
        ):
            raise ManifestError("domains: not an object of node keys to labels", path=PLACEMENT_NAME)
        return cls(replicas=replicas, domains=dict(domains))

    def domain_of(self, node: str) -> str:
        return self.domains.get(node) or node

    def holders(self, nodes: Sequence[str]) -> list[dict[str, object]]:
        """For each rank of a snapshot written on ``nodes`` (by rank): its node and domain, and the domains of the
        nodes that hold its copies."""
        placed = place_ranks(nodes, self.domains, self.replicas)
        return [
            {
                "rank": rank,
                "node": node,
                "domain": self.domain_of(node),
                "copies": [self.domain_of(nodes[d]) for d in placed.get(rank, ())],
            }
            for rank, node in enumerate(nodes)
        ]
