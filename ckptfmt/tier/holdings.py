"""What each node's memory holds, and the restore every rank agrees on (spec/memory.md, MEM-11 and MEM-12).

A checkpoint of a job spanning several nodes is one manifest whose files are spread over the nodes' slots;
replicas put copies of a node's files on another node. A **holding** is one directory on one node with a
committed manifest and some of the files it lists. At a restore every node's leader lists its holdings; the
coordinator chooses, purely from those lists (:func:`complete`), the newest checkpoint whose every file is held
somewhere, and which rank sends which missing file to which node (:func:`plan_transfers`): deterministic,
spread over the holders, and by what a file is (checkpoint id and path), never by the rank that wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import CheckpointError
from ..manifest import Manifest, checkpoint_id
from ..manifest_parse import parse_manifest
from ..paths import LOCK_NAME, MANIFEST_NAME
from ..reader import read_manifest_bytes
from ..storage.slot import SlotStore
from .binding import SlotBinding, normalize_run_url
from .nodes import NodeMap
from .ring import MemoryTier, private_dir_problem

HoldingKind = Literal["slot", "peer", "fetched"]
PEER_PREFIX = "peer-"
FETCH_PREFIX = "fetched-"


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """A directory on ``node`` holding ``files`` (path -> size) of the committed checkpoint ``checkpoint_id``."""

    node: str
    path: str
    kind: HoldingKind
    checkpoint_id: str
    step: int
    files: Mapping[str, int]

    def to_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "path": self.path,
            "kind": self.kind,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "files": dict(sorted(self.files.items())),
        }

    def to_summary(self) -> dict[str, object]:
        """What ``ckpt ls`` shows of it: where, what kind, which step, how much."""
        return {
            "node": self.node,
            "kind": self.kind,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "files": len(self.files),
            "bytes": sum(self.files.values()),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, object]) -> Holding:
        files = doc["files"]
        assert isinstance(files, Mapping)
        kind = str(doc["kind"])
        if kind not in ("slot", "peer", "fetched"):
            raise ValueError(f"unknown holding kind {kind!r}")
        return cls(
            node=str(doc["node"]),
            path=str(doc["path"]),
            kind=kind,  # type: ignore[arg-type]
            checkpoint_id=str(doc["checkpoint_id"]),
            step=int(str(doc["step"])),
            files={str(k): int(str(v)) for k, v in files.items()},
        )


def node_holdings(
    tier: MemoryTier, *, node: str, run_id: str, run_dir: str, slot_count: int
) -> tuple[list[Holding], dict[str, bytes]]:
    """This node's holdings of the run (its slots, the peer copies it received, files fetched at a restore) and
    their manifests by checkpoint id. Directories of another run, uncommitted or unsafe ones are left out."""
    holdings: list[Holding] = []
    manifests: dict[str, bytes] = {}
    names = [f"slot-{i}" for i in range(slot_count)]
    try:
        names += sorted(n for n in os.listdir(tier.root) if n.startswith((PEER_PREFIX, FETCH_PREFIX)))
    except OSError:
        pass
    for name in names:
        path = os.path.join(tier.root, name)
        if private_dir_problem(path) is not None:
            continue
        store = SlotStore(path)
        try:
            data = read_manifest_bytes(store)
            binding = SlotBinding.from_metadata(parse_manifest(data).metadata)
            present = store.list()
        except CheckpointError:
            continue
        if binding.foreign_to(run_id=run_id, node=None) is not None:
            continue
        if normalize_run_url(binding.run_dir) != normalize_run_url(run_dir):
            continue
        kind: HoldingKind = (
            "slot" if name.startswith("slot-") else "peer" if name.startswith(PEER_PREFIX) else "fetched"
        )
        ckpt_id = checkpoint_id(data)
        files = {p: s for p, s in present.items() if p not in (MANIFEST_NAME, LOCK_NAME)}
        holdings.append(Holding(node=node, path=path, kind=kind, checkpoint_id=ckpt_id, step=binding.step, files=files))
        manifests[ckpt_id] = data
    return holdings, manifests


def held_files(manifest: Manifest, holdings: Iterable[Holding], ckpt_id: str) -> dict[str, list[Holding]]:
    """Each file of ``manifest`` -> the holdings of ``ckpt_id`` that have it at the manifest's size."""
    sizes = {f.path: f.size for f in manifest.files}
    out: dict[str, list[Holding]] = {p: [] for p in sizes}
    for holding in holdings:
        if holding.checkpoint_id != ckpt_id:
            continue
        for path, size in holding.files.items():
            if sizes.get(path) == size:
                out[path].append(holding)
    return out


def complete(holdings: Sequence[Holding], manifests: Mapping[str, bytes]) -> list[tuple[int, str]]:
    """(step, checkpoint id) of every checkpoint whose every file is held somewhere, newest step first
    (ties: the checkpoint id, so that every coordinator orders alike)."""
    found: set[tuple[int, str]] = set()
    for holding in holdings:
        data = manifests.get(holding.checkpoint_id)
        if data is None or (holding.step, holding.checkpoint_id) in found:
            continue
        manifest = parse_manifest(data)
        if all(held_files(manifest, holdings, holding.checkpoint_id).values()):
            found.add((holding.step, holding.checkpoint_id))
    return sorted(found, reverse=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One file sent from a rank on a node that holds it (reading ``source_dir``) to a rank on a node that lacks it."""

    path: str
    size: int
    src: int
    source_dir: str
    dst: int

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "src": self.src, "source_dir": self.source_dir, "dst": self.dst}

    @classmethod
    def from_dict(cls, doc: Mapping[str, object]) -> Transfer:
        return cls(
            path=str(doc["path"]),
            size=int(str(doc["size"])),
            src=int(str(doc["src"])),
            source_dir=str(doc["source_dir"]),
            dst=int(str(doc["dst"])),
        )


def plan_transfers(
    manifest: Manifest,
    ckpt_id: str,
    holdings: Sequence[Holding],
    nodes: NodeMap,
    needs: Sequence[Iterable[str]],
) -> list[Transfer]:
    """The files each node lacks for what its ranks will read (``needs``, by current rank), each from one holder.

    A file goes to a node once (to one of its ranks, spread in turn), from a holder node chosen in turn among
    those that have it, read there by one of that node's ranks in turn: nobody sends or receives everything.
    """
    where = held_files(manifest, holdings, ckpt_id)
    sizes = {f.path: f.size for f in manifest.files}
    transfers: list[Transfer] = []
    turn = 0
    for node in nodes.names:
        ranks = nodes.ranks_of(node)
        wanted = sorted({p for r in ranks for p in needs[r]} & set(sizes))
        for path in wanted:
            holders = sorted(where[path], key=lambda h: (h.node != node, h.kind != "slot", h.node, h.path))
            if not holders or holders[0].node == node:
                continue  # here already (or held nowhere: the coordinator chose a complete checkpoint)
            remote = [h for h in holders if h.node != node]
            holder = remote[turn % len(remote)]
            senders = nodes.ranks_of(holder.node)
            transfers.append(
                Transfer(
                    path=path,
                    size=sizes[path],
                    src=senders[turn % len(senders)],
                    source_dir=holder.path,
                    dst=ranks[turn % len(ranks)],
                )
            )
            turn += 1
    return transfers
