"""Which rank runs on which node, learned from the ranks themselves, and who replicates to whom.

A node is what :func:`~ckptfmt.tier.binding.node_key` names (``$CKPTFMT_NODE_KEY``, else host and boot id),
gathered from every rank at start: never inferred from rank numbers, since a launcher may place ranks in
any order, and a restarted job may place them differently (spec/memory.md, MEM-9). A node's ranks share its
memory directory; :meth:`NodeMap.prove_shared` checks that they do before a snapshot relies on it.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collective import Collective
from ..decide import decide
from ..errors import CheckpointError, MalformedMessageError, StorageError, UsageError
from .binding import NODE_KEY_ENV
from .placement import DOMAIN_ENV, check_replicas, place_ranks, sources
from .ring import MEMORY_DIR_ENV

MAX_NODE_MESSAGE = 64 << 10  # a node key (or a directory path) and the JSON around it
PROOF_PREFIX = ".node-proof-"  # hidden: no listing of the run's memory directory takes it for a slot or a copy
_PROOF = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeMap:
    """The node of each rank, by rank."""

    nodes: tuple[str, ...]
    # each node's failure-domain label (placement.py); a node absent or "" is a domain of its own
    domains: Mapping[str, str] = field(default_factory=dict)
    replicas: int = 1  # copies of each rank's files, on nodes of distinct domains (MEM-19)

    @classmethod
    def gather(cls, collective: Collective | None, node: str, domain: str = "", replicas: int = 1) -> NodeMap:
        """Every rank's node key and failure domain, on every rank (a collective call). A rank that sends something
        other than a non-empty node key and a domain string, or a domain other than its node's other ranks', fails
        every rank at once, with one error naming it."""
        check_replicas(replicas)
        if collective is None:
            return cls(nodes=(node,), domains={node: domain} if domain else {}, replicas=replicas)
        entries = decide(collective, [node, domain], _node_keys, what="the node map", max_size=MAX_NODE_MESSAGE)
        if (
            not isinstance(entries, list)
            or len(entries) != collective.world_size
            or not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in entries)
            or not all(e[0] for e in entries)
        ):
            raise MalformedMessageError("the node map: rank 0 broadcast a malformed one")
        return cls(nodes=tuple(e[0] for e in entries), domains={e[0]: e[1] for e in entries if e[1]}, replicas=replicas)

    def prove_shared(self, collective: Collective | None, root: str | os.PathLike[str]) -> None:
        """Refuse, on every rank at once, ranks that report one node but do not share its memory directory (a
        collective call, once ``root``, this rank's directory of the run in its memory directory, exists).

        Each node's leader writes a file of a random name in its ``root``; every other rank of the node looks for
        it in its own; then the leader removes it. Ranks of one node key that do not see it raise a
        :class:`~ckptfmt.errors.UsageError` naming ``$CKPTFMT_NODE_KEY``, the key and the directories: two
        containers of one host on its network (Kubernetes ``hostNetwork``) report one host name and boot id, but
        each has its own ``/dev/shm``, and each rank's share of a snapshot would be where its node's others never
        see it. A map whose every node has one rank has nothing to prove, and costs no message."""
        if collective is None or all(len(self.ranks_of(n)) == 1 for n in self.names):
            return
        what = "the memory directory check"
        where = os.fspath(root)
        leader = self.leader(self.nodes[collective.rank])
        proof: str | None = None
        roots: list[str] = []  # every rank's, on the coordinator: for the error

        def posted(values: Sequence[Any]) -> list[list[str]]:
            """Each rank's node's proof and leader's directory, once every leader wrote its proof."""
            for rank, value in enumerate(values):
                if not isinstance(value, dict) or not isinstance(value.get("root"), str):
                    raise MalformedMessageError(f"{what}: rank {rank} sent a malformed memory directory")
                is_leader = rank == self.leader(self.nodes[rank])
                if is_leader and not (isinstance(value.get("proof"), str) and _PROOF.fullmatch(value["proof"])):
                    raise MalformedMessageError(f"{what}: rank {rank} sent a malformed proof")
                roots.append(value["root"])
            out = []
            for rank in range(len(values)):
                first = values[self.leader(self.nodes[rank])]
                out.append([first["proof"], first["root"]])
            return out

        def verdict(values: Sequence[Any]) -> bool:
            for rank, value in enumerate(values):
                if not isinstance(value, bool):
                    raise MalformedMessageError(f"{what}: rank {rank} sent a malformed answer")
            blind = [rank for rank, seen in enumerate(values) if not seen]
            if blind:
                raise self._not_shared(blind, roots)
            return True

        mine: object = {"root": where}
        if collective.rank == leader:
            try:
                proof = _write_proof(where)
                mine = {"root": where, "proof": proof}
            except CheckpointError as exc:
                mine = exc
        try:
            plan = decide(collective, mine, posted, what=what, max_size=MAX_NODE_MESSAGE)
            entry = plan[collective.rank] if isinstance(plan, list) and len(plan) == collective.world_size else None
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise MalformedMessageError(f"{what}: rank 0 broadcast a malformed plan")
            seen = collective.rank == leader or _sees_proof(where, entry[0])
            decide(collective, seen, verdict, what=what, max_size=MAX_NODE_MESSAGE)
        finally:
            if proof is not None:
                _remove_proof(where, proof)

    def _not_shared(self, blind: Sequence[int], roots: Sequence[str]) -> UsageError:
        parts = []
        for node in dict.fromkeys(self.nodes[r] for r in blind):
            leader = self.leader(node)
            elsewhere = ", ".join(f"rank {r}'s {roots[r]!r}" for r in blind if self.nodes[r] == node)
            parts.append(
                f"{_ranks(self.ranks_of(node))} report node key {node!r}, but the file rank {leader} wrote in its "
                f"memory directory {roots[leader]!r} is not in {elsewhere}"
            )
        return UsageError(
            "; ".join(parts) + f": the ranks of one node ({NODE_KEY_ENV}, else the host name and boot id) must "
            f"share one memory directory. Give them one (memory_dir=, ${MEMORY_DIR_ENV}), or set "
            f"{NODE_KEY_ENV} to tell apart ranks that do not share one (containers on one host with its network "
            "report the same host name and boot id, each with its own /dev/shm)",
            path=roots[blind[0]],
        )

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

    def partners(self) -> dict[int, tuple[int, ...]]:
        """Source rank -> the ranks on other nodes that hold its ``replicas`` copies, on nodes of distinct failure
        domains (:func:`~.placement.place_ranks`). Empty for a single node: there is nowhere else to put a copy."""
        return place_ranks(self.nodes, self.domains, self.replicas)

    def sources_of(self, rank: int) -> list[int]:
        """The ranks that send their replicas to ``rank``, in rank order."""
        return sources(self.partners(), rank)

    def domain_of(self, node: str) -> str:
        """A node's failure-domain label; the node key itself where it has none."""
        return self.domains.get(node) or node


def _node_keys(values: Sequence[Any]) -> list[list[str]]:
    first: dict[str, str] = {}
    for rank, value in enumerate(values):
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0]):
            raise MalformedMessageError(f"the node map: rank {rank} sent a node key that is not a non-empty string")
        if not isinstance(value[1], str):
            raise MalformedMessageError(f"the node map: rank {rank} sent a failure domain that is not a string")
        if first.setdefault(value[0], value[1]) != value[1]:
            raise UsageError(
                f"rank {rank} reports failure domain {value[1]!r} for node {value[0]!r}, whose other ranks report "
                f"{first[value[0]]!r}: give every rank of a node the same ${DOMAIN_ENV}"
            )
    return [list(v) for v in values]


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _write_proof(root: str) -> str:
    """A file of a random name (its content the same) in ``root``, made here and nowhere else; its name."""
    proof = secrets.token_hex(16)
    path = os.path.join(root, PROOF_PREFIX + proof)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, proof.encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"cannot write in the memory directory: {exc}", path=root) from exc
    return proof


def _sees_proof(root: str, proof: str) -> bool:
    """Whether ``root`` holds the leader's proof: a regular file (never through a link) of that name and content."""
    if _PROOF.fullmatch(proof) is None:  # a name from the coordinator: never a path out of ``root``
        return False
    try:
        fd = os.open(os.path.join(root, PROOF_PREFIX + proof), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 64) == proof.encode("ascii")
    finally:
        os.close(fd)


def _remove_proof(root: str, proof: str) -> None:
    try:
        os.unlink(os.path.join(root, PROOF_PREFIX + proof))
    except OSError:
        pass  # a hidden file of a few bytes: the next proof does not look for it
